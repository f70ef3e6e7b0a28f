"""``swiglu``: the clamped SwiGLU of the shared experts in one launch (contract:
``deepinfer_core.ops.moe.swiglu``).

``silu(min(gate, L)) * clamp(up, -L, L)`` element-wise over ``[T, I]``, at the reference's
rounding points: the clamps are exact (rounding is monotonic, so clamping in fp32 and
rounding agrees with clamping in the dtype), ``silu`` is computed in fp32 as PyTorch does
(``x / (1 + exp(-x))``, one rounding to the dtype: :func:`~._common.round_through`), and the
product of the two dtype values is rounded once to the output dtype -- the reference's four
launches in one.  ``exp`` is libdevice's ``expf`` on the GPU (what PyTorch's CUDA ``silu``
calls) and the division ``div.rn``, so fp32 results equal PyTorch's CUDA ones up to its own
last-bit differences; Triton's interpreter evaluates ``exp`` in float64 (:func:`~._common.exact_exp`).

One program handles one row and ``BLOCK_I`` columns (``BLOCK_I`` from ``I`` alone): no
reduction, so a row's result does not depend on the batch; the grid depends on shapes only
(CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast_to, cdiv, exact_exp, pow2, round_through
from .pdl import pdl_args, pdl_enter

MAX_BLOCK_I = 1024
"""Widest column tile of one program (V4-Flash's ``I = 2048``: two programs per row)."""


@triton.jit
def _swiglu_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    I,
    stride_gt,
    stride_ut,
    limit,
    BLOCK_I: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Columns ``[pid1 * BLOCK_I, +BLOCK_I)`` of row ``pid0``: ``out = silu(min(g, L)) * clamp(u, -L, L)``."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < I
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + t * stride_gt + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * stride_ut + cols, mask=mask, other=0.0).to(tl.float32)
    nan: tl.constexpr = tl.PropagateNan.ALL  # NaN stays NaN, as torch's clamp keeps it
    g = tl.minimum(g, limit, propagate_nan=nan)
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=nan), limit, propagate_nan=nan)
    act = round_through(tl.math.div_rn(g, 1.0 + exact_exp(-g)), dtype)  # torch's silu, rounded once
    tl.store(out_ptr + t * I + cols, cast_to(act * u, dtype), mask=mask)


def block_i(width: int) -> int:
    """``BLOCK_I`` for rows of ``width`` columns (shapes only)."""
    return min(pow2(width), MAX_BLOCK_I)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Triton ``swiglu``: same signature, shapes and numerics as the reference.

    ``gate`` / ``up`` ``[T, I]`` of one dtype (fp32, bf16 or fp16; any row strides, a
    non-unit column stride is copied first).  Returns a new contiguous ``[T, I]`` tensor in
    ``gate``'s dtype.
    """
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    if up.stride(-1) != 1:
        up = up.contiguous()
    t, width = gate.shape
    out = torch.empty((t, width), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    block = block_i(width)
    _swiglu_kernel[(t, cdiv(width, block))](
        gate,
        up,
        out,
        width,
        gate.stride(0),
        up.stride(0),
        float(limit),
        BLOCK_I=block,
        num_warps=4,
        enable_reflect_ftz=False,
        **pdl_args(),  # libdevice without flush to zero, as nvcc builds PyTorch
    )
    return out
