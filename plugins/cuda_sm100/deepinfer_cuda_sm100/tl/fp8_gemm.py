"""``linear`` on an FP8 128x128-block weight at decode and small batches (``M <= 256`` tokens) in
TileLang: the ``"tilelang"`` path of :mod:`deepinfer_cuda_sm100.gemm_dispatch`.

Contract: ``deepinfer_core.ops.linear.linear`` with a ``QuantizedTensor`` weight (``fmt="fp8"``,
e4m3 data ``[N, K]``, one fp32 or ue8m0 scale per 128x128 block): ``y = x @ dequant(W).T``.

**The transposed product.**  At decode the tokens are few while wgmma's M is 64, so a CTA
computes ``D[BLOCK_N, BLOCK_M] = W[BLOCK_N rows, K] @ X[BLOCK_M, K]^T``: the weights' output
features on wgmma's M side, the tokens (padded to the smallest of :data:`BLOCK_MS` 16 ... 256
that holds ``M``) its N side, and writes ``y[:, BLOCK_N rows]`` through shared memory
(coalesced 16-byte rows).  No MMA row is spent on padding.

**Two tile kinds** (:func:`tile`).  *Narrow* (``BLOCK_M <= 64``): ``BLOCK_N = 64``, one
consumer warpgroup, two CTAs an SM.  *Wide* (``BLOCK_M`` 128 or 256): ``BLOCK_N = 128``, two
consumer warpgroups, each the wgmma of its own 64 weight rows against the shared activation tile
(so every activation byte brought into shared memory serves 128 weight rows, not 64), one CTA an
SM with TileLang's register split between producer and consumers (``setmaxnreg``: the 256-token
tile holds a 128-float accumulator per thread); while one warpgroup converts its weight tile the
other's wgmma runs.

**The weight stream.**  A producer warpgroup issues TMA loads of the ``[BLOCK_N, 128]`` e4m3
weight tile (8 or 16 KiB, 128-byte swizzled) and the ``[BLOCK_M, 128]`` activation tile (rows
past ``M`` come back as zeros from the TMA unit) into a ring of shared buffers; the consumer
warpgroups turn each weight tile into wgmma's A operand in registers and issue ``wgmma`` with
the activations from shared memory (register-A wgmma: the weights cross shared memory once, as
bytes).  Narrow tiles leave registers as the compiler allots them (no ``setmaxnreg``), so two
CTAs fit an SM: ~48 KiB of weights in flight per SM; wide tiles keep their stages within one
SM's shared memory (:func:`tile`: 4 stages of 48 KiB at ``BLOCK_M = 128``, 2 of 80 KiB at 256;
TileLang lays the epilogue's buffer over the drained stages).

**Numerics: bitwise the reference's dequantised weight.**  Each weight is converted
``bf16(float(e4m3) * scale)``: the exact e4m3 value times the block's fp32 scale (a ue8m0 byte
read as the fp32 power of two torch gives it, 0 as 2**-127 and 255 as NaN), rounded once to
bf16 -- the very value ``QuantizedTensor.dequantize(bf16)`` gives.  The product then
accumulates in fp32 over K (wgmma), so the result differs from the reference's ``F.linear`` only
by the order of the fp32 accumulation (no per-block promotion of partial sums, unlike the Triton
kernel).  Only bfloat16 activations are taken.

**Split K.**  When ``N / BLOCK_N`` CTAs do not fill the GPU, K is cut into ``splits`` equal ranges
of whole 128-blocks (:func:`launch_plan`: the fewest splits that reach the tile kind's CTAs per SM
target, each range at least :data:`MIN_SPLIT_BLOCKS` blocks, unless the dispatcher passes the
count measured fastest at the shape, :mod:`deepinfer_cuda_sm100.gemm_splits`); every CTA writes its fp32
partial product to a workspace ``[splits, M, N]``, counts its arrival in its tile's counter
(:mod:`deepinfer_cuda_sm100.kernels.split_counters`, shared with the Triton GEMM) and the tile's
last CTA to arrive sums the partials in split order, rounds to bf16 and resets the counter
(:func:`fused_reduction`): deterministic, independent of timing and of which CTA comes last.
With ``DEEPINFER_FP8_SPLITK=separate`` (or a CUDA-graph capture before any eager call made the
counters) a second launch (:func:`build_combine`) sums them instead, to the same bits.

**The grouped projection** (``grouped_linear``, :func:`grouped_linear_fp8`): the ``[G*N, K]``
weight is one GEMM of ``G*N`` rows; a CTA's rows lie in one group (``N`` a multiple of 128), and
its activation tiles come from that group's ``K`` inputs of ``x [T, G*K]``.  One launch (and
one combine) for every group.

**Programmatic dependent launch.**  Where the Triton kernels use PDL, the GEMM and the combine
run :func:`deepinfer_cuda_sm100.tl.pdl.prologue` (wait for the kernel before, then let the next
one be scheduled), so their launch overlaps the previous kernel's tail; the GEMM reads its
block scales (a weight: no kernel of a step writes them) before the wait, so that memory round
trip overlaps the tail too, and everything else after it.

Static configurations (compiled once each, TileLang's disk cache keeps them): ``(N, K,
BLOCK_M, splits, stages, scale kind, pdl, groups[, wide, fused])``; ``M`` is dynamic.  The batch-invariant
mode never takes this path (the dispatcher keeps Triton there).
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as objects.
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from deepinfer_cuda_sm100.tl.compile_log import logged_compile
from deepinfer_cuda_sm100.tl.pdl import prologue, tl_pdl_enabled
from deepinfer_cuda_sm100.tl.target import cuda_target

logger = logging.getLogger("deepinfer.cuda_sm100")

BLOCK_N = 64
"""Weight rows (output features) per CTA of a narrow tile: one wgmma M atom."""
WIDE_BLOCK_N = 128
"""Weight rows per CTA of a wide tile: one wgmma M atom per consumer warpgroup."""
BLOCK_K = 128
"""Inputs per K step: one scale block."""
SCALE_BLOCK = 128
BLOCK_MS = (16, 32, 64, 128, 256)
"""Token tiles (wgmma's N), the smallest that holds ``M``."""
NARROW_MAX_M = 64
"""The widest token tile of the narrow kind (:func:`tile`)."""
MAX_M = BLOCK_MS[-1]
THREADS = 128
"""Consumer threads of a warpgroup; TileLang adds a producer warpgroup for the TMA loads."""
STAGES = 4
"""Pipeline depth (at most the split's K blocks and the tile kind's cap, :func:`tile`)."""
MIN_SPLIT_BLOCKS = 2
"""K blocks per split at least."""
CTAS_PER_SM_TARGET = 1.5
"""Narrow tiles: split K until ``CTAs >= this x SMs`` (two CTAs fit an SM: about one wave)."""
WIDE_CTAS_PER_SM_TARGET = 0.9
"""Wide tiles: split K until ``CTAs >= this x SMs`` (one CTA an SM: one wave, a few SMs idle
rather than another split's fp32 partials)."""
COMBINE_N = 128
"""Output columns per CTA of the split combine."""
REDUCE_ROWS = 16
"""Token rows a fused split reduction sums at a time (:func:`fused_reduction`)."""
SCALE_KINDS = ("fp32", "ue8m0")


class Tile(NamedTuple):
    """A token tile's kind: weight rows and consumer threads per CTA, stage cap, CTAs-per-SM target."""

    block_n: int
    threads: int
    max_stages: int
    ctas_per_sm: float


def tile(block_m: int, wide: bool = False) -> Tile:
    """The kind of token tile ``block_m`` (one of :data:`BLOCK_MS`): narrow (``<= 64``: 64 weight
    rows, one consumer warpgroup, two CTAs an SM) or wide (128 weight rows, two consumer
    warpgroups, one CTA an SM, as many stages of ``128 x 128`` weight bytes plus ``BLOCK_M x 128``
    bf16 activations as fit in ~160-192 KiB of shared memory).  ``wide`` takes the wide kind at
    ``<= 64`` too: two warpgroups' weight rows share each activation tile, half the activation
    reads of the narrow kind (``bench_fp8_gemm.py`` times it; never dispatched)."""
    if block_m <= NARROW_MAX_M and not wide:
        return Tile(BLOCK_N, THREADS, STAGES, CTAS_PER_SM_TARGET)
    stage_bytes = WIDE_BLOCK_N * BLOCK_K + block_m * BLOCK_K * 2
    return Tile(WIDE_BLOCK_N, 2 * THREADS, min(STAGES, 192 * 1024 // stage_bytes), WIDE_CTAS_PER_SM_TARGET)


class Plan(NamedTuple):
    """A call's launches: token tile, K splits, K blocks per split, pipeline stages, grid."""

    block_m: int
    splits: int
    blocks_per_split: int
    stages: int
    grid: tuple[int, int]


def split_candidates(k: int) -> list[int]:
    """The K splits a ``K``-input call may take: the divisors of ``k / 128`` leaving at least
    :data:`MIN_SPLIT_BLOCKS` blocks a split (just 1 where none does)."""
    k_blocks = k // BLOCK_K
    found = [s for s in range(1, k_blocks + 1) if k_blocks % s == 0 and k_blocks // s >= MIN_SPLIT_BLOCKS]
    return found or [1]


def launch_plan(m: int, n: int, k: int, sms: int, wide: bool = False, splits: int | None = None) -> Plan:
    """The :class:`Plan` of an ``[m, k] x [n, k]^T`` call on ``sms`` SMs (shapes only: graph
    capturable): ``BLOCK_M`` the smallest of :data:`BLOCK_MS` that holds ``m``; ``splits`` the
    given count (one of :func:`split_candidates`; a measured one,
    :mod:`deepinfer_cuda_sm100.gemm_splits`), else the fewest candidates giving ``n / BLOCK_N *
    splits >= target * sms`` CTAs (the tile kind's ``BLOCK_N`` and target, :func:`tile`; else
    the most); stages ``min(the kind's cap, blocks per split)``.  ``m <= 256``, ``n`` and ``k``
    multiples of 128 (:func:`problem` checks); ``wide``: the wide kind at every ``m``
    (:func:`tile`)."""
    block_m = next(bm for bm in BLOCK_MS if m <= bm)
    kind = tile(block_m, wide)
    k_blocks, tiles = k // BLOCK_K, n // kind.block_n
    candidates = split_candidates(k)
    if splits is not None and splits not in candidates:
        raise ValueError(f"splits={splits}: a K of {k} splits into one of {candidates}")
    if splits is None:
        for splits in candidates:
            if tiles * splits >= kind.ctas_per_sm * sms:
                break
    per = k_blocks // splits
    return Plan(block_m, splits, per, min(kind.max_stages, per), (tiles, splits))


def problem(x: torch.Tensor, weight, groups: int = 0) -> str | None:
    """``None`` when this path takes ``linear(x, weight)`` (``groups=0``) or
    ``grouped_linear(x [T, G, K], weight [G*N, K])`` (``groups=G``), else why not (one line)."""
    from deepinfer_core.weights.quant import UE8M0_DTYPE, QuantizedTensor

    if not isinstance(weight, QuantizedTensor) or weight.fmt != "fp8" or weight.block != (128, 128):
        return "the TileLang GEMM reads FP8 weights with 128x128 blocks"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype}: the TileLang GEMM takes bfloat16"
    if weight.data.dim() != 2 or weight.scale.dtype not in (torch.float32, UE8M0_DTYPE):
        return "the TileLang GEMM takes a 2-D weight with float32 or ue8m0 scales"
    n, k = weight.data.shape
    m = x.numel() // max(k * max(groups, 1), 1)
    if not 1 <= m <= MAX_M:
        return f"{m} rows: the TileLang GEMM serves 1 to {MAX_M}"
    if n % SCALE_BLOCK or k % BLOCK_K:
        return f"weight {n}x{k}: the TileLang GEMM takes multiples of 128"
    if groups and (x.dim() != 3 or x.shape[1:] != (groups, k) or n % (groups * WIDE_BLOCK_N)):
        return (
            f"x {tuple(x.shape)}, weight {n}x{k}: the grouped TileLang GEMM takes [T, {groups}, {k}] "
            f"and a multiple of {WIDE_BLOCK_N} rows a group"
        )
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


def fix_wgmma_accumulator_fence() -> None:
    """Make TileLang fence exactly a warpgroup's accumulator registers around its wgmma.

    TileLang 0.1.15 counts ``block rows / 64`` accumulator atoms per thread where each warpgroup
    holds ``4 x warp rows / 64`` of them; the two differ when the warps stand in one column over
    two warpgroups (the wide tile's ``FullRow`` policy), and the fence then names registers past
    the accumulator array (nvcc 13 drops those accesses, but they are out of bounds).  This
    counts the warpgroup's own atoms: the same number wherever the two agreed, so the kernels
    TileLang compiles afterwards in the process change only where the count was wrong.
    Idempotent; a TileLang without these emitter properties is left as it is."""
    try:
        from tilelang.cuda.intrinsics.macro import wgmma_macro_generator as gen
    except ImportError:
        logger.debug("TileLang has no wgmma emitter module: its accumulator fence is left as it is")
        return
    emitter = gen.TensorCoreIntrinEmitter
    if getattr(emitter, "_warpgroup_fence_fixed", False):
        return
    if not all(hasattr(emitter, name) for name in ("wgmma_accum_regs", "wgmma_num_inst_m")):
        logger.debug("TileLang's wgmma emitter changed: its accumulator fence is left as it is")
        return

    def accum_regs(self) -> int:
        bits = gen.DataType(self.accum_dtype).bits
        return (self.wgmma_num_inst_m * self.warp_cols * self.local_size_out * bits + 31) // 32

    emitter.wgmma_accum_regs = property(accum_regs)
    emitter._warpgroup_fence_fixed = True


def build_gemm(
    n: int,
    k: int,
    block_m: int,
    splits: int,
    stages: int,
    kind: str,
    pdl: bool = False,
    groups: int = 1,
    wide: bool = False,
    fused: bool = False,
):
    """The GEMM ``prim_func``: grid ``(N / BLOCK_N, splits)`` (``BLOCK_N`` of the token tile's
    kind, :func:`tile`).  With ``splits == 1`` it writes ``y [M, N]`` (bf16), else its fp32
    partial to ``ws [splits, M, N]``; ``fused`` (with ``splits > 1``): it takes ``y`` and the
    tile counters ``[N / BLOCK_N]`` (int32, zero) too and each tile's last CTA sums the partials
    into ``y`` (:func:`fused_reduction`).  With ``pdl`` it reads its block scales, then runs the PDL
    prologue (:func:`deepinfer_cuda_sm100.tl.pdl.prologue`) before anything else.

    ``groups > 1``: the grouped projection (``grouped_linear``): ``x`` is ``[M, groups * K]``
    (``[T, G, K]`` flattened) and weight rows ``g N / groups ..`` multiply group ``g``'s ``K``
    inputs (``N / groups`` a multiple of ``BLOCK_N``: a CTA's rows lie in one group).  ``wide``:
    the wide tile kind at ``block_m <= 64`` too (:func:`tile`)."""
    import tilelang
    import tilelang.language as T

    block_n, threads, _, _ = tile(block_m, wide)
    wide = block_n != BLOCK_N
    fix_wgmma_accumulator_fence()
    per = k // BLOCK_K // splits
    start = prologue()
    m_dyn = T.dynamic("M")
    sdt = "float32" if kind == "fp32" else "uint8"
    out_shape, out_dtype = ((m_dyn, n), "bfloat16") if splits == 1 else ((splits, m_dyn, n), "float32")
    group_rows = n // groups
    fused = fused and splits > 1
    reduce_tile = fused_reduction(splits, block_n, block_m, m_dyn)

    @T.macro
    def tiles(x, w, s, out, y, counters):
        with T.Kernel(n // block_n, splits, threads=threads) as (nb, sp):
            if not wide:
                T.disable_warp_group_reg_alloc()  # two CTAs an SM: no setmaxnreg split
            w_sh = T.alloc_shared((block_n, BLOCK_K), "float8_e4m3")
            x_sh = T.alloc_shared((block_m, BLOCK_K), "bfloat16")
            s_sh = T.alloc_shared((per,), "float32")
            w_reg = T.alloc_fragment((block_n, BLOCK_K), "bfloat16")
            acc = T.alloc_fragment((block_n, block_m), "float32")
            c_sh = T.alloc_shared((block_m, block_n), out_dtype)
            T.annotate_layout({w_sh: tilelang.layout.make_swizzled_layout(w_sh)})
            for i in T.Parallel(per):
                s_sh[i] = _scale_value(s, nb * block_n // SCALE_BLOCK, sp * per + i, kind)
            if pdl:
                start()
            T.clear(acc)
            for kk in T.Pipelined(per, num_stages=stages):
                T.copy(w[nb * block_n, (sp * per + kk) * BLOCK_K], w_sh)
                T.copy(x[0, (nb * block_n // group_rows) * k + (sp * per + kk) * BLOCK_K], x_sh)
                for i, j in T.Parallel(block_n, BLOCK_K):  # the reference's dequantised weight
                    w_reg[i, j] = T.Cast("bfloat16", T.Cast("float32", w_sh[i, j]) * s_sh[kk])
                # every warpgroup its own 64 weight rows against all the tokens
                T.gemm(w_reg, x_sh, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block_n, block_m):
                c_sh[j, i] = T.Cast(out_dtype, acc[i, j])
            for j, i in T.Parallel(block_m, block_n):
                if j < m_dyn:
                    if splits == 1:
                        out[j, nb * block_n + i] = c_sh[j, i]
                    else:
                        out[sp, j, nb * block_n + i] = c_sh[j, i]
            if fused:
                reduce_tile(out, y, counters, nb)

    x_t = T.Tensor((m_dyn, groups * k), "bfloat16")
    w_t = T.Tensor((n, k), "float8_e4m3")
    s_t = T.Tensor((n // SCALE_BLOCK, k // BLOCK_K), sdt)
    if not fused:

        @T.prim_func
        def fp8_gemm(x: x_t, w: w_t, s: s_t, out: T.Tensor(out_shape, out_dtype)):
            tiles(x, w, s, out, None, None)

        return fp8_gemm

    @T.prim_func
    def fp8_gemm_fused(
        x: x_t,
        w: w_t,
        s: s_t,
        ws: T.Tensor(out_shape, out_dtype),
        y: T.Tensor((m_dyn, n), "bfloat16"),
        counters: T.Tensor((n // block_n,), "int32"),
    ):
        tiles(x, w, s, ws, y, counters)

    return fp8_gemm_fused


def fused_reduction(splits: int, block_n: int, block_m: int, m_dyn):
    """A TileLang macro ending a split GEMM's CTA (tile ``nb``, its partial stored in ``ws``): the
    tile's last CTA to arrive (an acquire-release count in ``counters[nb]``) sums the tile's
    ``splits`` partials in split order, as :func:`build_combine`, in rows of
    :data:`REDUCE_ROWS`, writes ``y`` and resets the counter to zero for the next launch."""
    import tilelang.language as T

    rows = min(REDUCE_ROWS, block_m)

    @T.macro
    def reduce_tile(ws, y, counters, nb):
        arrived = T.alloc_shared((1,), "int32")
        T.call_extern("handle", "__threadfence")  # this thread's partial is visible GPU-wide
        T.sync_threads()
        if T.get_thread_binding() == 0:
            arrived[0] = T.atomic_add(counters[nb], 1, memory_order="acq_rel", return_prev=True)
        T.sync_threads()
        if arrived[0] == splits - 1:
            T.call_extern("handle", "__threadfence")  # every split's partial is seen
            total = T.alloc_fragment((rows, block_n), "float32")
            for r in T.serial(block_m // rows):
                T.clear(total)
                for sp in T.serial(splits):
                    for j, i in T.Parallel(rows, block_n):
                        if r * rows + j < m_dyn:
                            total[j, i] += ws[sp, r * rows + j, nb * block_n + i]
                for j, i in T.Parallel(rows, block_n):
                    if r * rows + j < m_dyn:
                        y[r * rows + j, nb * block_n + i] = T.Cast("bfloat16", total[j, i])
            if T.get_thread_binding() == 0:
                counters[nb] = 0

    return reduce_tile


def build_combine(n: int, splits: int, pdl: bool = False):
    """The split combine ``prim_func``: grid ``(N / 128, M)``; ``y[m, :] = bf16(sum_s ws[s, m, :])``
    summed in split order (with ``pdl``, after waiting for the GEMM:
    :func:`deepinfer_cuda_sm100.tl.pdl.prologue`)."""
    import tilelang.language as T

    start = prologue()
    m_dyn = T.dynamic("M")

    @T.prim_func
    def fp8_gemm_combine(ws: T.Tensor((splits, m_dyn, n), "float32"), y: T.Tensor((m_dyn, n), "bfloat16")):
        with T.Kernel(n // COMBINE_N, m_dyn, threads=COMBINE_N) as (nb, row):
            if pdl:
                start()
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
@logged_compile("fp8_gemm")
def _kernel(kind: str, *args):
    """A compiled kernel: ``("gemm", n, k, block_m, splits, stages, scale kind, pdl, groups[,
    wide[, fused]])`` or ``("combine", n, splits, pdl)``."""
    import tilelang

    func = build_gemm(*args) if kind == "gemm" else build_combine(*args)
    return tilelang.compile(func, out_idx=None, target=cuda_target(), pass_configs=PASS_CONFIGS)


def configurations(
    n: int, k: int, sms: int, groups: int = 1, splits_of: Callable[[int], list[int | None]] | None = None
) -> list[tuple]:
    """``_kernel`` arguments of every launch of an ``N x K`` weight (``groups`` row blocks of a
    grouped projection, each on its own ``K`` inputs) at ``M <= 256`` on ``sms`` SMs, both scale
    kinds, with programmatic dependent launch where this device takes it
    (:mod:`deepinfer_cuda_sm100.tl.precompile`); ``splits_of(block_m)``: the split counts to
    compile at that token tile (``None``: :func:`launch_plan`'s rule), default the rule's."""
    pdl = tl_pdl_enabled()
    out = []
    for m in BLOCK_MS:
        for splits in splits_of(m) if splits_of else [None]:
            plan = launch_plan(m, n, k, sms, splits=splits)
            fused = (False, True) if plan.splits > 1 else ()
            for kind in SCALE_KINDS:
                out.append(("gemm", n, k, plan.block_m, plan.splits, plan.stages, kind, pdl, groups, *fused))
    return list(dict.fromkeys(out))


def _gemm(
    x2: torch.Tensor, weight, groups: int, wide: bool = False, splits: int | None = None
) -> torch.Tensor:
    """``y [M, N]`` of ``x2 [M, groups * K]`` (contiguous) by the GEMM, its K splits summed in
    the launch (or by the split combine, :data:`~deepinfer_cuda_sm100.kernels.fp8_gemm.SPLITK_ENV`)
    (``wide``: the wide tile kind at every ``M``, :func:`tile`; ``splits``: :func:`launch_plan`'s)."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import sm_count, split_reduction
    from deepinfer_cuda_sm100.kernels.split_counters import tile_counters

    n, k = weight.data.shape
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    m = x2.shape[0]
    plan = launch_plan(m, n, k, sm_count(x2.device), wide, splits)
    kind = scale_kind(weight)
    scale = weight.scale if kind == "fp32" else weight.scale.view(torch.uint8)
    pdl = tl_pdl_enabled()
    wide_args = (True,) if wide and plan.block_m <= NARROW_MAX_M else ()  # the shipped keys otherwise
    key = ("gemm", n, k, plan.block_m, plan.splits, plan.stages, kind, pdl, groups)
    y = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    if plan.splits == 1:
        _kernel(*key, *wide_args)(x2, weight.data, scale, y)
        return y
    ws = torch.empty(plan.splits, m, n, device=x2.device, dtype=torch.float32)
    counters = tile_counters(x2.device, plan.grid[0]) if split_reduction() == "fused" else None
    if counters is not None:
        _kernel(*key, bool(wide_args), True)(x2, weight.data, scale, ws, y, counters[: plan.grid[0]])
    else:  # DEEPINFER_FP8_SPLITK=separate, or a capture before the counters exist (logged)
        _kernel(*key, *wide_args)(x2, weight.data, scale, ws)
        _kernel("combine", n, plan.splits, pdl)(ws, y)
    return y


def linear_fp8(x: torch.Tensor, weight, wide: bool = False, splits: int | None = None) -> torch.Tensor:
    """``linear(x, weight)`` by the TileLang GEMM (:func:`problem` must be ``None``; ``wide``: the
    wide tile kind at every ``M``, :func:`tile`; ``splits``: the K splits, :func:`launch_plan`'s
    rule where ``None``)."""
    n, k = weight.data.shape
    lead = x.shape[:-1]
    return _gemm(x.reshape(-1, k).contiguous(), weight, 1, wide, splits).reshape(*lead, n)


def grouped_linear_fp8(x: torch.Tensor, weight, splits: int | None = None) -> torch.Tensor:
    """``grouped_linear(x [T, G, K], weight [G*N, K])`` by the TileLang GEMM, every group in one
    launch (:func:`problem` with ``groups=G`` must be ``None``): ``[T, G, N]`` (``splits``: as
    :func:`linear_fp8`'s)."""
    t, groups, k = x.shape
    n = weight.data.shape[0]
    y = _gemm(x.reshape(t, groups * k).contiguous(), weight, groups, splits=splits)
    return y.view(t, groups, n // groups)
