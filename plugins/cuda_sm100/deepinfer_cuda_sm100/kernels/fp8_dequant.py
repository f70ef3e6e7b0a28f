"""Dequantise a block-scaled FP8 weight on the device: bitwise the reference's dequantisation.

:func:`dequantize_fp8` turns a ``[N, K]`` ``float8_e4m3fn`` weight with one scale per
``block`` (``float32``, or UE8M0 bytes ``2**(b - 127)``) into ``dtype``: each element is
``float32(w) * float32(scale)`` rounded once to ``dtype`` -- what
:func:`deepinfer_core.weights.quant.dequant_fp8` computes, bit for bit (the product of an e4m3
value and a float32 is exact or rounded once in fp32 on both sides, then one round-to-nearest-
even cast).  One program per ``[BLOCK_N, BLOCK_K]`` tile, the tile's scale loaded once.

It serves the GEMM path that reads a quantised weight through a cuBLAS matmul
(:mod:`deepinfer_cuda_sm100.gemm_dispatch`): dequantise into a scratch tensor, then
``F.linear`` -- the reference op's own arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda_sm100.kernels._common import cast_to, cdiv, ue8m0_value

from .pdl import pdl_args, pdl_enter

TILE = 64
"""Rows and columns per program (a divisor of the 128x128 scale blocks)."""

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    s_rows,
    s_cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    UE8M0: tl.constexpr,
    OUT: tl.constexpr,
    TILE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pn = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pn * TILE + tl.arange(0, TILE)
    cols = pk * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s_off = (pn * TILE // BLOCK_ROWS) * s_cols + (pk * TILE // BLOCK_COLS)
    if UE8M0:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        scale = ue8m0_value(tl.load(s_ptr + s_off).to(tl.int32))
    else:
        scale = tl.load(s_ptr + s_off)
    y = cast_to(w * scale, OUT)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], y, mask=mask)


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, block, dtype: torch.dtype) -> torch.Tensor:
    """``[N, K]`` ``dtype`` from FP8 ``data`` ``[N, K]`` and its block ``scale`` (see the module
    docstring); ``block`` rows and columns must be multiples of :data:`TILE`."""
    n, k = data.shape
    br, bc = block
    if br % TILE or bc % TILE:
        raise ValueError(f"block {block}: rows and columns must be multiples of {TILE}")
    out = torch.empty((n, k), dtype=dtype, device=data.device)
    ue8m0 = scale.dtype != torch.float32
    s = scale.view(torch.uint8) if ue8m0 else scale
    _dequant_kernel[(cdiv(n, TILE), cdiv(k, TILE))](
        data,
        s.contiguous(),
        out,
        n,
        k,
        s.shape[0],
        s.shape[1],
        BLOCK_ROWS=br,
        BLOCK_COLS=bc,
        UE8M0=ue8m0,
        OUT=_TL_DTYPES[dtype],
        TILE=TILE,
        num_warps=4,
        **pdl_args(),
    )
    return out
