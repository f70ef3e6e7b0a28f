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
"""

from __future__ import annotations

_BODY = """{
    .reg .b32 m, mh, xh, h0, l0, h1, l1, s0, s1;
    and.b32 m, $4, 0x77777777;
    shr.u32 mh, m, 16;
    shr.u32 xh, $4, 16;
    prmt.b32 h0, 0xBFBFBF80, 0xC0C0C0C0, m;
    prmt.b32 l0, 0xC0800000, 0xC0804000, m;
    prmt.b32 h1, 0xBFBFBF80, 0xC0C0C0C0, mh;
    prmt.b32 l1, 0xC0800000, 0xC0804000, mh;
    prmt.b32 s0, 0x01010101, 0x01010101, $4;
    prmt.b32 s1, 0x01010101, 0x01010101, xh;
    mad.lo.u32 h0, s0, -128, h0;
    mad.lo.u32 h1, s1, -128, h1;
"""


def e2m1x8_bf16_ptx(outputs: tuple[tuple[int, str], ...]) -> str:
    """The decoding PTX whose output ``$j`` is ``prmt(l{half}, h{half}, selector)`` for
    ``(half, selector) = outputs[j]``: half 0 holds inputs 0..3, half 1 inputs 4..7; selector
    ``0x6240`` / ``0x7351`` gives the even / odd inputs of the half as a bf16 pair, ``0x5140`` /
    ``0x7362`` its inputs (0, 1) / (2, 3)."""
    lines = [f"    prmt.b32 ${j}, l{half}, h{half}, {sel};\n" for j, (half, sel) in enumerate(outputs)]
    return _BODY + "".join(lines) + "}"
