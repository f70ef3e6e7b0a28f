"""The MoE kernels' inline-PTX e2m1 decoding, run on the CPU through an emulator of each instruction.

The PTX path (:data:`~deepinfer_cuda_sm100.kernels.moe._E2M1_BF16_PTX` and
:data:`~deepinfer_cuda_sm100.kernels.moe._MUL_BF16X2_PTX`) runs only on a GPU: Triton's
interpreter cannot execute inline assembly.  Here the very text the kernels hand to
``tl.inline_asm_elementwise`` is parsed and executed by :func:`run_ptx`, a small emulator of the
instructions it uses (``and``/``or``/``xor``/``not``, ``shl``/``shr``, ``prmt`` in its generic
mode, ``lop3``, ``mad.lo``/``mul.lo``, ``mov``, ``mul.rn.bf16x2``, ``mul.rn.f32``,
``cvt.rn.bf16x2.f32``: each as the PTX ISA defines it), with the
operands packed as Triton's lowering packs them (:func:`asm_elementwise`; as Triton 3.6's LLVM IR
for a two-result bf16 ``pack=4`` asm shows: one ``<4 x i8>`` input, element k in byte k, and a
struct of four ``<2 x bfloat>``, the first two the first result's).  The checks:

- the decoding of every byte, in each of the four byte positions of the 32-bit input register,
  and of random words, against the reference ``unpack_fp4``, bitwise (the sign of zero too);
- the bf16 / ue8m0 path (decode, scale bits ``e << 7``, bf16x2 multiply) over every byte and every
  ue8m0 exponent 0..255, bitwise against the kernels' arithmetic path (e2m1 value times the fp32
  scale ``e << 23``, rounded to bf16) and, for the exponents torch decodes the same way (1..254),
  against ``QuantizedTensor.dequantize(torch.bfloat16)``;
- the fp32-scale path (decoded bf16 value widened to fp32, times the fp32 scale, rounded to the
  operand dtype) against ``dequant_fp4`` in bf16, fp16 and fp32 for representative scales
  (random, powers of two, subnormal, near the fp32 maximum, negative);
- the emulator itself: ``prmt`` selection and sign replication, the ``lop3`` truth table, and
  the bf16 multiply against torch where torch's fp32 product is exact.

The same PTX is assembled for sm_90 / sm_100 by ``test_moe_kernel.py``'s compile test, and run on
the GPU by its GPU tests.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

from deepinfer_cuda_sm100.kernels import moe  # noqa: E402

from deepinfer_core.weights.quant import QuantizedTensor, dequant_fp4, unpack_fp4  # noqa: E402

M32 = np.uint64(0xFFFFFFFF)


# ---------------------------------------------------------------------------------------------
# the emulator


def _bf16_to_f64(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint) -> their float64 values (exact; subnormals, inf and NaN kept)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def _f64_to_bf16(x: np.ndarray) -> np.ndarray:
    """float64 values -> bf16 bit patterns (uint32), rounded once to nearest even, with
    subnormals (quantum ``2**-133``) and overflow to infinity, as IEEE ``roundTiesToEven``."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty(x.shape, dtype=np.float32)
    finite = np.isfinite(x) & (x != 0)
    _, ex = np.frexp(x[finite])  # |x| = m * 2**ex, m in [0.5, 1): leading bit 2**(ex - 1)
    quantum = np.ldexp(1.0, np.maximum(ex - 1, -126) - 7)  # 8 significant bits, down to 2**-133
    rounded = np.round(x[finite] / quantum) * quantum  # exact scaling; np.round ties to even
    rounded = np.where(np.abs(rounded) >= 2.0**128, np.copysign(np.inf, rounded), rounded)
    out[finite] = rounded.astype(np.float32)  # exact: a bf16 value (or inf)
    out[~finite] = x[~finite].astype(np.float32)  # zeros (signed), inf, NaN
    bits = out.view(np.uint32) >> np.uint32(16)
    return np.where(np.isnan(out), np.uint32(0x7FFF), bits).astype(np.uint32)


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``prmt.b32 d, a, b, c`` (generic mode): byte j of d is byte ``c[4j+2:4j]`` of ``{b, a}``
    (0..3 from a, 4..7 from b), or, when bit ``4j+3`` of c is set, that byte's bit 7 replicated."""
    src = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    d = np.zeros(a.shape, dtype=np.uint64)
    for j in range(4):
        nib = (c.astype(np.uint64) >> np.uint64(4 * j)) & np.uint64(0xF)
        byte = (src >> (np.uint64(8) * (nib & np.uint64(7)))) & np.uint64(0xFF)
        sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        byte = np.where(nib & np.uint64(8), sign, byte)
        d |= byte << np.uint64(8 * j)
    return d.astype(np.uint32)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """``lop3.b32 d, a, b, c, immLut``: bit i of d is bit ``4 a_i + 2 b_i + c_i`` of immLut (so
    that immLut = F(0xF0, 0xCC, 0xAA) for the function F)."""
    d = np.zeros(a.shape, dtype=np.uint32)
    for k in range(8):
        if not (lut >> k) & 1:
            continue
        ma = a if k & 4 else ~a
        mb = b if k & 2 else ~b
        mc = c if k & 1 else ~c
        d |= ma & mb & mc
    return d


def _mul_bf16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``mul.rn.bf16x2 d, a, b``: each 16-bit half, the exact product rounded to nearest even."""
    halves = []
    for shift in (0, 16):
        x = _bf16_to_f64((a >> np.uint32(shift)) & np.uint32(0xFFFF))
        y = _bf16_to_f64((b >> np.uint32(shift)) & np.uint32(0xFFFF))
        with np.errstate(invalid="ignore"):  # 0 * inf: NaN, as on the GPU
            halves.append(_f64_to_bf16(x * y))  # the product of two bf16 values is exact in float64
    return (halves[0] | (halves[1] << np.uint32(16))).astype(np.uint32)


def _immediate(token: str) -> int:
    if token.lower().startswith("0f"):  # an .f32 immediate: its 8 hex digits are the bits
        return int(token[2:], 16)
    value = int(token, 0)
    return value & 0xFFFFFFFF  # a negative .u32 / .s32 immediate: its two's complement bits


def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def _mul_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``mul.rn.f32`` (no ``.ftz``): IEEE single-precision product, subnormals kept, a NaN
    result canonical (``0x7FFFFFFF``)."""
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        d = (_f32(a) * _f32(b)).astype(np.float32)
    return np.where(np.isnan(d), np.uint32(0x7FFFFFFF), d.view(np.uint32)).astype(np.uint32)


def _cvt_bf16x2_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``cvt.rn.bf16x2.f32 d, a, b``: ``a`` rounded to bf16 in the high half, ``b`` in the low."""
    hi = _f64_to_bf16(_f32(a).astype(np.float64))
    lo = _f64_to_bf16(_f32(b).astype(np.float64))
    return ((hi << np.uint32(16)) | lo).astype(np.uint32)


def run_ptx(asm: str, operands: list[np.ndarray | None]) -> list[np.ndarray | None]:
    """Execute the PTX text ``asm`` on uint32 lanes: ``operands[k]`` is ``$k`` (``None`` for an
    output, filled in); temporaries declared with ``.reg .b32`` start undefined.  Raises for an
    instruction, modifier or operand it does not model."""
    regs: dict[str, np.ndarray] = {}
    ops = list(operands)
    body = re.sub(r"//[^\n]*", "", asm).replace("{", " ").replace("}", " ")
    lanes = next(o.shape for o in ops if o is not None)

    def read(tok: str) -> np.ndarray:
        if tok.startswith("$"):
            value = ops[int(tok[1:])]
            if value is None:
                raise ValueError(f"{tok} is read before it is written")
            return value
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)|0[fF][0-9a-fA-F]{8}", tok):
            return np.full(lanes, _immediate(tok), dtype=np.uint32)
        if tok not in regs:
            raise ValueError(f"register {tok} is read before it is written")
        return regs[tok]

    def write(tok: str, value: np.ndarray) -> None:
        value = np.asarray(value).astype(np.uint32)
        if tok.startswith("$"):
            ops[int(tok[1:])] = value
        else:
            regs[tok] = value

    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        opcode, _, rest = stmt.partition(" ")
        args = [t.strip() for t in rest.split(",")]
        d, src = args[0], args[1:]
        if opcode in ("and.b32", "or.b32", "xor.b32"):
            a, b = (read(t) for t in src)
            write(d, {"and.b32": a & b, "or.b32": a | b, "xor.b32": a ^ b}[opcode])
        elif opcode == "not.b32":
            write(d, ~read(src[0]))
        elif opcode == "mov.b32":
            write(d, read(src[0]))
        elif opcode in ("shl.b32", "shr.u32", "shr.b32"):
            a, n = read(src[0]), read(src[1]).astype(np.uint64)
            wide = a.astype(np.uint64)
            out = (wide << np.minimum(n, 32)) & M32 if opcode == "shl.b32" else wide >> np.minimum(n, 32)
            write(d, out)
        elif opcode == "shr.s32":
            a, n = read(src[0]).view(np.int32).astype(np.int64), read(src[1]).astype(np.int64)
            write(d, (a >> np.minimum(n, 31)).astype(np.int64) & 0xFFFFFFFF)
        elif opcode == "prmt.b32":
            write(d, _prmt(*(read(t) for t in src)))
        elif opcode == "lop3.b32":
            a, b, c = (read(t) for t in src[:3])
            write(d, _lop3(a, b, c, _immediate(src[3])))
        elif opcode in ("mad.lo.u32", "mad.lo.s32"):
            a, b, c = (read(t).astype(np.uint64) for t in src)
            write(d, (a * b + c) & M32)
        elif opcode in ("mul.lo.u32", "mul.lo.s32"):
            a, b = (read(t).astype(np.uint64) for t in src)
            write(d, (a * b) & M32)
        elif opcode == "mul.rn.bf16x2":
            write(d, _mul_bf16x2(*(read(t) for t in src)))
        elif opcode == "mul.rn.f32":
            write(d, _mul_f32(*(read(t) for t in src)))
        elif opcode == "cvt.rn.bf16x2.f32":
            write(d, _cvt_bf16x2_f32(*(read(t) for t in src)))
        else:
            raise NotImplementedError(f"the emulator does not model {opcode!r}")
    return ops


def _bits(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() * 8


def asm_elementwise(
    asm: str, constraints: str, args: list[torch.Tensor], out_dtypes: list[torch.dtype], pack: int
) -> list[torch.Tensor]:
    """``tl.inline_asm_elementwise`` on 1-D CPU tensors, packed as Triton lowers it: per instance
    ``pack`` consecutive elements; an operand narrower than 32 bits packs ``32 / bits`` of them
    per register (element 0 in the low bits); the operands are numbered results first (each
    result's registers in element order), then the arguments."""
    n = args[0].numel()
    assert n % pack == 0 and all(a.numel() == n for a in args)
    kinds = constraints.split(",")

    def to_regs(t: torch.Tensor) -> list[np.ndarray]:
        bits = _bits(t.dtype)
        per = min(32 // bits, pack) if bits < 32 else 1
        u = t.contiguous().view({8: torch.uint8, 16: torch.int16, 32: torch.int32}[bits])
        v = u.numpy().astype(np.int64) & ((1 << bits) - 1)
        v = v.reshape(n // pack, pack // per, per).astype(np.uint64)
        word = sum(v[..., k] << np.uint64(bits * k) for k in range(per))
        return [word[:, r].astype(np.uint32) for r in range(pack // per)]

    def from_regs(regs: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
        bits = _bits(dtype)
        per = min(32 // bits, pack) if bits < 32 else 1
        mask = np.uint32((1 << bits) - 1) if bits < 32 else np.uint32(0xFFFFFFFF)
        cols = [(r >> np.uint32(bits * k)) & mask for r in regs for k in range(per)]
        flat = np.stack(cols, axis=1).reshape(n)
        store = {8: np.uint8, 16: np.int16, 32: np.int32}[bits]
        return torch.from_numpy(flat.astype(np.uint32).astype(np.int64).astype(store)).view(dtype)

    outs_per = [pack // (min(32 // _bits(d), pack) if _bits(d) < 32 else 1) for d in out_dtypes]
    ins = [r for a in args for r in to_regs(a)]
    assert len(kinds) == sum(outs_per) + len(ins), "the constraints do not match the operands"
    assert all(k == "=r" for k in kinds[: sum(outs_per)]) and all(k == "r" for k in kinds[sum(outs_per) :])
    ops = run_ptx(asm, [None] * sum(outs_per) + ins)
    results, at = [], 0
    for dtype, count in zip(out_dtypes, outs_per, strict=True):
        regs = ops[at : at + count]
        assert all(r is not None for r in regs), "an output register is never written"
        results.append(from_regs(regs, dtype))
        at += count
    return results


# ---------------------------------------------------------------------------------------------
# the kernels' PTX


def decode(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~deepinfer_cuda_sm100.kernels.moe._e2m1_bf16_ptx` on uint8 ``packed``."""
    lo, hi = asm_elementwise(
        moe._E2M1_BF16_PTX.value,
        moe._E2M1_BF16_CONSTRAINTS.value,
        [packed],
        [torch.bfloat16, torch.bfloat16],
        pack=4,
    )
    return lo, hi


def mul_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`~deepinfer_cuda_sm100.kernels.moe._mul_bf16_ptx` on bf16 ``a``, ``b``."""
    (out,) = asm_elementwise(
        moe._MUL_BF16X2_PTX.value, moe._MUL_BF16X2_CONSTRAINTS.value, [a, b], [torch.bfloat16], pack=2
    )
    return out


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def _every_byte_in_every_lane() -> torch.Tensor:
    """1024 bytes: 256 instances of 4, each byte value once at each of the 4 positions."""
    i = torch.arange(256)
    return torch.stack([(i + 64 * p) % 256 for p in range(4)], dim=1).reshape(-1).to(torch.uint8)


def _want(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = unpack_fp4(packed.view(1, -1))[0]  # float32, low nibble first
    return values[0::2], values[1::2]


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = _bits16(got), _bits16(want)
    bad = (g != w).nonzero().reshape(-1)
    assert bad.numel() == 0, f"{what}: {bad.numel()} differ, first at {bad[0].item()}: " + (
        f"0x{g[bad[0]].item():04x} != 0x{w[bad[0]].item():04x}"
    )


# ---------------------------------------------------------------------------------------------
# tests


def test_decode_every_byte_in_every_position():
    packed = _every_byte_in_every_lane()
    lo, hi = decode(packed)
    want_lo, want_hi = _want(packed)
    _assert_bits_equal(lo, want_lo.to(torch.bfloat16), "low nibbles")
    _assert_bits_equal(hi, want_hi.to(torch.bfloat16), "high nibbles")
    assert _bits16(decode(torch.tensor([0x80, 0x08, 0x88, 0x00], dtype=torch.uint8))[0]).tolist() == [
        0x0000,
        0x8000,
        0x8000,
        0x0000,
    ], "code 8 is -0.0, as the reference decodes it"


def test_decode_random_words():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (4 * 4096,), generator=g, dtype=torch.int32).to(torch.uint8)
    lo, hi = decode(packed)
    want_lo, want_hi = _want(packed)
    _assert_bits_equal(lo, want_lo.to(torch.bfloat16), "low nibbles")
    _assert_bits_equal(hi, want_hi.to(torch.bfloat16), "high nibbles")


def _ue8m0_path(packed: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' bf16 / ue8m0 path: decode, scale bits ``e << 7`` as bf16, bf16x2 multiply."""
    lo, hi = decode(packed)
    s = (e.to(torch.int32) << 7).to(torch.int16).view(torch.bfloat16)
    return mul_bf16(lo, s), mul_bf16(hi, s)


def _arithmetic_path(packed: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The interpreter path's values: fp32 e2m1 value times the fp32 scale, rounded to ``dtype``
    (torch's casts round to nearest even, like the GPU's)."""
    want_lo, want_hi = _want(packed)
    return (want_lo * s).to(dtype), (want_hi * s).to(dtype)


def test_bf16_ue8m0_path_every_byte_every_exponent():
    packed = _every_byte_in_every_lane().repeat(256)
    e = torch.arange(256).repeat_interleave(1024).to(torch.uint8)  # 4 bytes of an instance share e
    lo, hi = _ue8m0_path(packed, e)
    s = (e.to(torch.int64) << 23).to(torch.int32).view(torch.float32)  # the kernels' fp32 scale
    arithmetic = _arithmetic_path(packed, s, torch.bfloat16)
    for got, want, what in zip((lo, hi), arithmetic, ("low", "high"), strict=True):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), f"{what}: NaN where the arithmetic path has none"
        _assert_bits_equal(got[~nan], want[~nan], f"{what} nibbles vs the arithmetic path")
    # the reference (torch decodes e = 0 as 2**-127 and 255 as NaN; the kernels take 0 and inf)
    inner = (e > 0) & (e < 255)
    rows = packed[inner].view(-1, 32)
    scales = e[inner].view(-1, 32)[:, ::32].contiguous().view(torch.float8_e8m0fnu)
    want = QuantizedTensor(rows, scales, "fp4", (1, 64)).dequantize(torch.bfloat16).reshape(-1)
    _assert_bits_equal(lo[inner], want[0::2], "low nibbles vs dequantize")
    _assert_bits_equal(hi[inner], want[1::2], "high nibbles vs dequantize")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp32_scale_path(dtype):
    """Decoded bf16 values widened to fp32 (exact), times the fp32 scale, rounded to ``dtype``:
    ``dequant_fp4`` bitwise, for random scales and edge cases."""
    g = torch.Generator().manual_seed(1)
    special = torch.tensor(
        [1.0, 2.0**-20, 2.0**-126, 2.0**-140, 1e-45, 3.0e38, 1.7e38, -0.37, 2.0**15, 65504.0 / 6, 1.0 / 3]
    )
    scales = torch.cat([special, torch.randn(117, generator=g) * 0.05, torch.rand(128, generator=g) * 1e-3])
    packed = _every_byte_in_every_lane().view(1, -1).expand(scales.numel(), -1).contiguous()  # [256, 1024]
    scale = scales.view(-1, 1).expand(-1, 64).contiguous()  # one per 32 inputs (16 bytes)
    lo, hi = decode(packed.reshape(-1))
    s = scale.repeat_interleave(16, dim=1).reshape(-1)
    got_lo, got_hi = ((v.float() * s).to(dtype) for v in (lo, hi))
    want = dequant_fp4(packed, scale, 32, dtype).reshape(-1)
    int_view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    for got, w, what in ((got_lo, want[0::2], "low"), (got_hi, want[1::2], "high")):
        bad = (got.view(int_view) != w.view(int_view)).sum().item()
        assert bad == 0, f"{what} nibbles, {dtype}: {bad} differ in their bits"


def test_emulator_prmt_and_lop3():
    a = np.array([0x44332211, 0x80FF7F01], dtype=np.uint32)
    b = np.array([0x88776655, 0x00000000], dtype=np.uint32)
    sel = lambda v: np.full(2, v, dtype=np.uint32)  # noqa: E731
    assert _prmt(a, b, sel(0x3210)).tolist() == a.tolist()
    assert _prmt(a, b, sel(0x7654)).tolist() == b.tolist()
    assert _prmt(a, b, sel(0x0123))[0] == 0x11223344
    assert _prmt(a, b, sel(0x4567))[0] == 0x55667788
    # sign replication: byte 1 (0x7F) -> 0x00, byte 2 (0xFF) -> 0xFF, byte 3 (0x80) -> 0xFF
    assert _prmt(a, b, sel(0xBA98))[1] == 0xFFFF0000
    x, y, z = (np.array([v], dtype=np.uint32) for v in (0xF0F0F0F0, 0xCCCCCCCC, 0xAAAAAAAA))
    for lut in (0x00, 0xF0, 0xCC, 0xAA, 0x80, 0xFE, 0xF2, 0x96, 0xE8):
        assert _lop3(x, y, z, lut)[0] == lut * 0x01010101, hex(lut)  # immLut = F(0xF0, 0xCC, 0xAA)


def test_emulator_bf16_multiply():
    g = torch.Generator().manual_seed(2)
    a = (torch.randn(20000, generator=g) * 4).to(torch.bfloat16)
    b = torch.exp2(torch.randint(-60, 60, (20000,), generator=g).float()) * torch.randn(20000, generator=g)
    b = b.to(torch.bfloat16)
    want = (a.float() * b.float()).to(torch.bfloat16)  # the fp32 product of two bf16 values is exact here
    _assert_bits_equal(mul_bf16(a, b), want, "bf16 products")
    tiny = torch.tensor([2.0**-126, 2.0**-127, 3 * 2.0**-133, 2.0**127, 2.0**127, 0.0], dtype=torch.bfloat16)
    by = torch.tensor([0.5, 1.5, 0.5, 2.0, -3.0, -1.0], dtype=torch.bfloat16)
    got = mul_bf16(tiny, by)
    assert got.float().tolist()[:3] == [2.0**-127, 1.5 * 2.0**-127, 2.0**-132], "subnormal products"
    assert got.float().tolist()[3:5] == [float("inf"), float("-inf")], "overflow"
    assert _bits16(got)[5].item() == 0x8000, "0 * -1 is -0"


def test_emulator_f32_multiply_bf16x2_convert_and_integer_ops():
    """``mul.rn.f32`` against numpy's IEEE single products (subnormals kept), ``cvt.rn.bf16x2.f32``
    against torch's rounding cast (a in the high half), ``mul.lo``, ``shr.s32`` and ``0f``
    immediates by their definitions."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(5000, generator=g) * torch.exp2(torch.randint(-70, 70, (5000,), generator=g).float())
    b = torch.randn(5000, generator=g) * torch.exp2(torch.randint(-70, 70, (5000,), generator=g).float())
    bits = lambda t: t.view(torch.int32).numpy().view(np.uint32)  # noqa: E731
    (prod,) = run_ptx("mul.rn.f32 $0, $1, $2;", [None, bits(a), bits(b)])[:1]
    assert (prod == bits(a * b)).all(), "fp32 products (torch's CPU product rounds the same way)"
    tiny = np.array([0x00800000], dtype=np.uint32)  # 2**-126 times 0.5: a subnormal, kept
    assert run_ptx("mul.rn.f32 $0, $1, 0f3F000000;", [None, tiny])[0][0] == 0x00400000
    (packed,) = run_ptx("cvt.rn.bf16x2.f32 $0, $1, $2;", [None, bits(a), bits(b)])[:1]
    hi = torch.from_numpy((packed >> 16).astype(np.int64))
    lo = torch.from_numpy((packed & 0xFFFF).astype(np.int64))
    assert torch.equal(hi, _bits16(a.to(torch.bfloat16)).long()) and torch.equal(
        lo, _bits16(b.to(torch.bfloat16)).long()
    )
    x = np.array([0x80000000, 0x7FFFFFFF, 0x00000005], dtype=np.uint32)
    assert run_ptx("shr.s32 $0, $1, 31;", [None, x])[0].tolist() == [0xFFFFFFFF, 0, 0]
    assert run_ptx("mul.lo.u32 $0, $1, 0x00800080;", [None, x])[0].tolist() == [0, 0xFF7FFF80, 0x02800280]


def test_emulator_rejects_what_it_does_not_model():
    with pytest.raises(NotImplementedError):
        run_ptx("fma.rn.f32 $0, $1, $2, $1;", [None, np.zeros(1, np.uint32), np.zeros(1, np.uint32)])
    with pytest.raises(ValueError):
        run_ptx("and.b32 $0, t, 1;", [None, np.zeros(1, np.uint32)])
