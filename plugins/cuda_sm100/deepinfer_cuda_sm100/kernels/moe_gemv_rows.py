"""The decode-width FP4 GEMVs' dot products (:mod:`~deepinfer_cuda_sm100.kernels.moe_gemv`).

:func:`gemv_rows`: two sets of FP4 weight rows times one activation row, on CUDA cores, in K
steps; per step and set the packed bytes as a ``[rows, runs, 16]`` tile (a run: the 16 bytes,
32 inputs, of one scale group) with one scale per run (the loads of
:mod:`~deepinfer_cuda_sm100.kernels.moe`: ``_fp4_packed``, ``_fp4_scales``), the activations
split into each byte's even and odd input and widened to fp32.  Two ways by the scales (the
exactness argument is in :mod:`~deepinfer_cuda_sm100.kernels.moe_gemv`'s docstring):

* ue8m0 scales with bf16 or fp32 activations (:func:`_folded_runs`): the e2m1 values decoded
  unscaled, each run's 32 products summed within the thread (two chains of FFMAs: the even and
  the odd inputs), the run's sum times its scale ``2**(e - 127)`` (the byte as the fp32 exponent
  field) added to an fp32 accumulator per (row, run);
* otherwise (float32 scales, fp16 activations): each weight dequantised to the activations'
  dtype (``_fp4_values``), the fp32 products accumulated elementwise in a ``[rows, runs, 16]``
  fp32 tile.

Accumulators are reduced after the K loop.  On the GPU the unscaled decoding is the PTX lookup of
:func:`~deepinfer_cuda_sm100.e2m1_ptx.e2m1x8_bf16_ptx` (15 instructions per 8 weights) with its
table words in registers (:data:`_E2M1_REG_PTX`), then one widening instruction per weight
(:data:`_WIDEN_BF16X2_PTX`); in the interpreter the arithmetic of ``_e2m1``.

The table registers: a ``prmt`` lookup needs one word of its 8-byte table in a register.  As
immediates (``moe._E2M1_BF16_PTX``), ptxas keeps the three words in uniform registers and copies
one into a vector register before each lookup: 40 ``IMAD.U32`` per 64 weights.  Here they are
operands made from a per-thread zero the compilers cannot fold (``arange(rows) * (E >> 31)``,
zero since the expert count ``E < 2**31``; a warp-uniform zero would land in a uniform register
again), computed once before the loop and kept live (Triton specialises ``E = 1`` to a constant:
then the copies return).  The float32-scale path keeps ``moe._fp4_values`` as it is.
Offline sm_90 SASS of a K step at the default launch (gate / up, bf16 activations, ue8m0: two
row sets of 32 weights a thread): 317 instructions (~5.0 a weight: decoding 1.9, widening 1,
FFMA 1, the rest the activations' and the scales' layout conversions through shared memory and
the loop), 72 registers; the same with immediate tables 363.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..e2m1_ptx import e2m1x8_bf16_ptx
from .moe import _e2m1, _fp4_packed, _fp4_scales, _fp4_values

# bf16 to fp32 in inline PTX: Triton converts each bf16 element on its own (an extract of the
# 16-bit half, then a shift); a bf16x2 register gives both fp32 values in one instruction each.
_WIDEN_BF16X2_PTX = tl.constexpr("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }")

_E2M1_OUTPUTS = ((0, "0x6240"), (1, "0x6240"), (0, "0x7351"), (1, "0x7351"))
"""The outputs of ``moe._E2M1_BF16_PTX``: the low nibbles' values as two bf16x2 registers
(inputs 0, 2 and 4, 6 of the 8 nibbles), then the high nibbles'."""
_TABLE_L = tl.constexpr(0xC0800000)
"""The first word of the low bytes' table (magnitudes 0, .5, 1, 1.5), operand ``$5``."""
_TABLE_H = tl.constexpr(0xBFBFBF80)
"""The first word of the high bytes' table (``H + 0x80``), operand ``$9``."""
_TABLE_SIGN = tl.constexpr(0x01010101)
"""The sign lookup's table word, operand ``$13``."""


def register_tables_ptx() -> str:
    """The unscaled e2m1 decoding (:func:`~deepinfer_cuda_sm100.e2m1_ptx.e2m1x8_bf16_ptx`, the
    outputs of ``moe._E2M1_BF16_PTX``) with the table word each lookup reads from a register
    taken from operands: ``$5`` (:data:`_TABLE_L`), ``$9`` (:data:`_TABLE_H`), ``$13``
    (:data:`_TABLE_SIGN`), the first of the four registers Triton passes per ``uint32``
    operand at ``pack=4``; the other table words stay immediates."""
    text = e2m1x8_bf16_ptx(_E2M1_OUTPUTS, ("$5", "0xC0804000", "$9", "0xC0C0C0C0", "-128"))
    for selector in ("$4", "xh"):
        old = f"0x01010101, 0x01010101, {selector};"
        if text.count(old) != 1:
            raise RuntimeError(f"e2m1_ptx's sign lookup changed: {old!r} not found once")
        text = text.replace(old, f"$13, 0x01010101, {selector};")
    return text


_E2M1_REG_PTX = tl.constexpr(register_tables_ptx())
_E2M1_REG_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 13))


@triton.jit
def _to_fp32(v, PTX: tl.constexpr):
    """``v.to(tl.float32)`` (exact); ``PTX`` (GPU, bf16 ``v``): one instruction per value."""
    if PTX:
        out = tl.inline_asm_elementwise(
            _WIDEN_BF16X2_PTX, "=r,=r,r", [v], dtype=tl.float32, is_pure=True, pack=2
        )
    else:
        out = v.to(tl.float32)
    return out


@triton.jit
def _e2m1_unscaled(packed, zero):
    """``(lo, hi)``: the exact fp32 e2m1 values of the low and the high nibbles of uint8
    ``packed`` (GPU only: :data:`_E2M1_REG_PTX`, then :data:`_WIDEN_BF16X2_PTX`); ``zero``:
    uint32 zeros broadcastable to ``packed``, per thread and opaque to the compilers, from which
    the table registers are made."""
    zero = tl.broadcast_to(zero, packed.shape)
    lo, hi = tl.inline_asm_elementwise(
        _E2M1_REG_PTX, _E2M1_REG_CONSTRAINTS,
        [packed, zero + _TABLE_L, zero + _TABLE_H, zero + _TABLE_SIGN],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip
    return _to_fp32(lo, True), _to_fp32(hi, True)


@triton.jit
def _folded_runs(packed, s, a_even, a_odd, zero, E2M1_PTX: tl.constexpr):
    """``[rows, runs, 1]`` fp32: per run of the uint8 ``packed [rows, runs, bytes]`` the dot
    product of its unscaled e2m1 values with the fp32 activations ``a_even`` / ``a_odd``
    (``[1, runs, bytes]``: the low / high nibbles' inputs), summed within the thread, times the
    run's ue8m0 scale byte ``s [rows, runs]`` read as the fp32 exponent field (bytes 0 and 255:
    0 and inf).  ``zero``: see :func:`_e2m1_unscaled`."""
    if E2M1_PTX:
        lo, hi = _e2m1_unscaled(packed, zero)
    else:
        lo = _e2m1(packed & 15)
        hi = _e2m1(packed >> 4)
    part = tl.sum(lo * a_even, axis=2, keep_dims=True) + tl.sum(hi * a_odd, axis=2, keep_dims=True)
    return part * (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)[:, :, None]


@triton.jit
def gemv_rows(
    a_ptr,
    w_ptr,
    w_rows0,
    w_rows1,
    s_ptr,
    s_rows0,
    s_rows1,
    n_ok0,
    n_ok1,
    opaque_zero,
    K: tl.constexpr,
    dtype: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """Two fp32 ``[BLOCK_N]`` dot products of the activation row at ``a_ptr`` (``K`` inputs in
    ``dtype``, unit stride) with the FP4 weight rows ``w_ptr + w_rows0`` and ``w_ptr + w_rows1``
    (packed byte offsets, ``[BLOCK_N]`` each, masked by ``n_ok0`` / ``n_ok1``; scales at ``s_ptr +
    s_rows*``), in K steps of ``BLOCK_K`` (one loop: each activation step loaded once for both).

    ue8m0 scales with bf16 / fp32 ``dtype``: folded into each run's sum (:func:`_folded_runs`);
    otherwise the weights dequantised to ``dtype``, exact fp32 products accumulated elementwise
    (see the module docstring).  ``opaque_zero``: a runtime int the caller knows is 0 but the
    compilers cannot (``E >> 31``), for the decoding's table registers.  ``E2M1_PTX``: the
    decoding in inline PTX (GPU); ``FP32_DOT``: the interpreter's dequantisation."""
    HALF: tl.constexpr = BLOCK_K // 2
    RUN: tl.constexpr = HALF_GROUP if HALF_GROUP < HALF else HALF
    RUNS: tl.constexpr = HALF // RUN
    FOLD: tl.constexpr = UE8M0 and dtype != tl.float16
    ACC: tl.constexpr = 1 if FOLD else RUN
    A_PTX: tl.constexpr = E2M1_PTX and dtype == tl.bfloat16
    zero = (tl.arange(0, BLOCK_N) * opaque_zero).to(tl.uint32)[:, None, None]  # per thread
    kr = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_N, RUNS, ACC), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, RUNS, ACC), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        p0 = _fp4_packed(w_ptr, w_rows0, n_ok0, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        p1 = _fp4_packed(w_ptr, w_rows1, n_ok1, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        s0 = _fp4_scales(s_ptr, s_rows0, n_ok0, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        s1 = _fp4_scales(s_ptr, s_rows1, n_ok1, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        kk = k0 + kr
        a = tl.load(a_ptr + kk, mask=kk < K, other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a, (RUNS, RUN, 2)))  # each byte's even and odd input
        a_even = _to_fp32(a_even, A_PTX)[None, :, :]
        a_odd = _to_fp32(a_odd, A_PTX)[None, :, :]
        if FOLD:
            acc0 += _folded_runs(p0, s0, a_even, a_odd, zero, E2M1_PTX)
            acc1 += _folded_runs(p1, s1, a_even, a_odd, zero, E2M1_PTX)
        else:
            lo, hi = _fp4_values(p0, s0, dtype, UE8M0, FP32_DOT, E2M1_PTX)
            acc0 += _to_fp32(lo, A_PTX) * a_even
            acc0 += _to_fp32(hi, A_PTX) * a_odd
            lo, hi = _fp4_values(p1, s1, dtype, UE8M0, FP32_DOT, E2M1_PTX)
            acc1 += _to_fp32(lo, A_PTX) * a_even
            acc1 += _to_fp32(hi, A_PTX) * a_odd
    return tl.sum(tl.sum(acc0, axis=2), axis=1), tl.sum(tl.sum(acc1, axis=2), axis=1)
