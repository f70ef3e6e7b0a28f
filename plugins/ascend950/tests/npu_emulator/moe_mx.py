"""EMULATOR of torch_npu's MX quantisation: ``npu_dynamic_mx_quant`` and the dtype constants
(``torch_npu.float8_e8m0fnu``, ``torch_npu.float4_e2m1fn_x2``) the MX operators take, plus the
MX decoding the matmul emulators share.  Tests only; see the package docstring.

Documents followed (facts, not code):

* Q1 ``quant/dynamic_mx_quant/docs/aclnnDynamicMxQuant.md`` (and ``aclnnDynamicMxQuantV2.md``) in
  cann/ops-nn: per ``blocksize`` values along ``axis``, ``shared_exp = floor(log2(amax)) - emax``
  (``emax`` 8 for FLOAT8_E4M3FN, 2 for FLOAT4_E2M1), ``mxscale = 2**shared_exp``,
  ``P = cast(V / mxscale, round_mode)`` (``scale_alg=0``);
* Q2 ``op_plugin/config/op_plugin_functions.yaml`` and ``op_plugin/python/meta/_meta_registrations.py``
  in Ascend/op-plugin: the torch_npu signature (keyword-only ``axis=-1, round_mode="rint",
  dst_type, block_size=32, scale_alg=0``), the ``mxscale`` shape (the input's shape with the
  ``axis`` dim replaced by ``ceil(ceil(n / block_size) / 2)`` and a trailing dim of 2, uint8), FP4
  outputs packed two per byte in uint8 (last dim halved), and the torch_npu dtype numbers
  (290 hifloat8, 291/292 float8 e5m2/e4m3fn, 293 float8_e8m0fnu, 296 float4_e2m1fn_x2);
* the OCP Microscaling Formats (MX) v1.0 specification: E8M0 bytes ``b`` mean ``2**(b - 127)``
  (255 = NaN), elements whose scaled value exceeds the element format's largest normal are
  clamped to it.
"""

from __future__ import annotations

import torch

HIFLOAT8 = 290
FLOAT8_E5M2 = 291
FLOAT8_E4M3FN = 292
FLOAT8_E8M0FNU = 293
FLOAT4_E2M1FN_X2 = 296
"""torch_npu dtype numbers (Q2); the emulator exposes them as ``torch_npu.<name>``."""

FP8_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def is_fp8_e4m3(dtype) -> bool:
    """``dtype`` names FLOAT8_E4M3FN (a torch dtype or a torch_npu number)."""
    return dtype in (torch.float8_e4m3fn, FLOAT8_E4M3FN, 24)


def is_fp4(dtype) -> bool:
    """``dtype`` names FLOAT4_E2M1 (torch_npu's ``float4_e2m1fn_x2``)."""
    return dtype == FLOAT4_E2M1FN_X2 or dtype == getattr(torch, "float4_e2m1fn_x2", object())


def is_e8m0(dtype) -> bool:
    """``dtype`` names FLOAT8_E8M0 (a torch dtype or a torch_npu number)."""
    return dtype in (torch.float8_e8m0fnu, FLOAT8_E8M0FNU)


def e8m0_values(byte: torch.Tensor) -> torch.Tensor:
    """float32 ``2**(b - 127)`` of E8M0 bytes (uint8 or ``float8_e8m0fnu`` storage); NaN for 255."""
    b = byte.view(torch.uint8).to(torch.int32)
    return torch.where(b == 255, float("nan"), torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - 127))


def _floor_log2(amax: torch.Tensor) -> torch.Tensor:
    """``floor(log2(amax))`` for finite ``amax > 0``, exactly (from the float32 exponent)."""
    _, exp = torch.frexp(amax)
    return exp.to(torch.int32) - 1


def encode_e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (sign bit 3) of float32 ``v``: round to nearest, ties to the even code
    (``round_mode="rint"``), magnitudes beyond 6 clamped to 6 (OCP MX)."""
    mags = torch.tensor(E2M1_MAGNITUDES)
    a = v.abs().clamp(max=6.0)
    lo = (torch.searchsorted(mags, a.contiguous(), right=True) - 1).clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    d_lo, d_hi = a - mags[lo], mags[hi] - a
    up = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0) & (hi != lo))
    code = torch.where(up, hi, lo).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit e2m1 codes (sign bit 3)."""
    mags = torch.tensor(E2M1_MAGNITUDES)
    c = codes.to(torch.int64)
    mag = mags[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def unpack_fp4_last(packed: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2n]`` of bytes ``[..., n]``: the even element in the low nibble.

    Which nibble holds the first element is not stated in the torch_npu pages; the low one is
    PyTorch's ``float4_e2m1fn_x2`` convention and what the DeepSeek checkpoints use."""
    u8 = packed.contiguous().view(torch.uint8)
    return torch.stack([u8 & 0xF, u8 >> 4], dim=-1).reshape(*u8.shape[:-1], 2 * u8.shape[-1])


def npu_dynamic_mx_quant(
    input: torch.Tensor,
    *,
    axis: int = -1,
    round_mode: str = "rint",
    dst_type=FLOAT4_E2M1FN_X2,
    block_size: int = 32,
    scale_alg: int | None = 0,
    dst_type_max: float = 0.0,
    max_low_bound: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EMULATOR: ``(y, mxscale)``, the MX quantisation of ``input`` along ``axis``.

    Only what the ascend950 backend calls is emulated: ``axis`` the last dim, ``round_mode``
    ``"rint"``, ``scale_alg`` 0 (or ``None``), ``dst_type`` FLOAT8_E4M3FN (``y`` of that dtype)
    or FLOAT4_E2M1 (``y`` uint8, two codes a byte, last dim halved).  ``mxscale`` is uint8 E8M0
    ``[..., ceil(ceil(n / block_size) / 2), 2]`` (Q2): block ``j`` at ``[..., j // 2, j % 2]``.

    Where the documents are silent: the scale of an all-zero block (``log2(0)``) — here the
    smallest E8M0 byte (0, ``2**-127``), which quantises the zeros to zeros; the byte written in
    the unused half of the last pair when the block count is odd — here 0; out-of-range scale
    exponents (not reachable from float16/bfloat16/float32 finite inputs with emax >= 2 except
    below ``2**-127``) — clamped to [0, 254]; and overflow of ``V / mxscale`` past the element
    format's largest value (``amax`` up to ``2**(e+1)`` while e4m3 stops at ``1.75 * 2**8``) —
    clamped to the largest normal per the OCP MX specification (Q1 only says "cast").
    """
    if axis not in (-1, input.dim() - 1):
        raise NotImplementedError("EMULATOR: npu_dynamic_mx_quant is emulated for the last axis only")
    if round_mode != "rint" or scale_alg not in (0, None) or dst_type_max or max_low_bound:
        raise NotImplementedError("EMULATOR: only round_mode='rint', scale_alg=0, default maxima")
    if input.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError(f"npu_dynamic_mx_quant: input dtype {input.dtype} is not float16/bfloat16/float32")
    if block_size % 32 or not 0 < block_size <= 1024:
        raise RuntimeError("npu_dynamic_mx_quant: block_size must be a multiple of 32 in (0, 1024]")
    if is_fp8_e4m3(dst_type):
        emax, fp4 = 8, False
    elif is_fp4(dst_type):
        emax, fp4 = 2, True
        if input.shape[-1] % 2:
            raise RuntimeError("npu_dynamic_mx_quant: FP4 output needs an even last dim")
    else:
        raise NotImplementedError(f"EMULATOR: dst_type {dst_type} (only float8_e4m3fn, float4_e2m1fn_x2)")
    n = input.shape[-1]
    blocks = -(-n // block_size)
    pairs = -(-blocks // 2)
    x = torch.nn.functional.pad(input.float(), (0, blocks * block_size - n))
    x = x.reshape(*input.shape[:-1], blocks, block_size)
    amax = x.abs().amax(dim=-1)
    exp = torch.where(amax > 0, _floor_log2(amax) - emax, torch.full_like(amax, -127, dtype=torch.int32))
    byte = (exp + 127).clamp(0, 254)
    scaled = x / e8m0_values(byte.to(torch.uint8)).unsqueeze(-1)
    scaled = scaled.reshape(*input.shape[:-1], blocks * block_size)[..., :n]
    if fp4:
        codes = encode_e2m1_rne(scaled)
        y = codes[..., 0::2] | (codes[..., 1::2] << 4)
    else:
        y = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.zeros(*input.shape[:-1], 2 * pairs, dtype=torch.uint8)
    scale[..., :blocks] = byte.to(torch.uint8)
    return y, scale.view(*input.shape[:-1], pairs, 2)


def mx_group_scales(scale: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-32-group float32 scales ``[..., groups]`` of paired E8M0 scales ``[..., pairs, 2]``."""
    s = e8m0_values(scale.contiguous().view(torch.uint8))
    return s.reshape(*s.shape[:-2], -1)[..., :groups]


def expand_groups(values: torch.Tensor, group_scales: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``values [..., k] * group_scales [..., ceil(k/group)]`` repeated over each group."""
    k = values.shape[-1]
    return values * group_scales.repeat_interleave(group, dim=-1)[..., :k]


FUNCTIONS = {
    "npu_dynamic_mx_quant": npu_dynamic_mx_quant,
    # dtype constants torch_npu exposes (Q2's numbers); not functions, installed the same way
    "hifloat8": HIFLOAT8,
    "float8_e8m0fnu": FLOAT8_E8M0FNU,
    "float4_e2m1fn_x2": FLOAT4_E2M1FN_X2,
}
