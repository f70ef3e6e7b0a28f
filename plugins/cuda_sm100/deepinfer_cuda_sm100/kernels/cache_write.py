"""``cache_write`` into a packed FP8 KV pool in one launch (contract:
``deepinfer_core.ops.cache.cache_write``; the pool format:
:class:`deepinfer_core.ops.kv_format.Fp8KVPool`, ``kv_cache_dtype="fp8"``).

The reference quantises the rows with some twenty tensor ops (per 64-value group the largest
magnitude, its UE8M0 exponent, the scaled values clamped and cast to e4m3, the rope values in
bfloat16, the parts concatenated) and then scatters them: a decode step writing every layer's
window ring and its own rows in the ring's format launches ~150 kernels for it at four layers.
Here one program per written row computes the same bytes and stores them at the row's place.

**Bits** (equal to :func:`~deepinfer_core.ops.kv_format.quantize_fp8_rows`, asserted in the
interpreter and on the GPU): the group exponent from the bits of the largest magnitude
(``frexp`` as the reference takes it: an all-zero group -9, a subnormal maximum -126, clamped
to ``[-126, 126]``), the values times the exact power of two ``2**-e``, clamped to ``±448`` and
rounded to e4m3 (ties to even) on their bits -- the same code on the GPU and in Triton's
interpreter, whose own fp32 -> e4m3 conversion mis-rounds -- the sign from the value's sign bit
(``-0`` gives ``0x80``, as torch's cast does); the rope values rounded to bfloat16 (ties to
even); the padding bytes zero.  Each row is written independently of the others, so the
result does not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops.kv_format import SCALE_GROUP, Fp8KVPool, fp8_row_layout

from ._common import cast_to, pow2, round_e4m3
from .pdl import pdl_args, pdl_enter


@triton.jit
def _ue8m0_exponent(amax):
    """Per group, the reference's scale exponent of the largest magnitude ``amax`` (fp32,
    ``>= 0``): the smallest ``e`` with ``amax <= 448 * 2**e`` (``1.f * 2**E <= 1.75 * 2**(e +
    8)``), -9 for zero, -126 for a subnormal, clamped to ``[-126, 126]`` (int32)."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = bits >> 23
    e = biased - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    special = tl.where((bits & 0x7FFFFF) == 0, -8, -9)  # frexp(inf) = (inf, 0), frexp(nan) = (nan, 0)
    return tl.where(amax == 0, -9, tl.where(biased == 0, -126, tl.where(biased == 255, special, e)))


@triton.jit
def _e4m3_codes(v):
    """The e4m3 bytes (int32) of fp32 ``v`` (``|v| <= 448``), rounded to nearest, ties to even
    (:func:`~._common.round_e4m3`), read off the rounded value: a normal one's top 11 bits less
    the exponent bias difference (120 x 8), a subnormal one in steps of ``2**-9`` (codes 0-8);
    NaN gives e4m3's NaN code, the sign bit ``v``'s."""
    a = tl.abs(round_e4m3(v))
    code = tl.where(a < 0.015625, (a * 512.0).to(tl.int32), (a.to(tl.int32, bitcast=True) >> 20) - 960)
    code = tl.where(v != v, 0x7F, code)
    return code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)


@triton.jit
def row_pointers(values_ptr, stride_v, rows_ptr, data_ptr, row_bytes):
    """``(source, destination)``: the start of this program's row of ``values`` and of the
    packed row ``rows[pid]`` of ``data`` it is written to."""
    i = tl.program_id(0).to(tl.int64)
    return values_ptr + i * stride_v, data_ptr + tl.load(rows_ptr + i).to(tl.int64) * row_bytes


@triton.jit
def _load_fp32(ptr, mask):
    """Values of any float dtype as fp32, exactly: bfloat16 through its bits (Triton's
    interpreter flushes bfloat16 subnormals in its own conversion)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        raw = tl.load(ptr.to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
        x = (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _fp8_rows_kernel(
    values_ptr,
    stride_v,
    rows_ptr,
    data_ptr,
    row_bytes,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_OFFSET: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    GROUPS: tl.constexpr,
    TAIL: tl.constexpr,
    GROUPS_P2: tl.constexpr,
    ROPE_P2: tl.constexpr,
    GROUP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Row ``pid`` of ``values`` packed into ``data`` row ``rows[pid]``."""
    pdl_enter(USE_PDL)
    src, dst = row_pointers(values_ptr, stride_v, rows_ptr, data_ptr, row_bytes)
    g = tl.arange(0, GROUPS_P2)
    col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    inside = col < NOPE
    x = _load_fp32(src + col, inside)
    e = _ue8m0_exponent(tl.max(tl.abs(x), axis=1))
    e = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, -9, e)  # torch's amax keeps NaN
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
    nan: tl.constexpr = tl.PropagateNan.ALL  # NaN stays NaN, as torch's clamp keeps it
    v = tl.minimum(tl.maximum(x * inv[:, None], -448.0, propagate_nan=nan), 448.0, propagate_nan=nan)
    tl.store(dst + col, _e4m3_codes(v).to(tl.uint8), mask=inside)
    tl.store(dst + SCALE_OFFSET + g, (e + 127).to(tl.uint8), mask=g < GROUPS)
    if ROPE > 0:
        r = tl.arange(0, ROPE_P2)
        xr = _load_fp32(src + NOPE + r, r < ROPE)
        bf = cast_to(xr, tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
        tl.store(dst + ROPE_OFFSET + 2 * r, (bf & 0xFF).to(tl.uint8), mask=r < ROPE)
        tl.store(dst + ROPE_OFFSET + 2 * r + 1, (bf >> 8).to(tl.uint8), mask=r < ROPE)
    if ROPE_OFFSET > NOPE:  # the byte that aligns an odd nope part
        tl.store(dst + NOPE, tl.zeros((), tl.uint8))
    if TAIL > 0:  # the row's padding to its alignment
        p = tl.arange(0, 8)
        tl.store(dst + SCALE_OFFSET + GROUPS + p, tl.zeros((8,), tl.uint8), mask=p < TAIL)


def write_fp8_rows(pool: Fp8KVPool, rows: torch.Tensor, values: torch.Tensor) -> Fp8KVPool:
    """``cache_write(pool, rows, values)`` for an :class:`Fp8KVPool`: ``values [M, dim]`` (any
    float dtype, unit column stride or copied) quantised into ``pool.data`` rows ``rows [M]``
    in place; returns ``pool``."""
    m = values.shape[0]
    if m == 0:
        return pool
    if values.stride(-1) != 1:
        values = values.contiguous()
    rows = rows.contiguous()
    lay = fp8_row_layout(pool.dim, pool.rope_dim)
    _fp8_rows_kernel[(m,)](
        values,
        values.stride(0),
        rows,
        pool.data,
        lay.row_bytes,
        NOPE=lay.nope,
        ROPE=lay.rope_dim,
        ROPE_OFFSET=lay.rope_offset,
        SCALE_OFFSET=lay.scale_offset,
        GROUPS=lay.groups,
        TAIL=lay.row_bytes - lay.scale_offset - lay.groups,
        GROUPS_P2=pow2(lay.groups),
        ROPE_P2=pow2(lay.rope_dim),
        GROUP=SCALE_GROUP,
        num_warps=4,
        **pdl_args(),
    )
    return pool
