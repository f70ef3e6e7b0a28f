"""``linear`` on an FP8 128x128-block weight at decode (``M <= 64`` tokens) in TileLang: the
``"tilelang"`` path of :mod:`deepinfer_cuda_sm100.gemm_dispatch`.

Contract: ``deepinfer_core.ops.linear.linear`` with a ``QuantizedTensor`` weight (``fmt="fp8"``,
e4m3 data ``[N, K]``, one fp32 or ue8m0 scale per 128x128 block): ``y = x @ dequant(W).T``.

**The transposed product.**  At decode the tokens are few while wgmma's M is 64, so a CTA
computes ``D[64, BLOCK_M] = W[64 rows, K] @ X[BLOCK_M, K]^T``: the weights' output features on
wgmma's M side, the tokens (padded to :data:`BLOCK_MS` 16, 32 or 64) its N side, and writes
``y[:, 64 rows]`` through shared memory (coalesced 16-byte rows).  No MMA row is spent on padding.

**The weight stream.**  A producer warpgroup issues TMA loads of the ``[64, 128]`` e4m3 weight
tile (8 KiB, 128-byte swizzled) and the ``[BLOCK_M, 128]`` activation tile (rows past ``M`` come
back as zeros from the TMA unit) into a :data:`STAGES`-deep ring of shared buffers; the consumer
warpgroup (128 threads) turns each weight tile into wgmma's A operand in registers and issues
``wgmma`` with the activations from shared memory (register-A wgmma: the weights cross shared
memory once, as bytes).  Registers are left as the compiler allots them (no ``setmaxnreg``), so
two CTAs fit an SM: ~48 KiB of weights in flight per SM.

**Numerics: bitwise the reference's dequantised weight.**  Each weight is converted
``bf16(float(e4m3) * scale)``: the exact e4m3 value times the block's fp32 scale (a ue8m0 byte
read as the fp32 power of two torch gives it, 0 as 2**-127 and 255 as NaN), rounded once to
bf16 -- the very value ``QuantizedTensor.dequantize(bf16)`` gives.  The product then
accumulates in fp32 over K (wgmma), so the result differs from the reference's ``F.linear`` only
by the order of the fp32 accumulation (no per-block promotion of partial sums, unlike the Triton
kernel).  Only bfloat16 activations are taken.

**Split K.**  When ``N / 64`` CTAs do not fill the GPU, K is cut into ``splits`` equal ranges of
whole 128-blocks (:func:`launch_plan`: the fewest splits that reach :data:`CTAS_PER_SM_TARGET`
CTAs per SM, each range at least :data:`MIN_SPLIT_BLOCKS` blocks); every CTA writes its fp32
partial product to a workspace ``[splits, M, N]`` and a second launch (:func:`build_combine`)
sums the partials in split order and rounds to bf16: deterministic, independent of timing.

Static configurations (compiled once each, TileLang's disk cache keeps them): ``(N, K,
BLOCK_M, splits, stages, scale kind)``; ``M`` is dynamic.  The batch-invariant mode never takes
this path (the dispatcher keeps Triton there).
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as objects.
import functools
from typing import NamedTuple

import torch

BLOCK_N = 64
"""Weight rows (output features) per CTA: one wgmma M atom."""
BLOCK_K = 128
"""Inputs per K step: one scale block."""
SCALE_BLOCK = 128
BLOCK_MS = (16, 32, 64)
"""Token tiles (wgmma's N), the smallest that holds ``M``."""
MAX_M = 64
THREADS = 128
"""Consumer threads (one warpgroup); TileLang adds a producer warpgroup for the TMA loads."""
STAGES = 4
"""Pipeline depth (at most the split's K blocks)."""
MIN_SPLIT_BLOCKS = 2
"""K blocks per split at least."""
CTAS_PER_SM_TARGET = 1.5
"""Split K until ``CTAs >= this x SMs`` (two CTAs fit an SM: about one wave)."""
COMBINE_N = 128
"""Output columns per CTA of the split combine."""
SCALE_KINDS = ("fp32", "ue8m0")


class Plan(NamedTuple):
    """A call's launches: token tile, K splits, K blocks per split, pipeline stages, grid."""

    block_m: int
    splits: int
    blocks_per_split: int
    stages: int
    grid: tuple[int, int]


def launch_plan(m: int, n: int, k: int, sms: int) -> Plan:
    """The :class:`Plan` of an ``[m, k] x [n, k]^T`` call on ``sms`` SMs (shapes only: graph
    capturable): ``BLOCK_M`` the smallest of :data:`BLOCK_MS` that holds ``m``; ``splits`` the
    fewest divisors of ``k / 128`` giving ``n / 64 * splits >= CTAS_PER_SM_TARGET * sms``
    CTAs with at least :data:`MIN_SPLIT_BLOCKS` blocks each (else the most such splits);
    stages ``min(STAGES, blocks per split)``.  ``m <= 64``, ``n`` and ``k`` multiples of 128
    (:func:`problem` checks)."""
    block_m = next(bm for bm in BLOCK_MS if m <= bm)
    k_blocks, tiles = k // BLOCK_K, n // BLOCK_N
    candidates = [
        s for s in range(1, k_blocks + 1) if k_blocks % s == 0 and k_blocks // s >= MIN_SPLIT_BLOCKS
    ]
    splits = 1
    for s in candidates or [1]:
        splits = s
        if tiles * s >= CTAS_PER_SM_TARGET * sms:
            break
    per = k_blocks // splits
    return Plan(block_m, splits, per, min(STAGES, per), (tiles, splits))


def problem(x: torch.Tensor, weight) -> str | None:
    """``None`` when this path takes ``linear(x, weight)``, else why not (one line)."""
    from deepinfer_core.weights.quant import UE8M0_DTYPE, QuantizedTensor

    if not isinstance(weight, QuantizedTensor) or weight.fmt != "fp8" or weight.block != (128, 128):
        return "the TileLang GEMM reads FP8 weights with 128x128 blocks"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype}: the TileLang GEMM takes bfloat16"
    if weight.data.dim() != 2 or weight.scale.dtype not in (torch.float32, UE8M0_DTYPE):
        return "the TileLang GEMM takes a 2-D weight with float32 or ue8m0 scales"
    n, k = weight.data.shape
    m = x.numel() // max(k, 1)
    if not 1 <= m <= MAX_M:
        return f"{m} rows: the TileLang GEMM serves 1 to {MAX_M} (decode)"
    if n % SCALE_BLOCK or k % BLOCK_K:
        return f"weight {n}x{k}: the TileLang GEMM takes multiples of 128"
    if not weight.data.is_contiguous() or not weight.scale.is_contiguous():
        return "the TileLang GEMM reads contiguous FP8 data and scales"
    if weight.data.data_ptr() % 16:
        return "the TileLang GEMM's TMA loads need FP8 data starting 16-byte aligned"
    return None


def scale_kind(weight) -> str:
    """``"fp32"`` or ``"ue8m0"``: the weight's scale format."""
    return "fp32" if weight.scale.dtype == torch.float32 else "ue8m0"


def _scale_value(s, row, col, kind: str):
    """The fp32 scale at ``s[row, col]``: a ue8m0 byte as torch's power of two (0 -> 2**-127,
    255 -> NaN)."""
    import tilelang.language as T

    if kind == "fp32":
        return s[row, col]
    e = T.Cast("uint32", s[row, col])
    special = T.if_then_else(e == 255, T.uint32(0x7FC00000), e << 23)
    bits = T.if_then_else(e == 0, T.uint32(0x00400000), special)
    return T.reinterpret(bits, "float32")


def build_gemm(n: int, k: int, block_m: int, splits: int, stages: int, kind: str):
    """The GEMM ``prim_func``: grid ``(N / 64, splits)``.  With ``splits == 1`` it writes
    ``y [M, N]`` (bf16), else its fp32 partial to ``ws [splits, M, N]``."""
    import tilelang
    import tilelang.language as T

    per = k // BLOCK_K // splits
    m_dyn = T.dynamic("M")
    sdt = "float32" if kind == "fp32" else "uint8"
    out_shape, out_dtype = ((m_dyn, n), "bfloat16") if splits == 1 else ((splits, m_dyn, n), "float32")

    @T.prim_func
    def fp8_gemm(
        x: T.Tensor((m_dyn, k), "bfloat16"),
        w: T.Tensor((n, k), "float8_e4m3"),
        s: T.Tensor((n // SCALE_BLOCK, k // BLOCK_K), sdt),
        out: T.Tensor(out_shape, out_dtype),
    ):
        with T.Kernel(n // BLOCK_N, splits, threads=THREADS) as (nb, sp):
            T.disable_warp_group_reg_alloc()  # two CTAs an SM: no setmaxnreg split
            w_sh = T.alloc_shared((BLOCK_N, BLOCK_K), "float8_e4m3")
            x_sh = T.alloc_shared((block_m, BLOCK_K), "bfloat16")
            s_sh = T.alloc_shared((per,), "float32")
            w_reg = T.alloc_fragment((BLOCK_N, BLOCK_K), "bfloat16")
            acc = T.alloc_fragment((BLOCK_N, block_m), "float32")
            c_sh = T.alloc_shared((block_m, BLOCK_N), out_dtype)
            T.annotate_layout({w_sh: tilelang.layout.make_swizzled_layout(w_sh)})
            for i in T.Parallel(per):
                s_sh[i] = _scale_value(s, nb * BLOCK_N // SCALE_BLOCK, sp * per + i, kind)
            T.clear(acc)
            for kk in T.Pipelined(per, num_stages=stages):
                T.copy(w[nb * BLOCK_N, (sp * per + kk) * BLOCK_K], w_sh)
                T.copy(x[0, (sp * per + kk) * BLOCK_K], x_sh)
                for i, j in T.Parallel(BLOCK_N, BLOCK_K):  # the reference's dequantised weight
                    w_reg[i, j] = T.Cast("bfloat16", T.Cast("float32", w_sh[i, j]) * s_sh[kk])
                T.gemm(w_reg, x_sh, acc, transpose_B=True)
            for i, j in T.Parallel(BLOCK_N, block_m):
                c_sh[j, i] = T.Cast(out_dtype, acc[i, j])
            for j, i in T.Parallel(block_m, BLOCK_N):
                if j < m_dyn:
                    if splits == 1:
                        out[j, nb * BLOCK_N + i] = c_sh[j, i]
                    else:
                        out[sp, j, nb * BLOCK_N + i] = c_sh[j, i]

    return fp8_gemm


def build_combine(n: int, splits: int):
    """The split combine ``prim_func``: grid ``(N / 128, M)``; ``y[m, :] = bf16(sum_s ws[s, m, :])``
    summed in split order."""
    import tilelang.language as T

    m_dyn = T.dynamic("M")

    @T.prim_func
    def fp8_gemm_combine(ws: T.Tensor((splits, m_dyn, n), "float32"), y: T.Tensor((m_dyn, n), "bfloat16")):
        with T.Kernel(n // COMBINE_N, m_dyn, threads=COMBINE_N) as (nb, row):
            total = T.alloc_fragment((COMBINE_N,), "float32")
            T.clear(total)
            for sp in T.serial(splits):
                for i in T.Parallel(COMBINE_N):
                    total[i] += ws[sp, row, nb * COMBINE_N + i]
            for i in T.Parallel(COMBINE_N):
                y[row, nb * COMBINE_N + i] = T.Cast("bfloat16", total[i])

    return fp8_gemm_combine


PASS_CONFIGS: dict = {}
"""TileLang's defaults: TMA loads, a warp-specialised producer."""


@functools.cache
def _kernel(kind: str, *args):
    """A compiled kernel: ``("gemm", n, k, block_m, splits, stages, scale kind)`` or
    ``("combine", n, splits)``."""
    import tilelang

    func = build_gemm(*args) if kind == "gemm" else build_combine(*args)
    return tilelang.compile(func, out_idx=None, target="cuda", pass_configs=PASS_CONFIGS)


def configurations(n: int, k: int, sms: int) -> list[tuple]:
    """``_kernel`` arguments of every launch of an ``N x K`` weight at ``M <= 64`` on ``sms``
    SMs, both scale kinds (:mod:`deepinfer_cuda_sm100.tl.precompile`)."""
    out = []
    for m in BLOCK_MS:
        plan = launch_plan(m, n, k, sms)
        for kind in SCALE_KINDS:
            out.append(("gemm", n, k, plan.block_m, plan.splits, plan.stages, kind))
        if plan.splits > 1:
            out.append(("combine", n, plan.splits))
    return list(dict.fromkeys(out))


def linear_fp8(x: torch.Tensor, weight) -> torch.Tensor:
    """``linear(x, weight)`` by the TileLang GEMM (:func:`problem` must be ``None``)."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import sm_count

    n, k = weight.data.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.clone(memory_format=torch.contiguous_format)
    m = x2.shape[0]
    plan = launch_plan(m, n, k, sm_count(x.device))
    kind = scale_kind(weight)
    scale = weight.scale if kind == "fp32" else weight.scale.view(torch.uint8)
    gemm = _kernel("gemm", n, k, plan.block_m, plan.splits, plan.stages, kind)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if plan.splits == 1:
        gemm(x2, weight.data, scale, y)
    else:
        ws = torch.empty(plan.splits, m, n, device=x.device, dtype=torch.float32)
        gemm(x2, weight.data, scale, ws)
        _kernel("combine", n, plan.splits)(ws, y)
    return y.reshape(*lead, n)
