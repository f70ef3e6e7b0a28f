"""``moe_experts`` on cuBLAS's grouped GEMMs (``torch._grouped_mm``) over the expert-sorted pairs.

At prefill every expert takes hundreds of rows and the expert GEMMs are compute bound; cuBLAS's
grouped bf16 GEMM (a CUTLASS kernel on sm_90 / sm_100, the group offsets read on the device)
runs them near the tensor cores' peak, where the tiled Triton and TileLang kernels, which keep
the pairs on the MMA's narrow side, reach about half of it.  Seven launches and two torch
gathers, no host synchronisation (CUDA-graph capturable):

1. the ``P = T * k`` pairs stably sorted by expert (``torch.sort``; ids outside ``[0, E)`` sort as
   expert 0 and are dropped by the combine), each expert's end row found by ``searchsorted``,
   the pairs' tokens gathered into the sorted rows (``index_select``);
2. FP4 stacks only: every expert of both stacks dequantised into scratch stacks in ``x``'s dtype
   (:func:`~deepinfer_cuda_sm100.kernels.moe_dequant.dequantize_experts`, bitwise
   :meth:`QuantizedTensor.dequantize`), so at most :data:`SCRATCH_BYTES` of them
   (:func:`grouped_problem`);
3. gate / up: one grouped GEMM, fp32 accumulation, rounded to ``x``'s dtype;
4. the clamped SwiGLU (:func:`~deepinfer_cuda_sm100.kernels.swiglu.swiglu`: ``silu(min(g, L))``
   and the product each rounded to ``x``'s dtype);
5. down: one grouped GEMM, rounded to ``x``'s dtype;
6. :func:`~deepinfer_cuda_sm100.kernels.moe.combine_pairs` with the sorted rows: each pair's row
   times its routing weight rounded to ``x``'s dtype, rounded once, the token's contributions
   added in fp32 in ascending expert order, plus the shared expert's row.

The rounding points are those of the Triton path (:mod:`~deepinfer_cuda_sm100.kernels.moe`); the
GEMMs' accumulation order is cuBLAS's and depends on the call's shapes, so the path is not batch
invariant (the dispatcher keeps the batch-invariant mode on Triton).
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.moe_paths import HAS_GROUPED_MM, expert_groups
from deepinfer_core.weights.quant import QuantizedTensor

from .moe import combine_pairs, empty_call
from .moe_dequant import dequantize_experts, fp4_problem
from .swiglu import swiglu

SCRATCH_BYTES = 4 << 30
"""Most bytes of the two dequantised stacks of an FP4 call (every expert at once)."""
ALIGN = 8
"""The widths must be multiples of this (cuBLAS's 16-byte aligned bf16 rows)."""


def grouped_problem(x: torch.Tensor, gate_up, down, scratch_bytes: int = SCRATCH_BYTES) -> str | None:
    """Why this path cannot run a call on these operands (any device; the dispatcher adds the
    device's own conditions), or ``None``: ``torch._grouped_mm`` present; both stacks plain
    tensors of ``x``'s dtype or FP4 stacks :func:`dequantize_experts` reads, whose dequantised
    copies fit ``scratch_bytes``; widths multiples of :data:`ALIGN`."""
    if not HAS_GROUPED_MM:
        return f"torch {torch.__version__} has no _grouped_mm"
    scratch = 0
    for name, w in (("gate_up", gate_up), ("down", down)):
        if isinstance(w, QuantizedTensor):
            problem = fp4_problem(w)
            if problem:
                return f"{name} is {problem}: the grouped GEMMs dequantise FP4 stacks"
            scratch += w.shape[0] * w.shape[1] * w.shape[2] * x.dtype.itemsize
        elif w.dtype != x.dtype:
            return f"{name} is {w.dtype}, x {x.dtype}: the grouped GEMMs take one dtype"
    if scratch > scratch_bytes:
        need, have = scratch / 2**30, scratch_bytes / 2**30
        return f"the dequantised stacks take {need:.1f} GiB, over the {have:.1f} GiB scratch"
    widths = (x.shape[1], down.shape[2])
    if any(w % ALIGN for w in widths):
        return f"widths D={widths[0]}, I={widths[1]}: the grouped GEMMs take multiples of {ALIGN}"
    return None


def _stack(w, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a plain stack in ``dtype`` with unit-strided rows (FP4: dequantised in one launch)."""
    if isinstance(w, QuantizedTensor):
        out = torch.empty(w.shape, dtype=dtype, device=w.data.device)
        return dequantize_experts(w, 0, w.shape[0], out)
    return w if w.stride(-1) == 1 else w.contiguous()


def sorted_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order [P], rows [P] int32, ends [E] int32)``: the pairs ``t * k + j`` stably sorted by
    expert (ids outside ``[0, E)`` as expert 0; the reference's
    :func:`~deepinfer_core.ops.moe_paths.expert_groups`), the sorted row of each pair, and each
    expert's end row (the group offsets of ``torch._grouped_mm``); on the device, without a sync."""
    flat = ids.reshape(-1).long()
    _, order, ends = expert_groups(torch.where((flat >= 0) & (flat < num_experts), flat, 0), num_experts)
    pairs = torch.arange(flat.numel(), dtype=torch.int32, device=ids.device)
    rows = torch.empty_like(pairs).scatter_(0, order, pairs)
    return order, rows, ends.to(torch.int32)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up,
    down,
    limit: float,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_experts`` (the core contract) as two grouped GEMMs (see the module docstring):
    ``x`` ``[T, D]``, ``ids`` / ``weights`` ``[T, k]``, ``gate_up`` ``[E, 2I, D]`` and ``down``
    ``[E, D, I]`` plain stacks in ``x``'s dtype or FP4 stacks, ``shared`` the shared expert's
    output (optional ``[T, D]``).  Raises ``ValueError`` with :func:`grouped_problem`'s reason."""
    problem = grouped_problem(x, gate_up, down)
    if problem:
        raise ValueError(f"moe_experts on grouped GEMMs: {problem}")
    top_k, num_experts, inter = ids.shape[1], gate_up.shape[0], down.shape[2]
    out, done = empty_call(x, ids, num_experts, shared)
    if done:
        return out
    ids, weights = (v if v.stride(1) == 1 else v.contiguous() for v in (ids, weights))
    order, rows, ends = sorted_pairs(ids, num_experts)
    xs = x.index_select(0, order // top_k)
    h = torch._grouped_mm(xs, _stack(gate_up, x.dtype).transpose(1, 2), offs=ends)
    a = swiglu(h[:, :inter], h[:, inter:], limit)
    y = torch._grouped_mm(a, _stack(down, x.dtype).transpose(1, 2), offs=ends)
    return combine_pairs(y, ids, num_experts, False, shared, out, rows=rows, weights=weights)
