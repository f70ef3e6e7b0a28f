"""Helpers shared by the kernel modules: interpreter detection, exact casts and ``exp``, a paged
entry's pool row, block sizes."""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
"""Whether ``@triton.jit`` kernels defined now run in Triton's CPU interpreter (on CPU tensors)."""

_MANUAL_BF16 = tl.constexpr(INTERPRETED)
_INTERP = tl.constexpr(INTERPRETED)

if not INTERPRETED:  # libdevice calls cannot run in the interpreter (extern_elementwise)
    from triton.language.extra.cuda import libdevice
else:  # never called: the interpreter takes the float64 branches
    libdevice = None


@triton.jit
def exact_exp(x):
    """fp32 ``exp`` as PyTorch's CUDA kernels compute it: libdevice's ``expf`` on the GPU
    (``tl.exp`` is an approximation); float64 then rounded in the interpreter."""
    if _INTERP:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        y = tl.exp(x.to(tl.float64)).to(tl.float32)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """``x`` (fp32) converted to ``dtype`` with round-to-nearest-even, like ``tensor.to(dtype)``.

    On the GPU this is the hardware conversion.  Triton's interpreter truncates fp32 to
    bf16 instead of rounding, so there the rounding is done on the bits (finite values; NaN
    stays NaN).
    """
    if _MANUAL_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + ((bits >> 16) & 1) + 0x7FFF
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        y = tl.where(x != x, x.to(tl.bfloat16), y)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def paged_row(e, epp, bt_row, bt1, npages, mask):
    """Pool row of entry ``e`` (int32, ``>= 0``) of a paged source: ``bt_row`` points at the
    sequence's block-table row (``bt1`` its stride, ``npages`` its length; pages past it read
    the last), ``epp`` entries a page; one 32-bit division, the slot from the quotient."""
    q = e // epp
    page = tl.load(bt_row + tl.minimum(q, npages - 1) * bt1, mask=mask, other=0)
    return page.to(tl.int64) * epp + (e - q * epp)


@triton.jit
def ue8m0_value(b):
    """The fp32 value ``2**(b - 127)`` of UE8M0 scale bytes ``b`` (int32), as PyTorch converts
    ``float8_e8m0fnu``: a normal float for ``1 <= b <= 254``, ``2**-127`` (subnormal) for 0,
    NaN for 255."""
    bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_through(x, dtype: tl.constexpr):
    """``x.to(dtype).float()``: fp32 ``x`` rounded to ``dtype``'s precision (identity for fp32)."""
    if dtype == tl.float32:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        y = x
    else:
        y = cast_to(x, dtype).to(tl.float32)
    return y


@triton.jit
def round_e4m3(v):
    """fp32 ``v`` (``|v| <= 448``) rounded to the nearest e4m3 value (ties to even), kept in fp32.

    On the bits, so the same on the GPU and in the interpreter, whose fp32 -> e4m3 conversion
    mis-rounds at binade boundaries (31.07 becomes 16).  Normals keep 3 mantissa bits; below
    2**-6 the step is 2**-9 (subnormals).
    """
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + ((bits >> 20) & 1) + 0x7FFFF) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    magic = 24576.0  # 1.5 * 2**14: adding and subtracting it rounds to a multiple of 2**-9
    sub = (v + magic) - magic
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


def pow2(n: int) -> int:
    """The smallest power of two >= ``max(n, 1)``."""
    return triton.next_power_of_2(max(int(n), 1))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)
