"""``rms_norm``: RMS normalisation over the last dimension (contract: ``deepinfer_core.ops.norm``).

One program normalises ``BLOCK_R`` rows; each row's sum of squares is reduced over the
whole row in a fixed order (a single tile when the row fits in ``MAX_BLOCK_D`` elements,
else a loop of such tiles), so a row's result does not depend on how many rows there are.
``BLOCK_R`` depends only on the row length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast_to, cdiv, pow2, round_through
from .pdl import pdl_args, pdl_enter

MAX_BLOCK_D = 4096
"""Widest row tile; longer rows are reduced over several tiles (two passes over the row)."""

_TILE_ELEMS = 4096  # elements per program when rows are short: BLOCK_R = _TILE_ELEMS // BLOCK_D


@triton.jit
def rms_factor(sum_sq, D, eps, dtype: tl.constexpr, IN_X_DTYPE: tl.constexpr):
    """``rsqrt(mean(x²) + eps)`` (IEEE division and square root), rounded to ``dtype`` if asked."""
    mean = tl.math.div_rn(sum_sq, tl.zeros_like(sum_sq) + D)
    factor = tl.math.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    if IN_X_DTYPE:  # unweighted norm of a non-fp32 x: the factor is cast to x.dtype first
        factor = round_through(factor, dtype)
    return factor


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    D,
    stride_x,
    eps,
    HAS_WEIGHT: tl.constexpr,
    FACTOR_IN_X_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    x_rows = x_ptr + rows[:, None] * stride_x
    o_rows = out_ptr + rows[:, None] * D
    dtype = out_ptr.dtype.element_ty

    if NUM_TILES == 1:  # the whole row in registers: one read
        m = row_mask[:, None] & (cols < D)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_WEIGHT:  # loaded before the sum's block barrier: its latency overlaps x's
            w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        factor = rms_factor(tl.sum(x * x, axis=1), D, eps, dtype, FACTOR_IN_X_DTYPE)
        y = x * factor[:, None]
        if HAS_WEIGHT:
            y = y * w[None, :]
        tl.store(o_rows + cols[None, :], cast_to(y, dtype), mask=m)
    else:  # two passes over the row, tiles in a fixed order
        sum_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        for i in range(NUM_TILES):
            c = i * BLOCK_D + cols
            m = row_mask[:, None] & (c < D)[None, :]
            x = tl.load(x_rows + c[None, :], mask=m, other=0.0).to(tl.float32)
            sum_sq += tl.sum(x * x, axis=1)
        factor = rms_factor(sum_sq, D, eps, dtype, FACTOR_IN_X_DTYPE)
        for i in range(NUM_TILES):
            c = i * BLOCK_D + cols
            m = row_mask[:, None] & (c < D)[None, :]
            x = tl.load(x_rows + c[None, :], mask=m, other=0.0).to(tl.float32)
            y = x * factor[:, None]
            if HAS_WEIGHT:
                w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
                y = y * w[None, :]
            tl.store(o_rows + c[None, :], cast_to(y, dtype), mask=m)


def row_tile(d: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_D, num_warps)`` of the norm of rows of ``d`` channels: the tile (and so
    the order of each row's sum) that a kernel fusing this norm uses to give the same bits."""
    block_d = min(pow2(d), MAX_BLOCK_D)
    block_r = max(1, min(_TILE_ELEMS // block_d, 16))
    # one row a program (rows of 4096+): 4 warps, as the mHC finishing kernel that fuses the
    # block-input and final norms sums its partials with, so a fused norm sums alike
    return block_r, block_d, 4 if block_r * block_d <= 2048 or block_r == 1 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Triton ``rms_norm``: same signature, shapes and numerics as the reference.

    ``x`` ``[..., D]`` (fp32, bf16 or fp16; any strides: leading dimensions that cannot be
    viewed as one row dimension are copied), ``weight`` ``[D]`` (any float dtype) or ``None``.  Returns a
    contiguous ``[..., D]`` tensor in ``x.dtype``.
    """
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if d > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[0]
    if n == 0 or d == 0:
        return out
    if weight is not None:
        weight = weight.contiguous()
    block_r, block_d, warps = row_tile(d)
    _rms_norm_kernel[(cdiv(n, block_r),)](
        rows,
        weight if weight is not None else rows,
        out,
        n,
        d,
        rows.stride(0),
        float(eps),
        HAS_WEIGHT=weight is not None,
        FACTOR_IN_X_DTYPE=weight is None and x.dtype != torch.float32,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        NUM_TILES=cdiv(d, block_d),
        num_warps=warps,
        **pdl_args(),
    )
    return out
