"""``compress_pool``: the compressor's softmax-gated pooling in one launch (contract:
``deepinfer_core.ops.attention.compress_pool``).

For each window ``m`` of ``kv [M, L, D]`` and each channel ``d``: the softmax over the window's
``L`` gate logits ``gate[m, :, d]`` in fp32, each weight rounded to ``kv``'s dtype, each product
with ``kv[m, l, d]`` rounded to it, the products summed in fp32 and the sum rounded once -- the
reference's softmax, cast, multiply and sum (four launches) at their rounding points.  The
pooling is :func:`~deepinfer_cuda_sm100.kernels.compressor.pool`, the one the fused
``compress_entries`` kernel runs (V4's compressor); V4.1's compressor calls this op on its own,
then ``rms_norm`` and ``apply_rope``.

One program takes one window and ``BLOCK_C`` channels (``BLOCK_C`` from ``D`` alone), its rows
in tiles of ``BLOCK_L``: a window of at most ``BLOCK_L`` rows is read once, a longer one three
times (max, sum, weighted sum), so no value is rescaled.  Every reduction's order is fixed by
the shapes: a window's result does not depend on the other windows (batch invariance), and the
grid ``(M, D / BLOCK_C)`` needs no host synchronisation (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast_to, cdiv, pow2
from .compressor import _TILE_ELEMS, _TL_DTYPES, _strided_rows, pool
from .pdl import pdl_args, pdl_enter

MAX_BLOCK_C = 512
"""Widest channel block of one program (V4.1's 512-wide entries: one program a window); a tile
holds ``BLOCK_L`` rows of it, ``_TILE_ELEMS`` elements at most (the fused kernel's tile)."""


@triton.jit
def _compress_pool_kernel(
    kv_ptr,
    gate_ptr,
    out_ptr,
    L,
    D,
    stride_km,
    stride_kl,
    stride_gm,
    stride_gl,
    KV_DTYPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NUM_L_TILES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Channels ``[pid1 * BLOCK_C, +BLOCK_C)`` of window ``pid0``'s pooled row."""
    pdl_enter(USE_PDL)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < D
    src = (kv_ptr + m * stride_km, gate_ptr + m * stride_gm, stride_kl, stride_gl)
    pooled = pool(src, cols, col_ok, L, _strided_rows, KV_DTYPE, BLOCK_L, BLOCK_C, NUM_L_TILES)
    tl.store(out_ptr + m * D + cols, cast_to(pooled, out_ptr.dtype.element_ty), mask=col_ok)


def block_sizes(length: int, dim: int) -> tuple[int, int, int]:
    """``(BLOCK_L, BLOCK_C, NUM_L_TILES)`` for windows of ``length`` rows of ``dim`` channels
    (shapes only: the same for every call of those widths)."""
    block_c = min(pow2(dim), MAX_BLOCK_C)
    block_l = max(1, min(pow2(length), _TILE_ELEMS // block_c))
    return block_l, block_c, cdiv(length, block_l)


def compress_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Triton ``compress_pool``: same signature, shapes and numerics as the reference.

    ``kv`` ``[M, L, D]`` (fp32, bf16 or fp16) and ``gate`` ``[M, L, D]`` fp32 (any window and
    row strides; a non-unit channel stride is copied first).  Returns a new contiguous
    ``[M, D]`` tensor in ``kv``'s dtype.
    """
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    m, length, d = kv.shape
    out = torch.empty((m, d), dtype=kv.dtype, device=kv.device)
    if out.numel() == 0 or length == 0:
        return out.zero_()
    block_l, block_c, tiles = block_sizes(length, d)
    _compress_pool_kernel[(m, cdiv(d, block_c))](
        kv,
        gate,
        out,
        length,
        d,
        kv.stride(0),
        kv.stride(1),
        gate.stride(0),
        gate.stride(1),
        KV_DTYPE=_TL_DTYPES[kv.dtype],
        BLOCK_L=block_l,
        BLOCK_C=block_c,
        NUM_L_TILES=tiles,
        num_warps=4,
        **pdl_args(),
    )
    return out
