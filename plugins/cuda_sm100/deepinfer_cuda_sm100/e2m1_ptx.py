"""The inline PTX that decodes 4 packed FP4 (e2m1) bytes into their 8 exact bf16 values.

Shared by the Triton MoE kernel (:mod:`deepinfer_cuda_sm100.kernels.moe`) and the TileLang one
(:mod:`deepinfer_cuda_sm100.tl.moe`), which want the 8 values in different register orders.
Nibble ``i`` of the input register ``$4`` is input ``i``, a code ``s e e m``; bf16 of the
magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 has low bytes ``L = 00 00 80 C0 00 40 80 C0`` and high
bytes ``H = 00 3F 3F 3F 40 40 40 40``.  ``prmt`` with an 8-byte table and the magnitude indices
as selector nibbles looks up 4 bytes at once; the raw codes as selectors over a table of 0x01
bytes give 1 per positive code (the sign bit is prmt's replicate flag, and bit 7 of 0x01 is
clear), so ``(H + 0x80) - 128 * positive`` is the signed high byte::

    l0 = prmt(L, m)             L[i] of n0 n1 n2 n3       (L = 0xC0800000, 0xC0804000)
    h0 = prmt(H + 0x80, m)      H[i] + 0x80 of n0..n3    (0xBFBFBF80, 0xC0C0C0C0)
    l1, h1 likewise from mh     ... of n4..n7
    s0 = prmt(0x01 x 8, $4)     per nibble 1 if its sign bit is clear, else 0
    s1 = prmt(0x01 x 8, xh)
    h0 = h0 - 128 * s0          per byte H[i] for a positive code, H[i] | 0x80 for a negative one
    h1 = h1 - 128 * s1          (no borrows; mad.lo runs on the FMA pipe, not the integer one)

then four byte permutations interleave low and high bytes into the four bf16 pairs.  13
integer-pipe instructions and 2 IMADs for 8 values, each exact and signed (code 8 gives -0.0,
as the reference decoding does).

The tables may also come in registers, already scaled (:data:`TABLE_UE8M0_PTX`,
:data:`TABLE_FP32_PTX`): the lookup then yields the dequantised weights, one table per scale
group instead of one multiply per two weights (the TileLang MoE kernels).
"""

from __future__ import annotations

IMMEDIATE_TABLES = ("0xC0800000", "0xC0804000", "0xBFBFBF80", "0xC0C0C0C0", "-128")
"""The unscaled tables: ``L`` (two words), ``H + 0x80`` (two words) and the sign step ``-128``."""

_BODY = """{{
    .reg .b32 m, mh, xh, h0, l0, h1, l1, s0, s1;
    and.b32 m, $4, 0x77777777;
    shr.u32 mh, m, 16;
    shr.u32 xh, $4, 16;
    prmt.b32 h0, {2}, {3}, m;
    prmt.b32 l0, {0}, {1}, m;
    prmt.b32 h1, {2}, {3}, mh;
    prmt.b32 l1, {0}, {1}, mh;
    prmt.b32 s0, 0x01010101, 0x01010101, $4;
    prmt.b32 s1, 0x01010101, 0x01010101, xh;
    mad.lo.u32 h0, s0, {4}, h0;
    mad.lo.u32 h1, s1, {4}, h1;
"""


def e2m1x8_bf16_ptx(outputs: tuple[tuple[int, str], ...], tables: tuple[str, ...] = IMMEDIATE_TABLES) -> str:
    """The decoding PTX whose output ``$j`` is ``prmt(l{half}, h{half}, selector)`` for
    ``(half, selector) = outputs[j]``: half 0 holds inputs 0..3, half 1 inputs 4..7; selector
    ``0x6240`` / ``0x7351`` gives the even / odd inputs of the half as a bf16 pair, ``0x5140`` /
    ``0x7362`` its inputs (0, 1) / (2, 3).

    ``tables`` (five operands: the two words of ``L``, the two of ``H ^ 0x80`` and the sign
    step) default to the unscaled immediates; a scaled table (:data:`TABLE_UE8M0_PTX`,
    :data:`TABLE_FP32_PTX`) passed as registers makes the outputs the scaled weights."""
    lines = [f"    prmt.b32 ${j}, l{half}, h{half}, {sel};\n" for j, (half, sel) in enumerate(outputs)]
    return _BODY.format(*tables) + "".join(lines) + "}"


# The tables of a scale s, for a group of weights sharing it: the 8 magnitudes times s, each
# rounded once to bf16 (exactly what the reference gives; a negative weight is the negated
# product, as rounding to nearest even is symmetric), split into their low bytes L (outputs $0,
# $1: magnitudes 0..3, 4..7) and their high bytes with bit 7 flipped (X = H ^ 0x80: $2, $3), and
# the sign step K ($4).  Every product has the sign of s (zero included), so bit 7 of X is the
# same for all eight: clear when s >= 0 (the step -128 then sets it back for a positive code),
# set when s < 0 (the step +128 clears it for a positive code) -- per byte without carries.
_TABLE_TAIL = """    prmt.b32 $0, p0, p1, 0x6420;
    prmt.b32 $1, p2, p3, 0x6420;
    prmt.b32 $2, p0, p1, 0x7531;
    prmt.b32 $3, p2, p3, 0x7531;
    xor.b32 $2, $2, 0x80808080;
    xor.b32 $3, $3, 0x80808080;
"""

TABLE_UE8M0_PTX = (
    """{
    .reg .b32 s, p0, p1, p2, p3;
    mul.lo.u32 s, $5, 0x00800080;
    mov.b32 p0, 0x3F000000;
    mov.b32 p1, 0x3FC03F80;
    mov.b32 p2, 0x40404000;
    mov.b32 p3, 0x40C04080;
    mul.rn.bf16x2 p0, p0, s;
    mul.rn.bf16x2 p1, p1, s;
    mul.rn.bf16x2 p2, p2, s;
    mul.rn.bf16x2 p3, p3, s;
"""
    + _TABLE_TAIL
    + """    mov.b32 $4, -128;
}"""
)
"""Tables of a ue8m0 scale byte ``$5`` (``e``): ``s`` = bf16x2 ``e << 7`` (``2**(e - 127)``,
exact; bytes 0 and 255 give 0 and inf where torch reads ``2**-127`` and NaN, as the Triton
path), the magnitudes 0, .5, 1, 1.5 / 2, 3, 4, 6 as bf16 pairs times ``s`` by ``mul.rn.bf16x2``."""

TABLE_FP32_PTX = (
    """{
    .reg .b32 v0, v1, v2, v3, v4, v5, v6, v7, p0, p1, p2, p3, k;
    mul.rn.f32 v0, $5, 0f00000000;
    mul.rn.f32 v1, $5, 0f3F000000;
    mul.rn.f32 v2, $5, 0f3F800000;
    mul.rn.f32 v3, $5, 0f3FC00000;
    mul.rn.f32 v4, $5, 0f40000000;
    mul.rn.f32 v5, $5, 0f40400000;
    mul.rn.f32 v6, $5, 0f40800000;
    mul.rn.f32 v7, $5, 0f40C00000;
    cvt.rn.bf16x2.f32 p0, v1, v0;
    cvt.rn.bf16x2.f32 p1, v3, v2;
    cvt.rn.bf16x2.f32 p2, v5, v4;
    cvt.rn.bf16x2.f32 p3, v7, v6;
"""
    + _TABLE_TAIL
    + """    shr.s32 k, $5, 31;
    lop3.b32 $4, k, 0xFFFFFF00, 0x80, 0xAE;
}"""
)
"""Tables of an fp32 scale ``$5`` (``s``): the fp32 products of the magnitudes and ``s``
(``mul.rn.f32``, subnormals kept), each rounded once to bf16, as the reference's fp32 product
cast to bf16; the sign step ``(~(s >> 31) & 0xFFFFFF00) | 0x80``: -128 for ``s >= 0``, +128
for ``s < 0`` (the sign bit of s, -0 included)."""
