"""``moe_experts`` on dequantised FP4 experts: the stacks decoded a group of experts at a time,
then the Triton path's plain-stack launches.

At prefill every expert takes hundreds of rows and the FP4 kernels become compute bound on
their own decoding: :mod:`~deepinfer_cuda_sm100.kernels.moe` decodes each weight once per tile
of rows, the TileLang kernels likewise.  Here each weight is decoded once per call:

1. :func:`dequantize_experts` (:func:`_dequant_fp4_kernel`, one program per ``[BLOCK_N,
   2 * BLOCK_B]`` tile of one expert, each packed byte stored as one 32-bit word of two values)
   writes a group of experts of both stacks into scratch stacks in ``x``'s dtype (bfloat16 or
   float16);
2. :func:`~deepinfer_cuda_sm100.kernels.moe.expert_rows` (the Triton path's layout, gate / up
   and down launches on plain stacks) writes the rows of the pairs routed to that group, the
   pairs' expert ids shifted by the group's first expert (the others fall outside the group's
   ``[0, n)`` and get no row);
3. after the last group, one :func:`~deepinfer_cuda_sm100.kernels.moe.combine_pairs` sums each
   token's rows (and the shared expert's output).

The scratch stacks hold at most :data:`SCRATCH_BYTES` (at least one expert): the groups are
``ceil(E / ceil(E / fit))`` experts, ``fit`` the experts that fit.  Every launch has a grid
fixed by shapes and no host synchronisation (CUDA-graph capturable).

Exactness: each dequantised weight is its e2m1 value (exact) times its group's scale (a
float32, or UE8M0 byte ``b`` read as ``2**(b - 127)`` the way torch reads ``float8_e8m0fnu``:
``2**-127`` for 0, NaN for 255), the fp32 product rounded once to ``x``'s dtype: bitwise
:meth:`QuantizedTensor.dequantize` ``(x.dtype)``.  The tile height is the whole call's
(:func:`~deepinfer_cuda_sm100.kernels.moe.tile_rows` of all pairs and experts, or the given
launch's), so the result is bitwise :func:`~deepinfer_cuda_sm100.kernels.moe.moe_experts` on
the dequantised stacks with the same launch sizes, however the experts are grouped (in the
batch-invariant mode too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.weights.quant import QuantizedTensor

from ._common import cast_to, cdiv, ue8m0_value
from .moe import DEFAULT_LAUNCH, TileLaunch, _e2m1, combine_pairs, empty_call, expert_rows, tile_rows
from .pdl import pdl_args, pdl_enter

SCRATCH_BYTES = 1 << 30
"""Most bytes of the two scratch stacks a call dequantises into (one expert at least)."""
BLOCK_N = 16
"""Weight rows per dequantisation program."""
BLOCK_B = 256
"""Packed bytes (512 inputs) per weight row of a dequantisation program."""

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
"""The output dtypes (two bytes: an input pair is one 32-bit store)."""


@triton.jit
def _dequant_fp4_kernel(
    w_ptr,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    out_ptr,
    N,
    HALF_K,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    OUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Expert ``program_id(2)`` of the group, rows ``program_id(0) * BLOCK_N ..``, packed bytes
    ``program_id(1) * BLOCK_B ..`` (``[rows, runs, bytes a run]``, a run's bytes sharing one
    scale, loaded once): each byte's low nibble (the even input) and high nibble (the
    odd one) times their group's scale, rounded to the 2-byte ``OUT``, stored as one 32-bit word
    (the even input in the low half) into the ``[n, N, HALF_K]`` words of the contiguous
    ``[n, N, 2 * HALF_K]`` output."""
    pdl_enter(USE_PDL)
    RUN: tl.constexpr = HALF_GROUP if HALF_GROUP < BLOCK_B else BLOCK_B  # bytes sharing a scale
    RUNS: tl.constexpr = BLOCK_B // RUN
    e = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * BLOCK_B + tl.arange(0, RUNS) * RUN  # each run's first byte
    b = first[:, None] + tl.arange(0, RUN)[None, :]  # [RUNS, RUN]
    r64 = rows.to(tl.int64)[:, None, None]
    ok = (rows < N)[:, None, None] & (b < HALF_K)[None, :, :]
    packed = tl.load(w_ptr + e * stride_we + r64 * stride_wn + b[None, :, :], mask=ok, other=0).to(tl.uint8)
    s_ok = (rows < N)[:, None] & (first < HALF_K)[None, :]
    s_at = s_ptr + e * stride_se + rows.to(tl.int64)[:, None] * stride_sn + (first // HALF_GROUP)[None, :]
    raw = tl.load(s_at, mask=s_ok, other=0)
    scale = (ue8m0_value(raw.to(tl.int32)) if UE8M0 else raw)[:, :, None]
    lo = cast_to(_e2m1(packed & 15) * scale, OUT).to(tl.uint16, bitcast=True).to(tl.uint32)
    hi = cast_to(_e2m1(packed >> 4) * scale, OUT).to(tl.uint16, bitcast=True).to(tl.uint32)
    words = (lo | (hi << 16)).to(tl.int32, bitcast=True)
    tl.store(out_ptr + (e * N + r64) * HALF_K + b[None, :, :], words, mask=ok)


def fp4_problem(w) -> str | None:
    """Why :func:`dequantize_experts` cannot read ``w`` (not an FP4 stack ``[E, out, in]`` whose
    scale groups are a power of two of at least 2 inputs, rows unit-strided), or ``None``."""
    if not isinstance(w, QuantizedTensor) or w.fmt != "fp4" or w.data.dim() != 3:
        return "not an FP4 QuantizedTensor stack [E, out, in]"
    group = w.block[1]
    if group < 2 or group & (group - 1) or w.data.stride(-1) != 1 or w.scale.stride(-1) != 1:
        return f"FP4 scale groups of {w.block[1]} inputs, or rows not unit-strided"
    return None


def dequantize_experts(w: QuantizedTensor, start: int, count: int, out: torch.Tensor) -> torch.Tensor:
    """Experts ``start .. start + count`` of the FP4 stack ``w`` ``[E, N, K]`` written into
    ``out[:count]`` (contiguous ``[>= count, N, K]``, bfloat16 or float16): bitwise
    ``w.dequantize(out.dtype)[start : start + count]``.  Returns ``out[:count]``."""
    problem = fp4_problem(w)
    if problem:
        raise ValueError(f"dequantize_experts: {problem}")
    _, n, k = w.shape
    if out.dtype not in _TL_DTYPES:
        raise ValueError(f"dequantize_experts: out dtype {out.dtype}; bfloat16 or float16")
    if not out.is_contiguous() or tuple(out.shape[1:]) != (n, k) or out.shape[0] < count:
        raise ValueError(
            f"dequantize_experts: out {tuple(out.shape)} is not a contiguous [>= {count}, {n}, {k}]"
        )
    data = w.data.view(torch.uint8)
    scale = w.scale if w.scale.dtype == torch.float32 else w.scale.view(torch.uint8)
    if count:
        _dequant_fp4_kernel[(cdiv(n, BLOCK_N), cdiv(k // 2, BLOCK_B), count)](
            data[start:], data.stride(0), data.stride(1), scale[start:], scale.stride(0), scale.stride(1),
            out.view(torch.int32), n, k // 2, UE8M0=scale.dtype == torch.uint8, HALF_GROUP=w.block[1] // 2,
            OUT=_TL_DTYPES[out.dtype], BLOCK_N=BLOCK_N, BLOCK_B=BLOCK_B, num_warps=4, **pdl_args(),
        )  # fmt: skip
    return out[:count]


def experts_per_group(gate_up, down, dtype: torch.dtype, scratch_bytes: int = SCRATCH_BYTES) -> int:
    """Experts dequantised at a time: the groups of ``ceil(E / ceil(E / fit))`` experts, ``fit``
    the experts whose two stacks in ``dtype`` fit ``scratch_bytes`` (at least one)."""
    experts = gate_up.shape[0]
    per_expert = (gate_up.shape[1] * gate_up.shape[2] + down.shape[1] * down.shape[2]) * dtype.itemsize
    fit = max(1, min(experts, scratch_bytes // per_expert))
    return cdiv(experts, max(1, cdiv(experts, fit)))  # (0 for a stack without experts)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up,
    down,
    limit: float,
    shared: torch.Tensor | None = None,
    scratch_bytes: int = SCRATCH_BYTES,
    launch: TileLaunch = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """``moe_experts`` (the core contract) for FP4 expert stacks and bfloat16 or float16 ``x``,
    dequantised a group of experts at a time into scratch stacks of at most ``scratch_bytes``
    (see the module docstring); ``launch``: the plain-stack launches' size overrides
    (:class:`~deepinfer_cuda_sm100.kernels.moe.TileLaunch`)."""
    from deepinfer_core.ops.modes import batch_invariant_enabled

    for name, w in (("gate_up", gate_up), ("down", down)):
        problem = fp4_problem(w)
        if problem:
            raise ValueError(f"moe_experts on dequantised experts: {name} is {problem}")
    t, d = x.shape
    top_k, num_experts = ids.shape[1], gate_up.shape[0]
    out, done = empty_call(x, ids, num_experts, shared)
    if done:
        return out
    x, ids, weights = (v if v.stride(1) == 1 else v.contiguous() for v in (x, ids, weights))
    bi = batch_invariant_enabled()
    bm = launch.block_m or tile_rows(t * top_k, num_experts, bi)
    per = experts_per_group(gate_up, down, x.dtype, scratch_bytes)
    gu = torch.empty((per, *gate_up.shape[1:]), dtype=x.dtype, device=x.device)
    dn = torch.empty((per, *down.shape[1:]), dtype=x.dtype, device=x.device)
    y = torch.empty(t * top_k, d, dtype=x.dtype, device=x.device)
    for first in range(0, num_experts, per):
        n = min(per, num_experts - first)
        local = ids - first if first else ids
        group_gu, group_dn = dequantize_experts(gate_up, first, n, gu), dequantize_experts(down, first, n, dn)
        expert_rows(x, local, weights, group_gu, group_dn, limit, y, bm, bi, launch)
    return combine_pairs(y, ids, num_experts, bi, shared, out)
