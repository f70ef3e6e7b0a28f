"""``moe_experts``: routed experts as grouped GEMMs over expert-sorted (token, slot) pairs.

Contract: ``deepinfer_core.ops.moe.moe_experts``: ``sum_j w[t,j] * down_e(silu(min(g,L)) *
clamp(u,-L,L))`` with ``[g | u] = gate_up_e @ x[t]``.  The expert stacks are plain tensors in
``x``'s dtype or FP4 e2m1 :class:`~deepinfer_core.weights.quant.QuantizedTensor` values (packed
``[E, out, in/2]``, low nibble = even input; one float32 or ue8m0 scale per ``group`` inputs),
dequantised in the kernels: each code becomes its e2m1 value (exact) times its group's scale
(the fp32 product, exact for a ue8m0 scale) rounded to ``x``'s dtype, which is bitwise
:meth:`QuantizedTensor.dequantize` ``(x.dtype)`` (but for ue8m0 bytes 0 and 255, taken as 0 and
inf where torch reads 2**-127 and NaN).  On the GPU the values come from a lookup-table
conversion in inline PTX (:data:`_E2M1_BF16_PTX`: 4 packed bytes to 8 exact bf16 values in 15
instructions) and, for bf16 activations with ue8m0 scales, one ``mul.rn.bf16x2`` per two
weights; under Triton's interpreter, which cannot run inline assembly, the same values come
from arithmetic on an fp16 bit pattern.

Four launches (five in the FP8 math, below), no host synchronisation (CUDA-graph capturable;
shapes decide the grids only):

1. :func:`_layout_kernel` (one program per expert) sorts the ``P = T * k`` pairs by expert
   into a buffer of ``n_tiles`` tiles of ``BLOCK_M`` rows: each expert's pairs (in pair order
   ``t * k + j``) fill whole tiles of their own, padded with ``-1``; ``tile_expert`` names the
   expert of each tile (``E`` for the tiles past the used ones).  ``n_tiles`` is the bound
   ``(P + (BLOCK_M - 1) * min(E, P)) // BLOCK_M`` on ``sum_e ceil(count_e / BLOCK_M)``.  This
   is the layout expert parallelism can dispatch into later.
2. :func:`_gate_up_kernel`, a program per (tile, block of the intermediate dim): the tile's
   token rows times the expert's gate and up rows, fp32 accumulation, then the clamped SwiGLU;
   the activations ``h`` (``x``'s dtype) are stored per sorted row.  An expert's weight tile
   is read once per tile of its rows (once per call at decode, where every expert gets one
   tile).
3. :func:`_down_kernel`, a program per (tile, block of the model dim): ``h`` times the expert's
   down rows, times the routing weight; each pair's contribution (``x``'s dtype) is stored at
   its pair index.
4. :func:`_combine_kernel`, a program per (token, block of the model dim): the token's ``k``
   contributions added in fp32 in ascending expert order (a duplicated expert in slot
   order), stored in ``x``'s dtype.

Rounding points follow the reference, so that on the same dequantised weights the kernels
agree with it to the last bit wherever the fp32 accumulation order does: gate / up,
``silu(min(g, L))``, ``h`` and the down output are each rounded to ``x``'s dtype; in the
default mode the routing weight is rounded to ``x``'s dtype before it scales the output
(the reference's dense and grouped paths), in the batch-invariant mode it scales in fp32 and
the running sum is rounded to ``x``'s dtype before each new expert (the reference's tiled
path: one rounding per expert, a duplicated expert's contributions summed in fp32 first).

Batch invariance: a pair's row is computed alone within its tile (no row mixes with another
in a ``tl.dot``), with a K order and tile shapes that do not depend on the call, so a token's
result does not depend on the other tokens of the call as long as ``BLOCK_M`` stays the same:
:func:`tile_rows` keeps it fixed in the batch-invariant mode (default mode: wider tiles when
many pairs share each expert, i.e. prefill).

Expert ids outside ``[0, E)`` (an expert-parallel dispatch's padding rows: ``-1``) get no row
and contribute nothing, as in the reference.

Cost (offline compile for sm_90 with Triton 3.6, decode tiles: 16 rows, 4 warps, 3 stages; gate /
up kernel, bf16 activations, ue8m0 scales): ~104 registers, no spills; the packed bytes arrive by
``cp.async`` through shared memory straight in the MMA operand layout, where the PTX decodes
them; the activation tile loads contiguous and splits into its even and odd inputs in registers;
the scales load a K step ahead.  The main loop issues ~580 instructions per K step of 128 inputs
(~4.5 per weight element, ~3.3 of them decoding and scaling: the 15 PTX instructions per 8
values, a bf16x2 multiply per 2, the scale bytes' conversion and ~0.7 copies of the lookup
tables into registers that ptxas emits per use) against ~1450 (~11.4: nibble split, fp16 bit
pattern, conversion, fp32 scale, bf16 packing) with the arithmetic decoding; ~280 of them go to
the integer pipe (PRMT / LOP3 / SHF at half rate), which with the issue slots bounds the loop
near ~580 cycles per warp and K step.  Measured before the change on an H200
(``scripts/bench_moe.py``: 256 experts 4096 x 2048, top-6): FP4 ~0.9 TB/s of packed weights,
bf16 experts 4.3 TB/s.  The FP4 rate with the PTX decoding is to be measured.  (sm_100's native
``cvt.rn.bf16x2.e2m1x2`` would cut the decoding further.)

**FP8 math** (opt-in: ``DEEPINFER_MOE_MATH=fp8``, read at each call by :func:`moe_math`; default
``bf16``, the dequantised-weight math above).  For FP4 stacks whose scale groups are multiples of
32 inputs (:func:`fp8_math_applies`; the others keep the default math):

* the activations are quantised per token (per pair row for ``h``) and per 32 inputs to e4m3
  with a power-of-two fp32 scale, the smallest that keeps ``amax / scale <= 448`` (exact
  division; :func:`_fp8_quantise`): ``x`` by :func:`_quantise_kernel` (a fifth launch), ``h`` by
  the gate / up kernel's epilogue after its rounding to ``x``'s dtype (codes and scales
  instead of ``h``);
* the e2m1 codes become e4m3 codes (every e2m1 value is exact in e4m3) in inline PTX
  (:data:`_E2M1_E4M3_PTX`: 4 codes in 4 instructions);
* K steps of 128 inputs, 4 groups of 32, each one e4m3 ``tl.dot`` with the weights as the
  MMA's M (64 rows) and the tile's rows as its N (an fp8 ``wgmma`` on sm_90, ``tcgen05`` on
  sm_100: Triton's ``mma.sync`` path would widen e4m3 to fp16), its fp32 result times the
  group's weight scale times its activation scale added to the fp32 accumulator
  (:func:`_rows_times_expert_fp8`).

Its results differ from the reference by the activation quantisation: e4m3 keeps 3 mantissa
bits, so each product is off by up to ``2**-4`` of itself, which does not average down
relative to a dot product of random signs.  Measured under the interpreter on random data
(``tests/test_moe_kernel.py``): relative RMS error of the output ~3-5 % and the largest error
4-8 % of the largest output (the ``bf16`` math: ~0.2 % and ~0.6 % in bf16), as expected of
e4m3 activations (DeepSeek-V3's FP8 GEMMs quantise activations the same way, per 1x128).
Offline sm_90 SASS (decode tile, 16 rows, ue8m0, 4 warps, 3 stages): the gate / up main loop
issues ~700 instructions per 128 inputs (bf16 math: ~580) with 170 registers (bf16 math: 104):
the e4m3 decoding is cheaper (~6 instructions per 4 weights with the table copies ptxas
re-materialises, against ~10), but each group of 32 pays a ``wgmma`` wait, fences for its
shared-memory operand and the accumulator scaling (2 fp32 operations per accumulator element),
and the 12 scale vectors of a step load a step ahead.  So it is not expected to be faster at
decode; to be measured (``scripts/bench_moe.py``'s ``triton_fp4_fp8math`` column).  Variants
tried offline: the scales loaded where used (~655 instructions, 164 registers, their latency
exposed) or as ``[rows, 4]`` tiles a step ahead with the group's column picked in registers
(~710, 101 registers, but 48 barriers a step for the layout conversions).  Not the default:
slower or not, it is outside the op's bf16 tolerance.

Under Triton's CPU interpreter ``tl.dot`` on bf16 / fp16 operands is unreliable, so operands
are converted to fp32 (exactly: they are rounded to ``x``'s dtype first) and bf16 stores are
rounded on the bits (:func:`~._common.cast_to`); the FP8 math's e4m3 values are kept as fp32
values (rounded by :func:`~._common.round_e4m3`: the interpreter's fp32 -> e4m3 conversion
mis-rounds) and its group products are explicit fp32 product-sums.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..e2m1_ptx import e2m1x8_bf16_ptx
from ._common import INTERPRETED, cast_to, cdiv, pow2, round_e4m3, round_through
from .pdl import pdl_args, pdl_enter

DECODE_BLOCK_M = 16
"""Rows per tile at decode and in the batch-invariant mode (the smallest ``tl.dot`` M)."""
MAX_BLOCK_M = 64
"""Rows per tile when many pairs share each expert (default mode only)."""
FP4_BLOCK_K = 128
"""Inputs per K step for FP4 weights (64 packed bytes per weight row)."""
DENSE_BLOCK_K = 64
"""Inputs per K step for plain weights."""
BLOCK_N = 64
"""Output columns (of the intermediate dim, or of the model dim) per program."""
COMBINE_BLOCK_D = 1024
"""Model-dim columns per combine program."""
MAX_TOP_K = 16
"""Most experts per token the combine kernel takes (its slots sit in one register tile)."""

MOE_MATH_ENV = "DEEPINFER_MOE_MATH"
"""Environment variable choosing the FP4 experts' math, read at each call: ``bf16`` (default) or
``fp8`` (see :func:`moe_math`)."""
MOE_MATHS = ("bf16", "fp8")
FP8_GROUP = 32
"""FP8 math: inputs per activation scale and per ``tl.dot`` (one e4m3 MMA K step)."""

_FP32_DOT = tl.constexpr(INTERPRETED)
_LAYOUT_BLOCK_P = 1024  # pairs per step of the layout kernel's scans
_QUANT_BLOCK_G = 32  # groups of 32 inputs per program of the quantisation kernel


def moe_math() -> str:
    """The FP4 experts' math, from :data:`MOE_MATH_ENV` (read now, so a benchmark can flip it
    between calls; a CUDA graph keeps the math of its capture):

    * ``bf16`` (default): each FP4 weight dequantised to ``x``'s dtype, bitwise the reference's
      dequantisation, ``tl.dot`` in that dtype, fp32 accumulation;
    * ``fp8``: e4m3 math (:func:`fp8_math_applies` says for which stacks): the e2m1 codes become
      e4m3 (exact), the activations are quantised per token and per :data:`FP8_GROUP` inputs
      to e4m3 with a power-of-two fp32 scale, the e4m3 ``tl.dot`` of each group is scaled by the
      activation and weight scales and summed in fp32.  Not the reference's numerics: the
      activation rounding (3 mantissa bits) adds an error of up to ``2**-4`` of each product.
    """
    value = os.environ.get(MOE_MATH_ENV, "").strip().lower() or "bf16"
    if value not in MOE_MATHS:
        raise ValueError(f"{MOE_MATH_ENV}={value!r}: expected one of {', '.join(MOE_MATHS)}")
    return value


@contextmanager
def using_moe_math(value: str) -> Iterator[None]:
    """``DEEPINFER_MOE_MATH=value`` (:data:`MOE_MATH_ENV`) for the calls and graph captures
    inside, restored afterwards (benchmarks and tests compare the maths this way)."""
    old = os.environ.get(MOE_MATH_ENV)
    os.environ[MOE_MATH_ENV] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[MOE_MATH_ENV]
        else:
            os.environ[MOE_MATH_ENV] = old


def fp8_math_applies(w) -> bool:
    """Whether the ``fp8`` math takes the expert stack ``w``: FP4 stacks whose scale groups are
    whole multiples of :data:`FP8_GROUP` inputs (and whose input count is, then, too); the others
    keep the ``bf16`` math (an e4m3 MMA takes 32 inputs a step)."""
    if isinstance(w, torch.Tensor):
        return False
    group = w.block[1]
    return group % FP8_GROUP == 0 and w.shape[-1] % FP8_GROUP == 0


@dataclass(frozen=True)
class TileLaunch:
    """Overrides of the tiled launches' sizes (``None``: the default from shapes): ``block_m``
    rows a tile (the sorted layout's tile height), ``block_n`` output columns a program (gate /
    up: that many of the gate's and of the up's; down: twice that), ``block_k`` inputs a K step
    (plain stacks only: FP4 stacks keep theirs), ``warps`` and ``stages``.  Any launch gives the
    op's result within its tolerances (the K order changes with the sizes, not the rounding
    points); ``bench_moe.py --tile-sweep`` times a grid of them."""

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    warps: int | None = None
    stages: int | None = None


DEFAULT_LAUNCH = TileLaunch()
"""Every size from shapes."""


def tile_rows(pairs: int, experts: int, batch_invariant: bool) -> int:
    """``BLOCK_M`` for ``pairs`` (token, slot) pairs over ``experts`` experts (shapes only).

    Fixed at :data:`DECODE_BLOCK_M` in the batch-invariant mode; otherwise wider tiles once
    the average expert has more rows than that, so fewer tiles re-read the same expert.
    """
    if batch_invariant:
        return DECODE_BLOCK_M
    per_expert = pairs / max(experts, 1)
    bm = DECODE_BLOCK_M
    while bm < MAX_BLOCK_M and per_expert >= 2 * bm:
        bm *= 2
    return bm


def e2m1_ptx(block_n: int, block_k: int, warps: int) -> bool:
    """Whether the FP4 launches with these tiles decode e2m1 in inline PTX: on the GPU (the
    interpreter cannot run it), for tiles of at least 4 packed bytes per thread (an instance
    takes 4 and Triton needs their count per thread to divide by it; the counts are powers of
    two at least ``BLOCK_N * BLOCK_K / 2 / threads``)."""
    return not INTERPRETED and block_n * block_k // 2 >= 4 * 32 * warps


def fp8_e2m1_ptx(block_n: int, warps: int) -> bool:
    """:func:`e2m1_ptx` for the ``fp8`` math, whose steps load ``BLOCK_N x 16`` packed bytes (a
    group of 32 inputs) and whose PTX takes them two at a time."""
    return not INTERPRETED and block_n * 16 >= 2 * 32 * warps


def tile_count(pairs: int, experts: int, block_m: int) -> int:
    """Tiles of the sorted layout: a bound on ``sum_e ceil(count_e / block_m)`` from shapes."""
    return (pairs + (block_m - 1) * min(experts, pairs)) // block_m


# ---------------------------------------------------------------------------------------------
# device helpers


# The e2m1 decoding on the GPU, in inline PTX (Triton's CPU interpreter cannot run it: there
# the arithmetic of :func:`_e2m1_scaled` runs instead).  ``tl.inline_asm_elementwise`` with
# ``pack=4`` hands one instance four packed bytes in one 32-bit register ($4; element k of the
# four in byte k) and takes each bf16 result back as two bf16x2 registers (elements 0, 1 in
# the low / high half of the first, 2, 3 in the second): the low nibbles' values in $0, $1,
# the high nibbles' in $2, $3.  The instance is elementwise (element k of each result depends
# on byte k only), so which four elements Triton groups does not matter; being a pure unary
# op, Triton decodes in the dot operand's register layout (the packed bytes go through shared
# memory, the bf16 values straight into the MMA).
#
# Byte k of $4 holds nibbles 2k (bits 8k..8k+3, the even input) and 2k + 1 (the odd one):
# the 32-bit word is nibbles n0..n7 = lo0 hi0 lo1 hi1 lo2 hi2 lo3 hi3, each a code ``s e e m``
# (sign bit 3, magnitude index ``i = e e m`` in bits 0..2).
#
# bf16 of the 8 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: 0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0,
# every one exact: low bytes L[i] = 00 00 80 C0 00 40 80 C0, high bytes H[i] = 00 3F 3F 3F 40 40
# 40 40 (sign bit clear).  ``prmt.b32 d, a, b, c`` (generic mode) sets byte j of d to byte
# (nibble j of c) & 7 of the 8 bytes {b, a} (0..3 from a, 4..7 from b), or, when bit 3 of that
# nibble is set, to bit 7 of that byte replicated.  With an 8-byte table in (a, b) and
# magnitude indices as the nibbles of c, one prmt looks up 4 bytes:
#
#   m   = $4 & 0x77777777        the indices (sign bits cleared: no replication)
#   mh  = m >> 16                indices of n4..n7 in the 4 selector nibbles
#   xh  = $4 >> 16               raw codes of n4..n7 likewise
#   l0  = prmt(L, m)             L[i] of n0 n1 n2 n3       (L = 0xC0800000, 0xC0804000)
#   h0  = prmt(H + 0x80, m)      H[i] + 0x80 of n0..n3    (0xBFBFBF80, 0xC0C0C0C0)
#   l1, h1  likewise from mh    ... of n4..n7
#   s0  = prmt(0x01 x 8, $4)     per nibble 1 if its sign bit is clear, else 0 (the sign bit is
#   s1  = prmt(0x01 x 8, xh)     the replicate flag, and bit 7 of 0x01 is 0)
#   h0  = h0  - 128 * s0         per byte H[i] for a positive code, H[i] | 0x80 for a negative
#   h1  = h1  - 128 * s1         one (each byte >= 0x80 loses 0 or 0x80: no borrows; mad.lo, on
#                                the FMA pipe rather than the integer one the prmts load)
#   $0 = prmt(l0, h0, 0x6240)  bytes L(n0) H(n0) L(n2) H(n2): bf16x2 (lo0, lo1)
#   $2 = prmt(l0, h0, 0x7351)  bytes L(n1) H(n1) L(n3) H(n3): bf16x2 (hi0, hi1)
#   $1 = prmt(l1, h1, 0x6240)  (lo2, lo3)
#   $3 = prmt(l1, h1, 0x7351)  (hi2, hi3)
#
# 13 integer-pipe instructions and 2 IMADs for 8 values, each value exact and signed (code 8
# gives -0.0, as the reference decoding does).  The text is built by
# :func:`~deepinfer_cuda_sm100.e2m1_ptx.e2m1x8_bf16_ptx`; tests/test_moe_e2m1_ptx.py runs it
# through an emulator of each instruction over every byte in every position.
_E2M1_BF16_PTX = tl.constexpr(e2m1x8_bf16_ptx(((0, "0x6240"), (1, "0x6240"), (0, "0x7351"), (1, "0x7351"))))
_E2M1_BF16_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r")

# bf16 products, two per instruction: ``mul.rn.bf16x2`` (sm_90+) rounds the exact product once
# to nearest even, keeping subnormals; for an e2m1 value times a power of two (a ue8m0 scale,
# exact in bf16) that is bitwise the reference's fp32 product (exact) rounded to bf16.
_MUL_BF16X2_PTX = tl.constexpr("mul.rn.bf16x2 $0, $1, $2;")
_MUL_BF16X2_CONSTRAINTS = tl.constexpr("=r,r,r")


@triton.jit
def _e2m1_bf16_ptx(packed):
    """``(lo, hi)``: the exact bf16 e2m1 values of the low and the high nibbles of uint8
    ``packed`` (GPU only: inline PTX, see :data:`_E2M1_BF16_PTX`)."""
    return tl.inline_asm_elementwise(
        _E2M1_BF16_PTX, _E2M1_BF16_CONSTRAINTS, [packed],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _mul_bf16_ptx(a, b):
    """``a * b`` for bf16 ``a``, ``b``: round to nearest even, two per instruction (GPU only)."""
    return tl.inline_asm_elementwise(
        _MUL_BF16X2_PTX, _MUL_BF16X2_CONSTRAINTS, [a, b], dtype=tl.bfloat16, is_pure=True, pack=2
    )


@triton.jit
def _e2m1_scaled(codes):
    """``2**-14`` times the values of 4-bit e2m1 codes (``s e e m``, 0..15), in fp32, exact: the
    code's bits placed in an fp16 (sign -> bit 15, ``e e m`` -> bits 11..9) read as a number
    (``e e = 0``: a subnormal).  Callers fold the ``2**14`` into the group scale."""
    c = codes.to(tl.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1(codes):
    """fp32 values of 4-bit e2m1 codes (``s e e m``, 0..15), exact."""
    return _e2m1_scaled(codes) * 16384.0


@triton.jit
def _operand(v, dtype: tl.constexpr, FP32_DOT: tl.constexpr):
    """fp32 ``v`` as a ``tl.dot`` operand in ``dtype`` (interpreter: rounded, kept fp32)."""
    if FP32_DOT:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        out = round_through(v, dtype)
    else:
        out = v.to(dtype)
    return out


@triton.jit
def _dot(a, b, acc, dtype: tl.constexpr, FP32_DOT: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation (IEEE fp32 products for fp32 operands).

    Interpreter: an explicit fp32 product-sum, because its ``tl.dot`` (numpy's matmul) gives
    a row's bits that depend on the row's position in the tile (which the sorted layout changes
    with the batch); on the GPU a row's MMA result does not depend on its position.
    """
    if FP32_DOT:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        out = acc + tl.sum(prod, axis=1)
    elif dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _fp4_scales(
    s_ptr,
    s_rows,
    n_ok,
    k0,
    K: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The raw scales (float32 or ue8m0 bytes) of inputs ``k0 .. k0 + BLOCK_K`` of ``BLOCK_N`` FP4
    rows: ``[BLOCK_N, runs]``, one per run of :func:`_fp4_operands` (0 past ``K``)."""
    HALF: tl.constexpr = BLOCK_K // 2
    RUNS: tl.constexpr = HALF // HALF_GROUP if HALF_GROUP < HALF else 1
    group = k0 // (2 * HALF_GROUP) + tl.arange(0, RUNS)  # a run lies within one group
    mask = n_ok[:, None] & (group < K // (2 * HALF_GROUP))[None, :]
    return tl.load(s_ptr + s_rows[:, None] + group[None, :], mask=mask, other=0)


@triton.jit
def _fp4_packed(
    w_ptr,
    w_rows,
    n_ok,
    k0,
    K: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The packed bytes of inputs ``k0 .. k0 + BLOCK_K`` of ``BLOCK_N`` FP4 rows (``w_ptr + w_rows``,
    masked by ``n_ok``; 0 past ``K``) as ``[BLOCK_N, runs, bytes per run]``: each run of bytes
    sharing a scale (one run per scale of :func:`_fp4_scales`) contiguous."""
    HALF: tl.constexpr = BLOCK_K // 2
    RUN: tl.constexpr = HALF_GROUP if HALF_GROUP < HALF else HALF  # bytes of one scale in a step
    RUNS: tl.constexpr = HALF // RUN
    run = tl.arange(0, RUNS)
    first = k0 // 2 + run * RUN  # first byte of each run
    byte = first[:, None] + tl.arange(0, RUN)[None, :]
    mask = n_ok[:, None, None] & (byte < K // 2)[None, :, :]
    return tl.load(w_ptr + w_rows[:, None, None] + byte[None, :, :], mask=mask, other=0)


@triton.jit
def _fp4_values(
    packed, s, dtype: tl.constexpr, UE8M0: tl.constexpr, FP32_DOT: tl.constexpr, E2M1_PTX: tl.constexpr
):
    """``(lo, hi)``: the dequantised weights of the uint8 ``packed [rows, runs, bytes]`` (the low
    nibbles: even inputs; the high ones: odd inputs), each run of bytes sharing the raw scale
    ``s [rows, runs]`` (float32, or ue8m0 bytes with ``UE8M0``), in ``dtype`` (under the
    interpreter, ``FP32_DOT``: fp32 values rounded to ``dtype``).

    Each weight is ``value * scale`` (the reference's fp32 product, exact for a ue8m0 scale)
    rounded to ``dtype``.  ``E2M1_PTX`` (GPU): the values come exact in bf16 from
    :func:`_e2m1_bf16_ptx`; bf16 weights with ue8m0 scales then take one bf16x2 multiply per two
    weights (the scale, a power of two, is exact in bf16, so the single rounding of the exact
    product is the same), the others the fp32 product.  Otherwise (the interpreter) the
    arithmetic decoding of :func:`_e2m1_scaled`."""
    if E2M1_PTX:
        lo, hi = _e2m1_bf16_ptx(packed)
        if UE8M0 and dtype == tl.bfloat16:  # the byte is the bf16 exponent field
            s = (s.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)[:, :, None]
            lo = _mul_bf16_ptx(lo, s)
            hi = _mul_bf16_ptx(hi, s)
        else:
            if UE8M0:  # the byte is the fp32 exponent field
                s = (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
            s = s[:, :, None]
            lo = (lo.to(tl.float32) * s).to(dtype)
            hi = (hi.to(tl.float32) * s).to(dtype)
    else:
        if UE8M0:  # a bare power of two: the byte is the fp32 exponent field
            s = (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        s = (s * 16384.0)[:, :, None]  # exact; each product below rounds once, as value * scale
        lo = _operand(_e2m1_scaled(packed & 15) * s, dtype, FP32_DOT)
        hi = _operand(_e2m1_scaled(packed >> 4) * s, dtype, FP32_DOT)
    return lo, hi


@triton.jit
def _fp4_operands(
    w_ptr,
    w_rows,
    n_ok,
    s,
    k0,
    K: tl.constexpr,
    dtype: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """The dequantised weights of inputs ``k0 .. k0 + BLOCK_K`` of ``BLOCK_N`` FP4 rows, as two
    ``[BLOCK_K / 2, BLOCK_N]`` dot operands: the even inputs (low nibbles) and the odd ones.

    The packed bytes load as ``[BLOCK_N, groups, bytes per group]`` so that each run of bytes
    sharing a scale is contiguous; ``s`` (:func:`_fp4_scales`) holds one scale per run, which
    broadcasts over it.

    Each weight is ``value * scale`` rounded to ``dtype`` (:func:`_fp4_values`).
    """
    HALF: tl.constexpr = BLOCK_K // 2
    packed = _fp4_packed(w_ptr, w_rows, n_ok, k0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
    lo, hi = _fp4_values(packed, s, dtype, UE8M0, FP32_DOT, E2M1_PTX)
    lo = tl.reshape(lo, (BLOCK_N, HALF))
    hi = tl.reshape(hi, (BLOCK_N, HALF))
    return tl.trans(lo), tl.trans(hi)


@triton.jit
def _clamped_swiglu(g, u, limit, dtype: tl.constexpr):
    """``h = silu(min(g, L)) * clamp(u, -L, L)`` in ``dtype`` from the fp32 gate and up sums, at
    the reference's rounding points: gate and up rounded to ``dtype``, ``silu`` rounded to it,
    the product rounded once (shared by the tiled and the decode-width kernels)."""
    g = tl.minimum(round_through(g, dtype), limit)
    u = tl.minimum(tl.maximum(round_through(u, dtype), -limit), limit)
    act = round_through(g / (1.0 + tl.exp(-g)), dtype)
    return cast_to(act * u, dtype)


@triton.jit
def _rows_times_expert(
    a_ptr,
    a_rows,
    a_ok,
    K: tl.constexpr,
    w_ptr,
    w_rows0,
    w_rows1,
    s_ptr,
    s_rows0,
    s_rows1,
    n_ok0,
    n_ok1,
    dtype: tl.constexpr,
    FP4: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """Two fp32 ``[BLOCK_M, BLOCK_N]`` products: rows ``a_ptr + a_rows`` (``[BLOCK_M]`` offsets,
    masked by ``a_ok``) times the weight rows ``w_ptr + w_rows0`` and ``w_ptr + w_rows1``
    (``[BLOCK_N]`` offsets each, masked by ``n_ok0`` / ``n_ok1``) over ``K`` inputs, in K steps
    of ``BLOCK_K`` (one loop: each ``a`` tile is loaded once for both).

    FP4: ``w_rows*`` address packed bytes and ``s_rows*`` the rows' scales; the even inputs
    (low nibbles) and the odd ones (high nibbles) are two dots against the even and odd halves
    of the ``a`` tile (loaded contiguous, split in registers); the scales load a K step ahead of
    their use, so that their latency hides behind a step of work.
    """
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP4:
        kr = tl.arange(0, BLOCK_K)
        s0 = _fp4_scales(s_ptr, s_rows0, n_ok0, 0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        s1 = _fp4_scales(s_ptr, s_rows1, n_ok1, 0, K, HALF_GROUP, BLOCK_N, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            # the next step's scales, a step ahead (too small for the pipeliner's async copies)
            s0_next = _fp4_scales(s_ptr, s_rows0, n_ok0, k0 + BLOCK_K, K, HALF_GROUP, BLOCK_N, BLOCK_K)
            s1_next = _fp4_scales(s_ptr, s_rows1, n_ok1, k0 + BLOCK_K, K, HALF_GROUP, BLOCK_N, BLOCK_K)
            kk = k0 + kr
            a = tl.load(
                a_ptr + a_rows[:, None] + kk[None, :], mask=a_ok[:, None] & (kk < K)[None, :], other=0.0
            )
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))  # K is even
            lo, hi = _fp4_operands(
                w_ptr, w_rows0, n_ok0, s0, k0, K,
                dtype, UE8M0, HALF_GROUP, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
            )  # fmt: skip
            acc0 = _dot(a_even, lo, acc0, dtype, FP32_DOT)
            acc0 = _dot(a_odd, hi, acc0, dtype, FP32_DOT)
            lo, hi = _fp4_operands(
                w_ptr, w_rows1, n_ok1, s1, k0, K,
                dtype, UE8M0, HALF_GROUP, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
            )  # fmt: skip
            acc1 = _dot(a_even, lo, acc1, dtype, FP32_DOT)
            acc1 = _dot(a_odd, hi, acc1, dtype, FP32_DOT)
            s0 = s0_next
            s1 = s1_next
    else:
        kr = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + kr
            k_ok = kk < K
            a = tl.load(a_ptr + a_rows[:, None] + kk[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
            w0 = tl.load(
                w_ptr + w_rows0[None, :] + kk[:, None], mask=k_ok[:, None] & n_ok0[None, :], other=0.0
            )
            w1 = tl.load(
                w_ptr + w_rows1[None, :] + kk[:, None], mask=k_ok[:, None] & n_ok1[None, :], other=0.0
            )
            acc0 = _dot(a, w0, acc0, dtype, FP32_DOT)
            acc1 = _dot(a, w1, acc1, dtype, FP32_DOT)
    return acc0, acc1


# ---------------------------------------------------------------------------------------------
# FP8 math (opt-in: DEEPINFER_MOE_MATH=fp8)


# e2m1 to e4m3 in inline PTX: like :data:`_E2M1_BF16_PTX`, one ``prmt`` looks up 4 bytes, here
# the e4m3 codes of the 8 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: 00 30 38 3C 40 44 48 4C (every
# one exact), with the sign bit 0x80 set in the table (0xBCB8B080, 0xCCC8C4C0) and cleared
# again for the positive codes by subtracting 0x80 * s, ``s`` being 1 per byte whose sign bit is
# clear (0x01 0x01 ... looked up with the raw codes as selectors: a set selector bit 3
# replicates bit 7 of 0x01, i.e. gives 0).  The four packed bytes $2 (element k in byte k)
# give their eight codes in input order (n0 .. n7 = lo0 hi0 lo1 hi1 ...: the word's nibbles),
# which is the order of the result registers' bytes: each result element is a uint16 holding
# the byte's two e4m3 codes, the low nibble's in its low byte (elements 0, 1 in $0; 2, 3 in
# $1).  7 integer-pipe instructions and 2 IMADs for 8 values; code 8 gives 0x80 (-0).
_E2M1_E4M3_PTX = tl.constexpr(
    """{
    .reg .b32 x, m, s;
    cvt.u32.u16 x, $1;
    and.b32 m, x, 0x7777;
    prmt.b32 m, 0xBCB8B080, 0xCCC8C4C0, m;
    prmt.b32 s, 0x01010101, 0x01010101, x;
    mad.lo.u32 $0, s, -128, m;
}"""
)
_E2M1_E4M3_CONSTRAINTS = tl.constexpr("=r,h")


@triton.jit
def _e2m1_e4m3_ptx(packed):
    """uint16 ``lo | hi << 8``: the e4m3 codes of the low and the high nibbles of uint8
    ``packed`` (GPU only: inline PTX, see :data:`_E2M1_E4M3_PTX`)."""
    return tl.inline_asm_elementwise(
        _E2M1_E4M3_PTX, _E2M1_E4M3_CONSTRAINTS, [packed], dtype=tl.uint16, is_pure=True, pack=2
    )


@triton.jit
def _pow2_scale(amax):
    """``(scale, inv)``: the smallest power of two ``scale`` with ``amax / scale <= 448`` (the
    largest e4m3 value) and ``1 / scale``, both exact, from the bits of ``amax`` (fp32, >= 0,
    taken as at least ``2**-100``).  ``amax = 1.f * 2**e``: ``scale = 2**(e - 8)`` while
    ``1.f <= 1.75`` (``448 = 1.75 * 2**8``), else ``2**(e - 7)``."""
    bits = tl.maximum(amax, 7.888609052210118e-31).to(tl.uint32, bitcast=True)  # 2**-100
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.uint32)  # the scale's biased exponent
    scale = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _fp8_quantise(v, FP32_DOT: tl.constexpr):
    """``v [R, 32]`` fp32 quantised per row: ``(q [R, 32], scale [R] fp32)`` with ``v ~ q * scale``:
    ``q`` the e4m3 rounding of ``v / scale`` (exact but for that rounding: the scale is a power
    of two, :func:`_pow2_scale`), as uint8 codes (fp32 values under the interpreter, whose
    fp32 -> e4m3 conversion mis-rounds)."""
    scale, inv = _pow2_scale(tl.max(tl.abs(v), axis=1))
    v = v * inv[:, None]
    if FP32_DOT:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        q = round_e4m3(v)
    else:
        q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return q, scale


@triton.jit
def _fp8_weights(
    w_ptr,
    w_rows,
    n_ok,
    k0,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """The FP4 weights of inputs ``k0 .. k0 + 32`` of ``BLOCK_N`` rows as e4m3 in input order,
    ``[BLOCK_N, 32]`` (fp32 values under the interpreter)."""
    byte = k0 // 2 + tl.arange(0, 16)
    mask = n_ok[:, None] & (byte < K // 2)[None, :]
    packed = tl.load(w_ptr + w_rows[:, None] + byte[None, :], mask=mask, other=0)
    if E2M1_PTX:
        codes = _e2m1_e4m3_ptx(packed)  # [BLOCK_N, 16] uint16: two e4m3 codes each
        lo = (codes & 0xFF).to(tl.uint8)
        hi = (codes >> 8).to(tl.uint8)
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 32)).to(tl.float8e4nv, bitcast=True)
    else:
        w = tl.reshape(tl.join(_e2m1(packed & 15), _e2m1(packed >> 4)), (BLOCK_N, 32))
        if not FP32_DOT:  # the GPU on tiles too small for the PTX (exact: e2m1 is in e4m3)
            w = w.to(tl.float8e4nv)
    return w


@triton.jit
def _fp8_scales(s_ptr, s_rows, ok, k0, K: tl.constexpr, UE8M0: tl.constexpr, HALF_GROUP: tl.constexpr):
    """The scales of the 4 groups of 32 inputs from ``k0`` of each row, 4 ``[rows]`` fp32 tensors
    (0 past ``K``): weight scales (float32 or ue8m0 bytes, one per ``2 * HALF_GROUP`` inputs)
    or, with ``HALF_GROUP`` 16 and not ``UE8M0``, the activations' fp32 scales."""
    s0 = _fp8_scale(s_ptr, s_rows, ok, k0, K, UE8M0, HALF_GROUP)
    s1 = _fp8_scale(s_ptr, s_rows, ok, k0 + 32, K, UE8M0, HALF_GROUP)
    s2 = _fp8_scale(s_ptr, s_rows, ok, k0 + 64, K, UE8M0, HALF_GROUP)
    s3 = _fp8_scale(s_ptr, s_rows, ok, k0 + 96, K, UE8M0, HALF_GROUP)
    return s0, s1, s2, s3


@triton.jit
def _fp8_scale(s_ptr, s_rows, ok, k0, K: tl.constexpr, UE8M0: tl.constexpr, HALF_GROUP: tl.constexpr):
    s = tl.load(s_ptr + s_rows + k0 // (2 * HALF_GROUP), mask=ok & (k0 < K), other=0)
    if UE8M0:  # a bare power of two: the byte is the fp32 exponent field
        s = (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    return s.to(tl.float32)


@triton.jit
def _pick(g: tl.constexpr, s0, s1, s2, s3):
    """``(s0, s1, s2, s3)[g]``."""
    if g == 0:
        out = s0
    elif g == 1:
        out = s1
    elif g == 2:
        out = s2
    else:
        out = s3
    return out


@triton.jit
def _fp8_group(acc, w, q, sw, sx, FP32_DOT: tl.constexpr):
    """``acc + (w @ q) * sw[:, None] * sx[None, :]``: one group of 32 inputs, ``w [N, 32]`` and
    ``q [32, M]`` e4m3 (exact products, fp32 sums; the interpreter: an explicit product-sum,
    see :func:`_dot`), scaled by the weight and the activation scales."""
    if FP32_DOT:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        part = tl.sum(w[:, :, None] * q[None, :, :], axis=1)
    else:
        part = tl.dot(w, q)
    return acc + part * (sw[:, None] * sx[None, :])


@triton.jit
def _rows_times_expert_fp8(
    q_ptr,
    q_rows,
    qs_ptr,
    qs_rows,
    a_ok,
    K: tl.constexpr,
    w_ptr,
    w_rows0,
    w_rows1,
    s_ptr,
    s_rows0,
    s_rows1,
    n_ok0,
    n_ok1,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """:func:`_rows_times_expert` for FP4 weights in the ``fp8`` math, on quantised activations:
    rows ``q_ptr + q_rows`` of e4m3 codes (fp32 values under the interpreter) with one fp32
    scale per 32 inputs at ``qs_ptr + qs_rows`` (:func:`_fp8_quantise`).  K steps of ``BLOCK_K``
    inputs, each ``BLOCK_K / 32`` groups of 32 (unrolled): per group the weights' codes in e4m3
    (:func:`_fp8_weights`), one e4m3 ``tl.dot`` with the weights as the MMA's M (``BLOCK_N``
    rows) and the tile's rows as its N, scaled by the weight scale times the activation scale
    and added to an fp32 accumulator ``[BLOCK_N, BLOCK_M]``.  Returns ``[BLOCK_M, BLOCK_N]`` fp32
    twice, as :func:`_rows_times_expert`."""
    tl.static_assert(BLOCK_K == 128, "the fp8 math takes K steps of 4 groups of 32")
    acc0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    x0, x1, x2, x3 = _fp8_scales(qs_ptr, qs_rows, a_ok, 0, K, False, 16)
    a0, a1, a2, a3 = _fp8_scales(s_ptr, s_rows0, n_ok0, 0, K, UE8M0, HALF_GROUP)
    b0, b1, b2, b3 = _fp8_scales(s_ptr, s_rows1, n_ok1, 0, K, UE8M0, HALF_GROUP)
    for k0 in range(0, K, BLOCK_K):
        # the next step's scales, a step ahead (too small for the pipeliner's async copies)
        nx0, nx1, nx2, nx3 = _fp8_scales(qs_ptr, qs_rows, a_ok, k0 + BLOCK_K, K, False, 16)
        na0, na1, na2, na3 = _fp8_scales(s_ptr, s_rows0, n_ok0, k0 + BLOCK_K, K, UE8M0, HALF_GROUP)
        nb0, nb1, nb2, nb3 = _fp8_scales(s_ptr, s_rows1, n_ok1, k0 + BLOCK_K, K, UE8M0, HALF_GROUP)
        for g in tl.static_range(4):
            kg = k0 + g * 32
            kk = kg + tl.arange(0, 32)
            # [32, BLOCK_M], each row's 32 codes contiguous (K-major: an MMA operand as it lands)
            q_mask = a_ok[None, :] & (kk < K)[:, None]
            q = tl.load(q_ptr + q_rows[None, :] + kk[:, None], mask=q_mask, other=0)
            if not FP32_DOT:
                q = q.to(tl.float8e4nv, bitcast=True)
            sx = _pick(g, x0, x1, x2, x3)
            w = _fp8_weights(w_ptr, w_rows0, n_ok0, kg, K, BLOCK_N, FP32_DOT, E2M1_PTX)
            acc0 = _fp8_group(acc0, w, q, _pick(g, a0, a1, a2, a3), sx, FP32_DOT)
            w = _fp8_weights(w_ptr, w_rows1, n_ok1, kg, K, BLOCK_N, FP32_DOT, E2M1_PTX)
            acc1 = _fp8_group(acc1, w, q, _pick(g, b0, b1, b2, b3), sx, FP32_DOT)
        x0, x1, x2, x3 = nx0, nx1, nx2, nx3
        a0, a1, a2, a3 = na0, na1, na2, na3
        b0, b1, b2, b3 = nb0, nb1, nb2, nb3
    return tl.trans(acc0), tl.trans(acc1)


@triton.jit
def _quantise_kernel(
    x_ptr,
    stride_x,
    q_ptr,
    qs_ptr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FP32_DOT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Token ``program_id(0)``, groups ``program_id(1) * BLOCK_G ..`` of 32 inputs: ``x``
    quantised per group (:func:`_fp8_quantise`) into ``q [T, D]`` and ``qs [T, D / 32]``."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    col = grp[:, None] * 32 + tl.arange(0, 32)[None, :]
    ok = grp < D // 32
    v = tl.load(x_ptr + t * stride_x + col, mask=ok[:, None], other=0.0).to(tl.float32)
    q, scale = _fp8_quantise(v, FP32_DOT)
    tl.store(q_ptr + t * D + col, q, mask=ok[:, None])
    tl.store(qs_ptr + t * (D // 32) + grp, scale, mask=ok)


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _layout_kernel(
    ids_ptr,
    stride_ids,
    tile_expert_ptr,
    slot_pair_ptr,
    P,
    TOP_K,
    E,
    n_tiles,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program ``e``: count every expert's pairs (a histogram over all ``P``), place ``e``'s
    tiles after those of the lower experts, write its pairs' indices (in pair order) into its
    rows and ``-1`` into its padding rows; the last program marks the unused tiles ``E``."""
    pdl_enter(USE_PDL)
    e = tl.program_id(0)
    bins = tl.arange(0, BINS)
    lanes = tl.arange(0, BLOCK_P)
    counts = tl.zeros((BINS,), dtype=tl.int32)
    p0 = 0
    while p0 < P:  # (while loops: runtime trip counts, which the interpreter's `range` rejects)
        p = p0 + lanes
        ok = p < P
        ex = tl.load(ids_ptr + (p // TOP_K).to(tl.int64) * stride_ids + p % TOP_K, mask=ok, other=-1)
        ex = tl.where((ex >= 0) & (ex < E), ex, E).to(tl.int32)  # bin E: padding and foreign ids
        counts += tl.histogram(ex, BINS)
        p0 += BLOCK_P
    tiles = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    first_tile = tl.sum(tl.where(bins < e, tiles, 0))
    my_tiles = tl.sum(tl.where(bins == e, tiles, 0))
    my_count = tl.sum(tl.where(bins == e, counts, 0))
    base = first_tile.to(tl.int64) * BLOCK_M
    seen = tl.zeros((), dtype=tl.int32)
    p0 = 0
    while p0 < P:
        p = p0 + lanes
        ok = p < P
        ex = tl.load(ids_ptr + (p // TOP_K).to(tl.int64) * stride_ids + p % TOP_K, mask=ok, other=-1)
        match = ok & (ex == e)
        rank = seen + tl.cumsum(match.to(tl.int32), 0) - 1
        tl.store(slot_pair_ptr + base + rank, p, mask=match)
        seen += tl.sum(match.to(tl.int32))
        p0 += BLOCK_P
    rows = tl.arange(0, BLOCK_M)
    pad = my_count + rows  # the rest of e's last tile
    tl.store(slot_pair_ptr + base + pad, -1, mask=pad < my_tiles * BLOCK_M)
    i0 = 0
    while i0 < my_tiles:
        i = i0 + rows
        tl.store(tile_expert_ptr + first_tile + i, e, mask=i < my_tiles)
        i0 += BLOCK_M
    if e == E - 1:
        i0 = tl.sum(tiles)  # the used tiles
        while i0 < n_tiles:
            i = i0 + lanes
            tl.store(tile_expert_ptr + i, E, mask=i < n_tiles)
            i0 += BLOCK_P


@triton.jit
def _gate_up_kernel(
    x_ptr,
    stride_x,
    tile_expert_ptr,
    slot_pair_ptr,
    w_ptr,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    h_ptr,
    xq_ptr,
    xs_ptr,
    hs_ptr,
    E,
    TOP_K,
    limit,
    D: tl.constexpr,
    I: tl.constexpr,
    FP4: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
    FP8_MATH: tl.constexpr,
    H_FP8: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Tile ``program_id(0)``, intermediate columns ``program_id(1) * BLOCK_N``: ``h`` rows.

    ``FP8_MATH``: FP4 weights in the ``fp8`` math (:func:`_rows_times_expert_fp8`) on ``x``
    quantised (``xq``, ``xs``: :func:`_quantise_kernel`).  ``H_FP8`` (the down GEMM in the
    ``fp8`` math): ``h`` (rounded to ``x``'s dtype) is stored quantised per 32 columns, codes in
    ``h_ptr`` and scales in ``hs_ptr`` (``BLOCK_N`` a multiple of 32)."""
    pdl_enter(USE_PDL)
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < E:  # tiles past the used ones read nothing
        dtype = x_ptr.dtype.element_ty
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        e = expert.to(tl.int64)
        slots = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(slot_pair_ptr + slots)
        row_ok = pair >= 0
        a_rows = (tl.maximum(pair, 0) // TOP_K).to(tl.int64) * stride_x
        n_ok = cols < I
        w_gate = e * stride_we + cols.to(tl.int64) * stride_wn
        w_up = w_gate + I * stride_wn
        s_gate = e * stride_se + cols.to(tl.int64) * stride_sn
        s_up = s_gate + I * stride_sn
        if FP8_MATH:
            token = (tl.maximum(pair, 0) // TOP_K).to(tl.int64)
            g, u = _rows_times_expert_fp8(
                xq_ptr, token * D, xs_ptr, token * (D // 32), row_ok, D,
                w_ptr, w_gate, w_up, s_ptr, s_gate, s_up, n_ok, n_ok,
                UE8M0, HALF_GROUP, BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
            )  # fmt: skip
        else:
            g, u = _rows_times_expert(
                x_ptr, a_rows, row_ok, D, w_ptr, w_gate, w_up, s_ptr, s_gate, s_up, n_ok, n_ok,
                dtype, FP4, UE8M0, HALF_GROUP, BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
            )  # fmt: skip
        h = _clamped_swiglu(g, u, limit, dtype)
        out = h_ptr + slots[:, None] * I + cols[None, :]
        if H_FP8:
            tl.static_assert(BLOCK_N % 32 == 0, "h is quantised per 32 columns")
            GROUPS: tl.constexpr = BLOCK_N // 32
            q, scale = _fp8_quantise(tl.reshape(h.to(tl.float32), (BLOCK_M * GROUPS, 32)), FP32_DOT)
            tl.store(out, tl.reshape(q, (BLOCK_M, BLOCK_N)), mask=row_ok[:, None] & n_ok[None, :])
            grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
            s_out = hs_ptr + slots[:, None] * (I // 32) + grp[None, :]
            s_mask = row_ok[:, None] & (grp < I // 32)[None, :]
            tl.store(s_out, tl.reshape(scale, (BLOCK_M, GROUPS)), mask=s_mask)
        else:
            tl.store(out, h, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    tile_expert_ptr,
    slot_pair_ptr,
    w_ptr,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    rw_ptr,
    stride_rw,
    y_ptr,
    hs_ptr,
    E,
    TOP_K,
    D: tl.constexpr,
    I: tl.constexpr,
    BI_ROUNDING: tl.constexpr,
    FP4: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
    FP8_MATH: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Tile ``program_id(0)``, model columns ``program_id(1) * 2 * BLOCK_N`` (two blocks of
    ``BLOCK_N``): the weighted contributions (``FP8_MATH``: the ``fp8`` math on ``h`` quantised
    by :func:`_gate_up_kernel`, codes in ``h_ptr``, scales in ``hs_ptr``)."""
    pdl_enter(USE_PDL)
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < E:
        dtype = y_ptr.dtype.element_ty
        cols = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
        e = expert.to(tl.int64)
        slots = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(slot_pair_ptr + slots)
        row_ok = pair >= 0
        cols1 = cols + BLOCK_N
        w_rows = e * stride_we + cols.to(tl.int64) * stride_wn
        s_rows = e * stride_se + cols.to(tl.int64) * stride_sn
        if FP8_MATH:
            acc0, acc1 = _rows_times_expert_fp8(
                h_ptr, slots * I, hs_ptr, slots * (I // 32), row_ok, I,
                w_ptr, w_rows, w_rows + BLOCK_N * stride_wn,
                s_ptr, s_rows, s_rows + BLOCK_N * stride_sn, cols < D, cols1 < D,
                UE8M0, HALF_GROUP, BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
            )  # fmt: skip
        else:
            acc0, acc1 = _rows_times_expert(
                h_ptr, slots * I, row_ok, I, w_ptr, w_rows, w_rows + BLOCK_N * stride_wn,
                s_ptr, s_rows, s_rows + BLOCK_N * stride_sn, cols < D, cols1 < D,
                dtype, FP4, UE8M0, HALF_GROUP, BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
            )  # fmt: skip
        p = tl.maximum(pair, 0)
        rw = tl.load(rw_ptr + (p // TOP_K).to(tl.int64) * stride_rw + p % TOP_K, mask=row_ok, other=0.0)
        rw = rw.to(tl.float32)
        if not BI_ROUNDING:  # the reference's default paths scale by the weight in x's dtype
            rw = round_through(rw, dtype)
        rw = rw[:, None]
        out = y_ptr + p.to(tl.int64)[:, None] * D
        mask = row_ok[:, None] & (cols < D)[None, :]
        tl.store(out + cols[None, :], cast_to(round_through(acc0, dtype) * rw, dtype), mask=mask)
        mask = row_ok[:, None] & (cols1 < D)[None, :]
        tl.store(out + cols1[None, :], cast_to(round_through(acc1, dtype) * rw, dtype), mask=mask)


@triton.jit
def _combine_kernel(
    y_ptr,
    ids_ptr,
    stride_ids,
    sh_ptr,
    stride_sh,
    out_ptr,
    stride_out,
    rows_ptr,
    rw_ptr,
    stride_rw,
    D,
    E,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BI_ROUNDING: tl.constexpr,
    SHARED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Token ``program_id(0)``: its contributions in ascending (expert, slot) order, in fp32
    (``BI_ROUNDING``: rounded to the output dtype before each new expert's contributions);
    with ``SHARED`` the routed sum is rounded to the output dtype and the shared expert's row
    added (the reference's ``routed + shared``).  ``WEIGHTED``: the rows are unweighted expert
    outputs at rows ``rows[t * k + j]``; each is scaled here by its routing weight rounded to
    the output dtype and rounded once (the down kernel's epilogue, moved here)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = cols < D
    dtype = out_ptr.dtype.element_ty
    slot = tl.arange(0, K_PAD)
    ex = tl.load(ids_ptr + t * stride_ids + slot, mask=slot < TOP_K, other=-1).to(tl.int64)
    done = 1 << 62  # above every real key
    key = tl.where((slot < TOP_K) & (ex >= 0) & (ex < E), ex * K_PAD + slot, done)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    prev = -1
    for _ in tl.static_range(TOP_K):
        m = tl.min(key, axis=0)
        if BI_ROUNDING:
            expert = m // K_PAD
            acc = tl.where((prev >= 0) & (expert != prev) & (m < done), round_through(acc, dtype), acc)
            prev = expert
        row = t * TOP_K + m % K_PAD
        if WEIGHTED:
            rw = tl.load(rw_ptr + t * stride_rw + m % K_PAD, mask=m < done, other=0.0).to(tl.float32)
            row = tl.load(rows_ptr + row, mask=m < done, other=0).to(tl.int64)
            v = tl.load(y_ptr + row * D + cols, mask=d_ok & (m < done), other=0.0).to(tl.float32)
            acc += cast_to(v * round_through(rw, dtype), dtype).to(tl.float32)
        else:
            acc += tl.load(y_ptr + row * D + cols, mask=d_ok & (m < done), other=0.0).to(tl.float32)
        key = tl.where(key == m, done, key)
    if SHARED:
        acc = round_through(acc, dtype)
        acc += tl.load(sh_ptr + t * stride_sh + cols, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, cast_to(acc, dtype), mask=d_ok)


# ---------------------------------------------------------------------------------------------
# host side


def _weight_args(w) -> tuple[torch.Tensor, int, int, torch.Tensor, int, int, bool, bool, int]:
    """``(data, stride_e, stride_n, scale, stride_se, stride_sn, fp4, ue8m0, half_group)``."""
    if isinstance(w, torch.Tensor):
        if w.stride(-1) != 1:
            w = w.contiguous()
        return w, w.stride(0), w.stride(1), w, 0, 0, False, False, 1
    data, scale = w.data, w.scale
    ue8m0 = scale.dtype != torch.float32
    if ue8m0:
        scale = scale.view(torch.uint8)
    return (
        data,
        data.stride(0),
        data.stride(1),
        scale,
        scale.stride(0),
        scale.stride(1),
        True,
        ue8m0,
        w.block[1] // 2,
    )


def sorted_layout(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile_expert [n_tiles] int32, slot_pair [n_tiles * block_m] int32)``: the pairs
    ``t * k + j`` sorted by expert into whole tiles of one expert each (see the module
    docstring), computed on the device by one launch of :func:`_layout_kernel`."""
    t, k = ids.shape
    pairs = t * k
    n_tiles = tile_count(pairs, num_experts, block_m)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=ids.device)
    slot_pair = torch.empty(n_tiles * block_m, dtype=torch.int32, device=ids.device)
    if n_tiles:
        _layout_kernel[(num_experts,)](
            ids, ids.stride(0), tile_expert, slot_pair, pairs, k, num_experts, n_tiles,
            BLOCK_M=block_m, BINS=pow2(num_experts + 1), BLOCK_P=_LAYOUT_BLOCK_P, **pdl_args(),
        )  # fmt: skip
    return tile_expert, slot_pair


def empty_call(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int, shared: torch.Tensor | None
) -> tuple[torch.Tensor, bool]:
    """The output tensor of a ``moe_experts`` call, and whether it is already its result: no
    token (empty), or no slot or expert (the shared expert's output, else zeros)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0] == 0:
        return out, True
    if ids.shape[1] == 0 or num_experts == 0:
        return (out.zero_() if shared is None else out.copy_(shared)), True
    return out, False


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up,
    down,
    limit: float,
    shared: torch.Tensor | None = None,
    launch: TileLaunch = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """``moe_experts`` (the core contract) on Triton kernels: FP4 or plain expert stacks.

    ``x`` ``[T, D]``; ``ids`` / ``weights`` ``[T, k]``; ``gate_up`` ``[E, 2I, D]`` and ``down``
    ``[E, D, I]``, each a tensor in ``x``'s dtype or an FP4 ``QuantizedTensor``; ``shared``
    (optional ``[T, D]``, x's dtype): the shared expert's output, added in the combine kernel;
    ``launch``: overrides of the launches' sizes (:class:`TileLaunch`, for the benchmark's
    sweeps).  Returns ``[T, D]`` in ``x``'s dtype.  See the module docstring for the launches
    and the rounding.
    """
    from deepinfer_core.ops.modes import batch_invariant_enabled

    t, d = x.shape
    top_k = ids.shape[1]
    num_experts = gate_up.shape[0]
    out, done = empty_call(x, ids, num_experts, shared)
    if done:
        return out
    x, ids, weights = (v if v.stride(1) == 1 else v.contiguous() for v in (x, ids, weights))
    bi = batch_invariant_enabled()
    y = torch.empty(t * top_k, d, dtype=x.dtype, device=x.device)
    bm = launch.block_m or tile_rows(t * top_k, num_experts, bi)
    expert_rows(x, ids, weights, gate_up, down, limit, y, bm, bi, launch)
    return combine_pairs(y, ids, num_experts, bi, shared, out)


def expert_rows(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up,
    down,
    limit: float,
    y: torch.Tensor,
    bm: int,
    bi: bool = False,
    launch: TileLaunch = DEFAULT_LAUNCH,
) -> None:
    """Launches 1 to 3 (and the FP8 math's quantisation) of :func:`moe_experts`: row ``t * k + j``
    of ``y`` ``[T * k, D]`` (``x``'s dtype) becomes pair ``(t, j)``'s weighted expert output, for
    the pairs whose expert lies in ``[0, E)`` of these stacks (the other rows are left as they
    are), in tiles of ``bm`` rows (``bi``: the batch-invariant mode's rounding; ``launch``: the
    other sizes' overrides, its ``block_m`` ignored here).  ``x``, ``ids``
    and ``weights`` unit-strided along their last dim, at least one token and one slot."""
    t, d = x.shape
    top_k = ids.shape[1]
    num_experts, inter = gate_up.shape[0], down.shape[2]
    fp8 = moe_math() == "fp8"
    gu_fp8, dn_fp8 = fp8 and fp8_math_applies(gate_up), fp8 and fp8_math_applies(down)
    tile_expert, slot_pair = sorted_layout(ids, num_experts, bm)
    n_tiles = tile_expert.shape[0]
    warps = launch.warps or (4 if bm <= 32 else 8)
    stages = 1 if INTERPRETED else (launch.stages or 3)

    gu, gu_se, gu_sn, gu_s, gu_sse, gu_ssn, gu_fp4, gu_ue8m0, gu_half = _weight_args(gate_up)
    q_dtype = torch.float32 if INTERPRETED else torch.uint8  # e4m3 codes (interpreter: values)
    xq, xs = x, x  # (unused)
    if gu_fp8:
        xq = torch.empty(t, d, dtype=q_dtype, device=x.device)
        xs = torch.empty(t, d // FP8_GROUP, dtype=torch.float32, device=x.device)
        _quantise_kernel[(t, cdiv(d // FP8_GROUP, _QUANT_BLOCK_G))](
            x, x.stride(0), xq, xs, D=d, BLOCK_G=_QUANT_BLOCK_G, FP32_DOT=_FP32_DOT, num_warps=4, **pdl_args()
        )
    if dn_fp8:  # h quantised: codes and one scale per 32 columns
        h = torch.empty(n_tiles * bm, inter, dtype=q_dtype, device=x.device)
        hs = torch.empty(n_tiles * bm, inter // FP8_GROUP, dtype=torch.float32, device=x.device)
    else:
        h = torch.empty(n_tiles * bm, inter, dtype=x.dtype, device=x.device)
        hs = h  # (unused)
    bn = max(16, min(launch.block_n or BLOCK_N, pow2(inter)))
    dense_k = launch.block_k or DENSE_BLOCK_K
    bk = FP4_BLOCK_K if gu_fp8 else max(32, min(FP4_BLOCK_K if gu_fp4 else dense_k, pow2(d)))
    _gate_up_kernel[(n_tiles, cdiv(inter, bn))](
        x, x.stride(0), tile_expert, slot_pair, gu, gu_se, gu_sn, gu_s, gu_sse, gu_ssn, h, xq, xs, hs,
        num_experts, top_k, float(limit), D=d, I=inter,
        FP4=gu_fp4, UE8M0=gu_ue8m0, HALF_GROUP=gu_half, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        FP32_DOT=_FP32_DOT, FP8_MATH=gu_fp8,
        E2M1_PTX=(fp8_e2m1_ptx(bn, warps) if gu_fp8 else e2m1_ptx(bn, bk, warps)) and gu_fp4,
        H_FP8=dn_fp8, num_warps=warps, num_stages=stages, **pdl_args(),
    )  # fmt: skip

    dn, dn_se, dn_sn, dn_s, dn_sse, dn_ssn, dn_fp4, dn_ue8m0, dn_half = _weight_args(down)
    bn = max(16, min(launch.block_n or BLOCK_N, pow2(d)))
    bk = FP4_BLOCK_K if dn_fp8 else max(32, min(FP4_BLOCK_K if dn_fp4 else dense_k, pow2(inter)))
    _down_kernel[(n_tiles, cdiv(d, 2 * bn))](
        h, tile_expert, slot_pair, dn, dn_se, dn_sn, dn_s, dn_sse, dn_ssn, weights, weights.stride(0), y, hs,
        num_experts, top_k, D=d, I=inter, BI_ROUNDING=bi,
        FP4=dn_fp4, UE8M0=dn_ue8m0, HALF_GROUP=dn_half, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        FP32_DOT=_FP32_DOT, FP8_MATH=dn_fp8,
        E2M1_PTX=(fp8_e2m1_ptx(bn, warps) if dn_fp8 else e2m1_ptx(bn, bk, warps)) and dn_fp4,
        num_warps=warps, num_stages=stages, **pdl_args(),
    )  # fmt: skip


def combine_pairs(
    y: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    bi_rounding: bool,
    shared: torch.Tensor | None,
    out: torch.Tensor,
    rows: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch 4 (:func:`_combine_kernel`): ``out[t]`` = the sum of the pair contributions
    ``y[t * k + j]`` (``[T * k, D]``) in ascending expert order (``bi_rounding``: the batch-
    invariant mode's rounding), plus ``shared[t]`` when given; ``ids`` ``[T, k]`` unit-strided
    along the slots, ``out`` ``[T, D]`` unit-strided along D.  With ``rows`` (``[T * k]``) and
    ``weights`` (``[T, k]``, unit-strided along the slots) ``y`` holds unweighted expert outputs:
    pair ``(t, j)``'s is row ``rows[t * k + j]``, scaled here by its weight rounded to ``out``'s
    dtype, the product rounded once (the down kernel's default-mode epilogue).  Returns ``out``."""
    t, top_k = ids.shape
    d = out.shape[1]
    bd = min(COMBINE_BLOCK_D, pow2(d))
    if shared is not None and shared.stride(1) != 1:
        shared = shared.contiguous()
    sh, sh_stride = (shared, shared.stride(0)) if shared is not None else (out, 0)
    weighted = rows is not None
    if weighted and (weights is None or bi_rounding):
        raise ValueError("combine_pairs: rows need their weights, outside the batch-invariant rounding")
    rw, rw_stride = (weights, weights.stride(0)) if weighted else (ids, 0)
    _combine_kernel[(t, cdiv(d, bd))](
        y, ids, ids.stride(0), sh, sh_stride, out, out.stride(0), rows if weighted else ids, rw, rw_stride,
        d, num_experts, TOP_K=top_k, K_PAD=pow2(top_k), BI_ROUNDING=bi_rounding, SHARED=shared is not None,
        WEIGHTED=weighted, BLOCK_D=bd, num_warps=4, **pdl_args(),
    )  # fmt: skip
    return out
