"""``moe_experts`` at decode width: FP4 experts as GEMVs on CUDA cores, many small programs.

Contract: ``deepinfer_core.ops.moe.moe_experts``.  Built for calls with very few (token, slot)
pairs per expert (a decode step of a few tokens: at ``T = 1``, top-6, each routed expert has
one row), where :mod:`~deepinfer_cuda_sm100.kernels.moe`'s tiles of 16 rows carry one valid
row and few CTAs stream the experts' weights.  Here no tensor-core tile: each program computes
a few output features of one row as dot products over the whole K, on CUDA cores, with the
FP4 loads and decoding of :mod:`~deepinfer_cuda_sm100.kernels.moe` (``_fp4_packed``,
``_fp4_scales``, ``_fp4_values``: the PTX ``prmt`` lookup and ``mul.rn.bf16x2`` on the GPU, the
arithmetic decoding in the interpreter; each weight bitwise :meth:`QuantizedTensor.dequantize`
``(x.dtype)``).  Two launches, no host synchronisation (the grids depend on shapes only:
CUDA-graph capturable):

1. :func:`_gemv_gate_up_kernel`, a program per (pair ``t * k + j``, block of
   :data:`GATE_UP_BLOCK_N` intermediate features): the pair's expert's gate and up rows of those
   features times ``x[t]`` over ``D``, then the clamped SwiGLU at the Triton path's rounding
   points (gate and up, ``silu`` and ``h`` rounded to ``x``'s dtype: the same helper as its
   gate / up kernel); ``h [T * k, I]`` in ``x``'s dtype.  A pair whose id is outside ``[0, E)``
   returns at once (its row is never read).
2. :func:`_gemv_down_kernel`, a program per (token, block of ``2 * DOWN_BLOCK_N`` model
   features): the token's slots in ascending (expert, slot) order -- the order of the Triton
   path's combine kernel and of the contract -- each slot's expert's down rows times its ``h``
   row over ``I``; each contribution rounded to ``x``'s dtype, times the routing weight rounded
   to it, rounded again (the Triton path's stored contribution), summed in fp32; with
   ``shared`` the sum is rounded to ``x``'s dtype and the shared expert's row added (the
   reference's ``routed + shared``).  Ids outside ``[0, E)`` contribute nothing.  No atomics: a
   token's result depends on its own row only, summed in a fixed order.

The dot products (:func:`_gemv_rows`): K steps of ``BLOCK_K`` inputs; per step and row set the
packed bytes as a ``[BLOCK_N, runs, 16]`` tile (a run: the 16 bytes, 32 inputs, of one scale
group; one run of one row per thread at the shipped sizes, a 16-byte load), the activations'
even and odd inputs, the exact fp32 products (bf16 and fp16 operands) accumulated elementwise
in an fp32 tile of the same shape, reduced once after the K loop.  So a result differs from
the Triton path's only in the fp32 summation order of the dot products: not its bits, so the
dispatcher never takes it in the batch-invariant mode (within this path a row's result does
not depend on the other rows either).

Sizes (V4-Flash, ``D = 4096``, ``I = 2048``, ``T = 1``, top-6): gate / up 6 x 256 = 1536 programs
of 8 features (16 weight rows, 32 KiB of packed FP4), 8 K steps of 512 inputs; down 512 programs
of 8 model features (two row sets of 4), 6 slots x 2 K steps of 1024 inputs; 4 warps.  Offline
compile for sm_90 (Triton 3.6, bf16 activations): gate / up 121 registers with ue8m0 scales
(float32 scales: 128), down 152-156 (167), no stack or local memory.  A gate / up K step
issues ~390 instructions a thread for its 64 weights (~550 with float32 scales, whose products
round through fp32): the e2m1 decoding (15 per 8 weights), the bf16x2 scale products, one
widening and one FFMA per weight, and conversions of the activations' and scales' layouts
through shared memory (3 barrier pairs a step).  Speed on the GPU: to be measured
(``scripts/bench_moe.py``'s ``triton_gemv_fp4`` column).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.weights.quant import QuantizedTensor

from ._common import INTERPRETED, cast_to, cdiv, pow2, round_through
from .moe import _clamped_swiglu, _fp4_packed, _fp4_scales, _fp4_values, _weight_args, e2m1_ptx, empty_call

GATE_UP_BLOCK_N = 8
"""Intermediate features per gate / up program (it reads their gate rows and their up rows)."""
GATE_UP_BLOCK_K = 512
"""Inputs per K step of the gate / up programs (with 8 rows a set: one 16-byte run a thread)."""
DOWN_BLOCK_N = 4
"""Model features per row set of a down program (two sets: ``2 * DOWN_BLOCK_N`` features)."""
DOWN_BLOCK_K = 1024
"""Inputs per K step of the down programs (with 4 rows a set: one 16-byte run a thread)."""
INTERPRETER_BLOCK_N = 64
"""Rows per row set under Triton's interpreter, whose cost is per program, not per element."""
WARPS = 4
MAX_TOKENS = 16
"""Most tokens :func:`~deepinfer_cuda_sm100.moe_dispatch.gemv_supports` lets through: a GEMV
reads an expert's weights once per pair, the tiled kernels once per tile of 16 or more rows."""
_FP32_DOT = tl.constexpr(INTERPRETED)


# bf16 to fp32 in inline PTX: Triton converts each bf16 element on its own (an extract of the
# 16-bit half, then a shift); a bf16x2 register gives both fp32 values in one instruction each.
_WIDEN_BF16X2_PTX = tl.constexpr("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }")


@triton.jit
def _to_fp32(v, PTX: tl.constexpr):
    """``v.to(tl.float32)`` (exact); ``PTX`` (GPU, bf16 ``v``): one instruction per value."""
    if PTX:
        out = tl.inline_asm_elementwise(
            _WIDEN_BF16X2_PTX, "=r,=r,r", [v], dtype=tl.float32, is_pure=True, pack=2
        )
    else:
        out = v.to(tl.float32)
    return out


@triton.jit
def _gemv_rows(
    a_ptr,
    w_ptr,
    w_rows0,
    w_rows1,
    s_ptr,
    s_rows0,
    s_rows1,
    n_ok0,
    n_ok1,
    K: tl.constexpr,
    dtype: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """Two fp32 ``[BLOCK_N]`` dot products of the activation row at ``a_ptr`` (``K`` inputs in
    ``dtype``, unit stride) with the FP4 weight rows ``w_ptr + w_rows0`` and ``w_ptr + w_rows1``
    (packed byte offsets, ``[BLOCK_N]`` each, masked by ``n_ok0`` / ``n_ok1``; scales at ``s_ptr +
    s_rows*``), in K steps of ``BLOCK_K`` (one loop: each activation step loaded once for both).

    Per step and set the packed bytes ``[BLOCK_N, runs, bytes]`` and one scale per run are
    decoded and scaled to ``dtype`` (the even inputs from the low nibbles, the odd ones from the
    high nibbles); their exact fp32 products with the activations accumulate elementwise in a
    fp32 tile of that shape, reduced after the loop."""
    HALF: tl.constexpr = BLOCK_K // 2
    RUN: tl.constexpr = HALF_GROUP if HALF_GROUP < HALF else HALF
    RUNS: tl.constexpr = HALF // RUN
    WIDEN_PTX: tl.constexpr = E2M1_PTX and dtype == tl.bfloat16
    kr = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_N, RUNS, RUN), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, RUNS, RUN), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        p0 = _fp4_packed(w_ptr, w_rows0, n_ok0, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        p1 = _fp4_packed(w_ptr, w_rows1, n_ok1, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        s0 = _fp4_scales(s_ptr, s_rows0, n_ok0, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        s1 = _fp4_scales(s_ptr, s_rows1, n_ok1, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        kk = k0 + kr
        a = tl.load(a_ptr + kk, mask=kk < K, other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a, (RUNS, RUN, 2)))  # each byte's even and odd input
        a_even = _to_fp32(a_even, WIDEN_PTX)[None, :, :]
        a_odd = _to_fp32(a_odd, WIDEN_PTX)[None, :, :]
        lo, hi = _fp4_values(p0, s0, dtype, UE8M0, FP32_DOT, E2M1_PTX)
        acc0 += _to_fp32(lo, WIDEN_PTX) * a_even
        acc0 += _to_fp32(hi, WIDEN_PTX) * a_odd
        lo, hi = _fp4_values(p1, s1, dtype, UE8M0, FP32_DOT, E2M1_PTX)
        acc1 += _to_fp32(lo, WIDEN_PTX) * a_even
        acc1 += _to_fp32(hi, WIDEN_PTX) * a_odd
    return tl.sum(tl.sum(acc0, axis=2), axis=1), tl.sum(tl.sum(acc1, axis=2), axis=1)


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,
    stride_x,
    ids_ptr,
    stride_ids,
    w_ptr,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    h_ptr,
    E,
    limit,
    TOP_K: tl.constexpr,
    D: tl.constexpr,
    I: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """Pair ``program_id(0)`` (``t * TOP_K + j``), intermediate features ``program_id(1) *
    BLOCK_N ..``: the pair's ``h`` (clamped SwiGLU of its expert's gate and up rows times
    ``x[t]``), stored at row ``t * TOP_K + j`` of ``h [T * TOP_K, I]``."""
    pair = tl.program_id(0)
    t = (pair // TOP_K).to(tl.int64)
    expert = tl.load(ids_ptr + t * stride_ids + pair % TOP_K).to(tl.int64)
    if (expert >= 0) & (expert < E):  # other ids contribute nothing: no row
        dtype = x_ptr.dtype.element_ty
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < I
        w_gate = expert * stride_we + cols.to(tl.int64) * stride_wn
        s_gate = expert * stride_se + cols.to(tl.int64) * stride_sn
        g, u = _gemv_rows(
            x_ptr + t * stride_x, w_ptr, w_gate, w_gate + I * stride_wn,
            s_ptr, s_gate, s_gate + I * stride_sn, n_ok, n_ok,
            D, dtype, UE8M0, HALF_GROUP, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
        )  # fmt: skip
        h = _clamped_swiglu(g, u, limit, dtype)
        tl.store(h_ptr + pair.to(tl.int64) * I + cols, h, mask=n_ok)


@triton.jit
def _gemv_down_kernel(
    h_ptr,
    ids_ptr,
    stride_ids,
    rw_ptr,
    stride_rw,
    w_ptr,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    sh_ptr,
    stride_sh,
    out_ptr,
    stride_out,
    E,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    D: tl.constexpr,
    I: tl.constexpr,
    SHARED: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """Token ``program_id(0)``, model features ``program_id(1) * 2 * BLOCK_N ..`` (two row sets
    of ``BLOCK_N``): the token's routed sum over its slots in ascending (expert, slot) order
    (see the module docstring), plus ``shared[t]`` with ``SHARED``."""
    t = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols0 = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
    cols1 = cols0 + BLOCK_N
    n_ok0 = cols0 < D
    n_ok1 = cols1 < D
    slot = tl.arange(0, K_PAD)
    ex = tl.load(ids_ptr + t * stride_ids + slot, mask=slot < TOP_K, other=-1)
    ex = tl.where((ex >= 0) & (ex < E), ex, -1).to(tl.int32)  # int32 keys: E * K_PAD < 2**31
    done = 1 << 30  # above every real key
    key = tl.where((slot < TOP_K) & (ex >= 0), ex * K_PAD + slot, done)
    out0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    out1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for _ in range(TOP_K):
        m = tl.min(key, axis=0)
        if m < done:
            expert = (m // K_PAD).to(tl.int64)
            j = m % K_PAD
            w_rows = expert * stride_we + cols0.to(tl.int64) * stride_wn
            s_rows = expert * stride_se + cols0.to(tl.int64) * stride_sn
            y0, y1 = _gemv_rows(
                h_ptr + (t * TOP_K + j) * I, w_ptr, w_rows, w_rows + BLOCK_N * stride_wn,
                s_ptr, s_rows, s_rows + BLOCK_N * stride_sn, n_ok0, n_ok1,
                I, dtype, UE8M0, HALF_GROUP, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
            )  # fmt: skip
            # the Triton path's contribution: the output and the weight in x's dtype, their
            # product rounded to it (the reference's default paths)
            rw = round_through(tl.load(rw_ptr + t * stride_rw + j).to(tl.float32), dtype)
            out0 += round_through(round_through(y0, dtype) * rw, dtype)
            out1 += round_through(round_through(y1, dtype) * rw, dtype)
        key = tl.where(key == m, done, key)
    if SHARED:  # the reference's routed + shared: the routed sum rounded first
        sh0 = tl.load(sh_ptr + t * stride_sh + cols0, mask=n_ok0, other=0.0)
        sh1 = tl.load(sh_ptr + t * stride_sh + cols1, mask=n_ok1, other=0.0)
        out0 = round_through(out0, dtype) + sh0.to(tl.float32)
        out1 = round_through(out1, dtype) + sh1.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols0, cast_to(out0, dtype), mask=n_ok0)
    tl.store(out_ptr + t * stride_out + cols1, cast_to(out1, dtype), mask=n_ok1)


def launch_plan(tokens: int, top_k: int, hidden: int, inter: int) -> dict[str, dict]:
    """The two launches from shapes only: for ``gate_up`` and ``down`` the ``grid``, ``block_n``
    (rows per set), ``block_k`` (inputs per K step) and whether the FP4 decoding runs in PTX
    (``e2m1_ptx``, for bf16 / fp16 / fp32 alike; never under the interpreter)."""
    gu_n = INTERPRETER_BLOCK_N if INTERPRETED else GATE_UP_BLOCK_N
    dn_n = INTERPRETER_BLOCK_N if INTERPRETED else DOWN_BLOCK_N
    gu_k = max(32, min(GATE_UP_BLOCK_K, pow2(hidden)))
    dn_k = max(32, min(DOWN_BLOCK_K, pow2(inter)))
    return {
        "gate_up": {
            "grid": (tokens * top_k, cdiv(inter, gu_n)),
            "block_n": gu_n,
            "block_k": gu_k,
            "e2m1_ptx": e2m1_ptx(gu_n, gu_k, WARPS),
        },
        "down": {
            "grid": (tokens, cdiv(hidden, 2 * dn_n)),
            "block_n": dn_n,
            "block_k": dn_k,
            "e2m1_ptx": e2m1_ptx(dn_n, dn_k, WARPS),
        },
    }


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up,
    down,
    limit: float,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_experts`` (the core contract) by decode-width GEMVs on FP4 expert stacks.

    ``x`` ``[T, D]`` (float32 / bfloat16 / float16); ``ids`` / ``weights`` ``[T, k]`` (an id
    outside ``[0, E)`` contributes nothing); ``gate_up`` ``[E, 2I, D]`` and ``down`` ``[E, D, I]``:
    FP4 :class:`~deepinfer_core.weights.quant.QuantizedTensor` stacks (ue8m0 or float32 scales,
    scale groups a power of two dividing the widths, unit stride along the inputs); ``shared``
    (optional ``[T, D]``, ``x``'s dtype) added as the reference does.  Returns ``[T, D]`` in
    ``x``'s dtype.

    Two launches (see the module docstring), no host sync.  For calls with few pairs per expert:
    the dispatcher takes it only where the measured table timed it fastest, never in the
    batch-invariant mode (:func:`~deepinfer_cuda_sm100.moe_dispatch.gemv_supports`).
    """
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not isinstance(w, QuantizedTensor) or w.fmt != "fp4":
            raise ValueError(f"{name}: the decode-width GEMVs read FP4 QuantizedTensor stacks")
    t, d = x.shape
    top_k = ids.shape[1]
    num_experts, inter = gate_up.shape[0], down.shape[2]
    out, done = empty_call(x, ids, num_experts, shared)
    if done:
        return out
    x, ids, weights = (v if v.stride(1) == 1 else v.contiguous() for v in (x, ids, weights))
    if shared is not None and shared.stride(1) != 1:
        shared = shared.contiguous()
    plan = launch_plan(t, top_k, d, inter)

    gu, gu_se, gu_sn, gu_s, gu_sse, gu_ssn, _, gu_ue8m0, gu_half = _weight_args(gate_up)
    h = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    p = plan["gate_up"]
    _gemv_gate_up_kernel[p["grid"]](
        x, x.stride(0), ids, ids.stride(0), gu, gu_se, gu_sn, gu_s, gu_sse, gu_ssn, h,
        num_experts, float(limit), TOP_K=top_k, D=d, I=inter, UE8M0=gu_ue8m0, HALF_GROUP=gu_half,
        BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], FP32_DOT=_FP32_DOT, E2M1_PTX=p["e2m1_ptx"],
        num_warps=WARPS, num_stages=1,
    )  # fmt: skip

    dn, dn_se, dn_sn, dn_s, dn_sse, dn_ssn, _, dn_ue8m0, dn_half = _weight_args(down)
    sh, sh_stride = (shared, shared.stride(0)) if shared is not None else (out, 0)
    p = plan["down"]
    _gemv_down_kernel[p["grid"]](
        h, ids, ids.stride(0), weights, weights.stride(0), dn, dn_se, dn_sn, dn_s, dn_sse, dn_ssn,
        sh, sh_stride, out, out.stride(0), num_experts,
        TOP_K=top_k, K_PAD=pow2(top_k), D=d, I=inter, SHARED=shared is not None,
        UE8M0=dn_ue8m0, HALF_GROUP=dn_half, BLOCK_N=p["block_n"], BLOCK_K=p["block_k"],
        FP32_DOT=_FP32_DOT, E2M1_PTX=p["e2m1_ptx"], num_warps=WARPS, num_stages=1,
    )  # fmt: skip
    return out
