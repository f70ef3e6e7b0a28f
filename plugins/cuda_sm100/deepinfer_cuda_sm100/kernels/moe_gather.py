"""The FP4 MoE's activations gathered once per call into the experts' sorted rows, each K step
of 128 inputs in the order the TileLang GEMMs' wgmma fragments take them.

The TileLang gate / up kernel (:mod:`deepinfer_cuda_sm100.tl.moe`) reads, per CTA and K step,
the activations of its tile's tokens.  Gathering them there costs a 4-byte ``cp.async`` per
input pair and row, with its address arithmetic, in every CTA of the tile (``I / 64`` of
them).  :func:`gather_sorted_rows` instead writes, once per call, row ``r`` of the sorted layout
(:func:`~deepinfer_cuda_sm100.kernels.moe.sorted_layout`: ``slot_pair[r]`` is the pair ``t * k
+ j`` there, ``-1`` for a padding row) as token ``t``'s activations with each 128-input block
permuted into the K order (:func:`k_position`, the same formula as
:func:`deepinfer_cuda_sm100.tl.moe.k_position`), so the GEMM loads a tile's rows with one TMA
copy a step, as its down kernel loads ``h``.  Padding rows are zeros (their columns of the
product are never stored); the rows of the layout's unused tiles (``tile_expert`` past the
experts, which the GEMMs skip) are not written.  The values are the activations' own bits,
only moved: the GEMM's result is bitwise the same either way.

One program per (row, 1024 inputs); a grid fixed by shapes, no host synchronisation (CUDA-graph
capturable), the PDL prologue of :mod:`~deepinfer_cuda_sm100.kernels.pdl`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_enter

K_STEP = 128
"""Inputs per K step of the TileLang GEMMs (one permuted block)."""
BLOCK_D = 1024
"""Inputs per program."""


@triton.jit
def k_position(n):
    """Position in a K step's wgmma order of input ``n`` (0..127): ``16 ((n % 32) // 4) + 8 ((n %
    4) // 2) + 2 (n // 32) + n % 2`` (thread ``c`` of a quad holds inputs ``32 c .. 32 c + 31``)."""
    return 16 * ((n % 32) // 4) + 8 * ((n % 4) // 2) + 2 * (n // 32) + n % 2


@triton.jit
def _gather_kernel(
    x_ptr,
    stride_x,
    tile_expert_ptr,
    slot_pair_ptr,
    out_ptr,
    D,
    E,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_STEP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Row ``program_id(0)`` of the sorted layout, inputs ``program_id(1) * BLOCK_D ..``: its
    token's activations (zeros for a padding row), each ``K_STEP`` block in K order; nothing
    for a row of an unused tile."""
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    if tl.load(tile_expert_ptr + r // BLOCK_M) >= E:
        return
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    pair = tl.load(slot_pair_ptr + r)
    token = tl.maximum(pair, 0).to(tl.int64) // TOP_K
    # masked-off lanes address the row's start (Triton's interpreter dereferences them too)
    v = tl.load(x_ptr + token * stride_x + tl.where(ok, cols, 0), mask=ok & (pair >= 0), other=0.0)
    dest = (cols // K_STEP) * K_STEP + k_position(cols % K_STEP)
    tl.store(out_ptr + r * D + dest, v, mask=ok)


def gather_sorted_rows(
    x: torch.Tensor, tile_expert: torch.Tensor, slot_pair: torch.Tensor, top_k: int, experts: int
) -> torch.Tensor:
    """``[len(slot_pair), D]`` in ``x``'s dtype, for the layout ``(tile_expert, slot_pair)`` of
    :func:`~deepinfer_cuda_sm100.kernels.moe.sorted_layout` over ``experts``: row ``r`` of a used
    tile is ``x[slot_pair[r] // top_k]`` with each block of :data:`K_STEP` inputs permuted into
    the K order (``out[r, 128 b + k_position(n)] = x[t, 128 b + n]``), zeros where
    ``slot_pair[r] < 0``; the rows of unused tiles are left unwritten.  ``D`` a multiple of
    :data:`K_STEP` (``x`` is made contiguous first where it is not)."""
    rows, d = slot_pair.shape[0], x.shape[1]
    if d % K_STEP:
        raise ValueError(f"x {tuple(x.shape)}: rows of a multiple of {K_STEP} inputs expected")
    x = x.contiguous()
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows:
        block_m = rows // tile_expert.shape[0]
        grid = (rows, triton.cdiv(d, BLOCK_D))
        _gather_kernel[grid](
            x, d, tile_expert, slot_pair, out, d, experts,
            TOP_K=top_k, BLOCK_M=block_m, BLOCK_D=BLOCK_D, K_STEP=K_STEP, **pdl_args(),
        )  # fmt: skip
    return out
