"""``apply_rope`` and ``rope_cos_sin``: V4's partial, interleaved rotary embedding and its
tables (contract: ``deepinfer_core.ops.rope``).

``apply_rope``: for each token ``t`` and head ``h`` of ``x [T, H, D]`` the leading ``D - R``
channels are copied and the trailing ``R = 2 * cos.shape[-1]`` channels rotate in interleaved
pairs: ``(x[2i], x[2i+1]) -> (x[2i] c_i - x[2i+1] s_i, x[2i] s_i + x[2i+1] c_i)``, in fp32.  One
program handles one token and ``BLOCK_H`` heads; it reads the token's cos/sin once.

``rope_cos_sin``: both tables ``[T, R/2]`` from one launch (the reference's ~8).  The angle
``float(position) * float(inv_freq[i])`` is one fp32 product, as in the reference; ``tl.cos``
/ ``tl.sin`` lower to libdevice's ``cosf`` / ``sinf`` on the GPU (accurate at any position,
as PyTorch's CUDA ``cos`` / ``sin``; NumPy's float32 ones in the interpreter), times ``scale``
in fp32 and rounded once to the dtype -- the numerics of the compressor kernel's rope
(:mod:`~.compressor`).  One program computes ``BLOCK_T`` tokens' rows (``BLOCK_T`` from the
rope width alone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast_to, cdiv, pow2
from .pdl import pdl_args, pdl_enter

_TILE_ELEMS = 4096  # channels a program copies per step (BLOCK_H heads x BLOCK_C channels)
MAX_HEADS = 8
"""Most heads a program takes by default.  ``bench_small_ops.py --tokens 8192 --rope-heads
1,2,4,8,16,64`` on an H100: the indexer's query ``[8192, 64, 128]`` 137.7 µs at 8 heads a program
against 615.7 at 64 (what filling :data:`_TILE_ELEMS` gave it) and 316.4 at 16; a rope-only view
``[8192, 64, 64]`` likewise 138.8 against 628.6; the attention output ``[8192, 65, 512]`` 408.1
at 8, within 1 % of its best (2 heads, 403.8)."""
_TABLE_ELEMS = 1024  # table entries per rope_cos_sin program: BLOCK_T tokens x BLOCK_HALF angles


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    H,
    D,
    HALF,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    NOPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < H
    x_base = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    o_base = out_ptr + (t * H + heads[:, None]) * D
    dtype = out_ptr.dtype.element_ty

    # pass-through channels: a plain copy
    cols = tl.arange(0, BLOCK_C)
    for c0 in range(0, NOPE, BLOCK_C):
        c = c0 + cols
        m = head_mask[:, None] & (c < NOPE)[None, :]
        tl.store(o_base + c[None, :], tl.load(x_base + c[None, :], mask=m), mask=m)

    # rotated channels: pairs (NOPE + 2i, NOPE + 2i + 1) by angle i
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    cos = tl.load(cos_ptr + t * stride_ct + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_st + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    m = head_mask[:, None] & i_mask[None, :]
    even = NOPE + 2 * i[None, :]
    a = tl.load(x_base + even, mask=m, other=0.0).to(tl.float32)
    b = tl.load(x_base + even + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(o_base + even, cast_to(a * cos - b * sin, dtype), mask=m)
    tl.store(o_base + even + 1, cast_to(a * sin + b * cos, dtype), mask=m)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_per_program: int | None = None
) -> torch.Tensor:
    """Triton ``apply_rope``: same signature, shapes and numerics as the reference.

    ``x`` ``[T, D]`` or ``[T, H, D]`` (fp32, bf16 or fp16; any strides, a non-unit channel
    stride is copied first), ``cos`` / ``sin`` ``[T, R/2]`` (any float dtype).  Returns a new
    contiguous tensor shaped and typed like ``x``.  ``heads_per_program``: the heads one program
    takes (a power of two; default: as many as fill :data:`_TILE_ELEMS` channels, at most
    :data:`MAX_HEADS`), the same
    result at any count (``bench_small_ops.py --rope-heads`` times them).
    """
    if heads_per_program is not None and (
        heads_per_program < 1 or heads_per_program & (heads_per_program - 1)
    ):
        raise ValueError(f"apply_rope: heads_per_program={heads_per_program}, not a power of two")
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    t, h, d = x3.shape
    half = cos.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_c = min(pow2(d - 2 * half), 1024)
    fill = _TILE_ELEMS // max(block_c, 2 * pow2(half))
    block_h = heads_per_program or max(1, min(pow2(h), fill, MAX_HEADS))
    _rope_kernel[(t, cdiv(h, block_h))](
        x3,
        cos,
        sin,
        out,
        h,
        d,
        half,
        x3.stride(0),
        x3.stride(1),
        cos.stride(0),
        sin.stride(0),
        NOPE=d - 2 * half,
        BLOCK_H=block_h,
        BLOCK_C=block_c,
        BLOCK_HALF=pow2(half),
        num_warps=4,
        **pdl_args(),
    )
    return out


@triton.jit
def _cos_sin_kernel(
    pos_ptr,
    inv_ptr,
    cos_ptr,
    sin_ptr,
    T,
    HALF,
    stride_p,
    stride_i,
    scale,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Rows ``[pid * BLOCK_T, +BLOCK_T)`` of both tables: ``cos/sin(pos * inv_freq) * scale``."""
    pdl_enter(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, BLOCK_HALF)
    row_ok, i_ok = rows < T, i < HALF
    pos = tl.load(pos_ptr + rows * stride_p, mask=row_ok, other=0).to(tl.float32)
    inv = tl.load(inv_ptr + i * stride_i, mask=i_ok, other=0.0).to(tl.float32)
    freq = pos[:, None] * inv[None, :]
    m = row_ok[:, None] & i_ok[None, :]
    out = rows[:, None] * HALF + i[None, :]
    dtype = cos_ptr.dtype.element_ty
    tl.store(cos_ptr + out, cast_to(tl.cos(freq) * scale, dtype), mask=m)
    tl.store(sin_ptr + out, cast_to(tl.sin(freq) * scale, dtype), mask=m)


def cos_sin_blocks(half: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_HALF)`` of ``rope_cos_sin`` for ``half`` angles a token (shapes only)."""
    block_half = pow2(half)
    return max(1, _TABLE_ELEMS // block_half), block_half


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``rope_cos_sin``: same signature, shapes and numerics as the reference.

    ``positions`` ``[T]`` integer, ``inv_freq`` ``[R/2]`` float (any strides), ``scale`` a
    number, ``dtype`` fp32, bf16 or fp16.  Returns new contiguous ``(cos, sin)``, each
    ``[T, R/2]`` in ``dtype``.
    """
    t, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((t, half), dtype=dtype, device=positions.device)
    sin = torch.empty((t, half), dtype=dtype, device=positions.device)
    if cos.numel() == 0:
        return cos, sin
    block_t, block_half = cos_sin_blocks(half)
    _cos_sin_kernel[(cdiv(t, block_t),)](
        positions,
        inv_freq,
        cos,
        sin,
        t,
        half,
        positions.stride(0),
        inv_freq.stride(0),
        float(scale),
        BLOCK_T=block_t,
        BLOCK_HALF=block_half,
        num_warps=4,
        enable_reflect_ftz=False,
        **pdl_args(),  # libdevice without flush to zero, as nvcc builds PyTorch
    )
    return cos, sin
