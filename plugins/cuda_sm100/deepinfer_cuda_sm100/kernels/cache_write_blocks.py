"""``cache_write`` into a block-scaled KV pool (DeepSeek-V4.1's formats,
:class:`deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool`) in one launch.

The reference quantises with some twenty tensor ops per write (per block the largest
magnitude, the scale and its byte, the scaled values clamped and rounded to e4m3 or e2m1, the
e2m1 codes paired into bytes, the parts concatenated) and then scatters.  Here one program per
written row computes the same bytes and stores them at the row's place: the element bytes,
then one scale byte per block.

**Bits** (equal to :func:`~deepinfer_core.ops.kv_blockscaled.quantize_block_rows`, asserted in
the interpreter and on the GPU), per block of ``B`` values with ``amax = max |x|`` in fp32:

- ``fp8_ue8m0`` (``B = 32``) and ``fp4_ue8m0`` (``B = 32``): the scale ``2**ceil(log2(p))``
  of ``p = max(amax, floor) * (1 / qmax)`` (one fp32 product) read from ``p``'s bits, its
  UE8M0 byte stored; the values times the exact inverse power of two;
- ``fp4_e4m3`` (``B = 16``): the scale the e4m3 rounding (ties to even, saturating at 448, as
  torch's cast) of ``max(amax, 6 * 2**-9) / 6`` (IEEE division), its e4m3 byte stored; the
  values divided by it (IEEE division);
- elements: e4m3 codes of the values clamped to ``±448``
  (:func:`~deepinfer_cuda_sm100.kernels.cache_write._e4m3_codes`: on the bits, the same on the
  GPU and in Triton's interpreter), or e2m1 codes of the values clamped to ``±6`` (the nearest
  of ``0, .5, 1, 1.5, 2, 3, 4, 6``, ties to the even code, the sign bit kept), two a byte, the
  even value in the low nibble.

Each row is written independently of the others: the result does not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops.kv_blockscaled import BLOCK_FORMATS, FP4_MAX, BlockScaledKVPool
from deepinfer_core.ops.kv_format import FP8_MAX

from ._common import pow2
from .cache_write import _e4m3_codes, _load_fp32, row_pointers
from .pdl import pdl_args, pdl_enter

FORMATS = ("fp8_ue8m0", "fp4_e4m3", "fp4_ue8m0")
"""The formats the kernel writes (``FMT`` is the index)."""


@triton.jit
def _ue8m0_scale(p):
    """``(byte, inverse)`` of ``2**ceil(log2(p))`` for fp32 ``p > 0`` (the UE8M0 byte from the
    bits, a power of two staying itself; its exact inverse: ``2**-127`` at byte 254, and 0 at
    255, the infinite scale, as a division by it gives)."""
    bits = p.to(tl.int32, bitcast=True)
    byte = tl.minimum(((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32), 255)
    field = tl.where(byte == 254, 0x00400000, tl.where(byte == 255, 0, (254 - byte) << 23))
    return byte, field.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(code):
    """The fp32 value of non-negative e4m3 codes (int32, at most 126)."""
    e = code >> 3
    m = code & 7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormals: m * 2**-9


@triton.jit
def _e2m1_codes(y):
    """The 4-bit e2m1 codes (int32) of fp32 ``y`` within ``[-6, 6]``: ties to the even code, the
    sign bit of ``y`` kept (``-0`` stays negative)."""
    mag = tl.abs(y)
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
    code += (mag > 5.0).to(tl.int32)
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _block_scale(amax, FMT: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr):
    """``(byte, factor)`` of the blocks of largest magnitudes ``amax``: the stored byte, and the
    inverse scale the values are multiplied by (ue8m0 formats) or the scale they are divided by
    (``fp4_e4m3``)."""
    if FMT == 1:
        s = tl.minimum(tl.math.div_rn(tl.maximum(amax, FLOOR), tl.full(amax.shape, QMAX, tl.float32)), 448.0)
        byte = _e4m3_codes(s)
        factor = _e4m3_value(byte)
    else:
        byte, factor = _ue8m0_scale(tl.maximum(amax, FLOOR) * (1.0 / QMAX))
    return byte, factor


@triton.jit
def _scaled(x, factor, FMT: tl.constexpr, QMAX: tl.constexpr):
    """Block values ``x [NB, *]`` scaled by their block's :func:`_block_scale` ``factor`` and
    clamped to ``±QMAX``."""
    if FMT == 1:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        y = tl.math.div_rn(x, factor[:, None] + tl.zeros_like(x))
    else:
        y = x * factor[:, None]
    nan: tl.constexpr = tl.PropagateNan.ALL
    return tl.minimum(tl.maximum(y, -QMAX, propagate_nan=nan), QMAX, propagate_nan=nan)


@triton.jit
def _block_rows_kernel(
    values_ptr,
    stride_v,
    rows_ptr,
    data_ptr,
    row_bytes,
    FMT: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    NB_P2: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Row ``pid`` of ``values`` packed into ``data`` row ``rows[pid]``."""
    pdl_enter(USE_PDL)
    src, dst = row_pointers(values_ptr, stride_v, rows_ptr, data_ptr, row_bytes)
    NB: tl.constexpr = DIM // BLOCK
    g = tl.arange(0, NB_P2)
    if FMT == 0:  # e4m3 elements, a byte each
        col = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        inside = col < DIM
        x = _load_fp32(src + col, inside)
        byte, factor = _block_scale(tl.max(tl.abs(x), axis=1), FMT, QMAX, FLOOR)
        tl.store(dst + col, _e4m3_codes(_scaled(x, factor, FMT, QMAX)).to(tl.uint8), mask=inside)
        tl.store(dst + DIM + g, byte.to(tl.uint8), mask=g < NB)
    else:  # e2m1 elements, two a byte: the even value in the low nibble
        HALF: tl.constexpr = BLOCK // 2
        pair = g[:, None] * HALF + tl.arange(0, HALF)[None, :]  # the byte index
        inside = pair < DIM // 2
        even = _load_fp32(src + 2 * pair, inside)
        odd = _load_fp32(src + 2 * pair + 1, inside)
        amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
        byte, factor = _block_scale(amax, FMT, QMAX, FLOOR)
        lo = _e2m1_codes(_scaled(even, factor, FMT, QMAX))
        hi = _e2m1_codes(_scaled(odd, factor, FMT, QMAX))
        tl.store(dst + pair, (lo | (hi << 4)).to(tl.uint8), mask=inside)
        tl.store(dst + DIM // 2 + g, byte.to(tl.uint8), mask=g < NB)


def write_block_rows(pool: BlockScaledKVPool, rows: torch.Tensor, values: torch.Tensor) -> BlockScaledKVPool:
    """``cache_write(pool, rows, values)`` for a :class:`BlockScaledKVPool`: ``values [M, dim]``
    (any float dtype, unit column stride or copied) quantised into ``pool.data`` rows ``rows [M]``
    in place; returns ``pool``."""
    m = values.shape[0]
    if m == 0:
        return pool
    if values.stride(-1) != 1:
        values = values.contiguous()
    info = BLOCK_FORMATS[pool.fmt]
    fmt = FORMATS.index(pool.fmt)
    qmax = FP8_MAX if info.bits == 8 else FP4_MAX
    floor = 1e-4 if fmt == 0 else FP4_MAX * 2.0**-9 if fmt == 1 else FP4_MAX * 2.0**-126
    _block_rows_kernel[(m,)](
        values,
        values.stride(0),
        rows.contiguous(),
        pool.data,
        pool.data.shape[1],
        FMT=fmt,
        DIM=pool.dim,
        BLOCK=info.block,
        NB_P2=pow2(pool.dim // info.block),
        QMAX=qmax,
        FLOOR=floor,
        num_warps=4,
        **pdl_args(),
    )
    return pool
