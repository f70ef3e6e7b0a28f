"""Quantised weight formats of DeepSeek-V4 checkpoints: dequantise at load, quantise for writing.

* **FP8 block** (non-expert linears): ``float8_e4m3fn`` data ``[..., out, in]`` with one scale
  per ``block[0] x block[1]`` tile (default 128x128), scale shape
  ``[..., ceil(out/b0), ceil(in/b1)]``; tiles at the right/bottom edges are partial.
  ``w = data * scale`` (the scale is what HF calls ``weight_scale_inv``).
* **FP4 e2m1** (routed experts): two 4-bit codes per byte, stored as ``uint8``/``int8``
  ``[..., out, in/2]``; the low nibble is the even element, the high nibble the odd one
  (as transformers' ``Fp8Dequantize._unpack_fp4``).  Code bits ``s e e m``: the sign is bit 3,
  magnitudes ``[0, .5, 1, 1.5, 2, 3, 4, 6]``.  One scale per ``group`` (32) inputs:
  scale shape ``[..., out, in/group]``.

Scales are ``float32`` or ``float8_e8m0fnu`` (ue8m0: a bare power of two).

The reference backend computes in bf16/fp32, so the loader dequantises.  A backend that runs
FP8/FP4 kernels will want the raw data: :class:`QuantizedTensor` is that hand-off object, and
``load_checkpoint(..., keep_quantized=True)`` is the reserved switch for returning it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer_core.errors import WeightLoadError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
UE8M0_DTYPE = torch.float8_e8m0fnu
FP4_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
DEFAULT_FP8_BLOCK = (128, 128)
DEFAULT_FP4_GROUP = 32
FP4_STORAGE_DTYPES = (torch.uint8, torch.int8)


def _e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 values of the e2m1 codes, indexed by code (sign bit 3)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


@dataclass
class QuantizedTensor:
    """A weight kept in its checkpoint format (for backends with FP8/FP4 kernels).

    ``fmt`` is ``"fp8"`` (``data`` e4m3 ``[..., out, in]``, ``block = (b_out, b_in)``) or
    ``"fp4"`` (``data`` packed ``uint8`` ``[..., out, in/2]``, ``block = (1, group)``).
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full-precision weight in ``dtype``."""
        if self.fmt == "fp8":
            return dequant_fp8(self.data, self.scale, self.block, dtype)
        return dequant_fp4(self.data, self.scale, self.block[1], dtype)


def _expand_scale(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Repeat a per-tile scale over its tile and crop the partial edge tiles to ``shape``."""
    s = scale.float()
    s = s.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return s[..., : shape[-2], : shape[-1]]


def _check_scale_shape(scale: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(scale.shape) != expected:
        raise WeightLoadError(f"{what}: scale has shape {tuple(scale.shape)}, expected {expected}")


def dequant_fp8(
    data: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = DEFAULT_FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise block-scaled FP8 e4m3 ``data`` ``[..., out, in]`` to ``dtype``.

    ``scale`` is ``[..., ceil(out/block[0]), ceil(in/block[1])]`` (float32 or ue8m0).
    """
    rows, cols = data.shape[-2:]
    expected = (*data.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    _check_scale_shape(scale, expected, f"FP8 block {block}")
    return (data.float() * _expand_scale(scale, block, data.shape)).to(dtype)


def _scale_from_amax(amax: torch.Tensor, qmax: float, scale_dtype: str) -> torch.Tensor:
    """Per-block scale mapping ``amax`` onto the format's largest value (zeros -> scale 1)."""
    s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if scale_dtype == "ue8m0":
        # Round up to a power of two so that amax / s still fits the format's range.
        s = torch.exp2(torch.ceil(torch.log2(s)))
        return s.to(UE8M0_DTYPE)
    if scale_dtype != "fp32":
        raise ValueError(f"scale_dtype must be 'fp32' or 'ue8m0', got {scale_dtype!r}")
    return s.float()


def quant_fp8(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK, scale_dtype: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` ``[..., out, in]`` to FP8 e4m3 with per-block scales; returns ``(data, scale)``.

    Each element's error is at most ``2**-4 * |w| + 2**-10 * s`` where ``s`` is its block's scale
    (``amax / 448``, or the next power of two for ue8m0): e4m3 keeps 3 mantissa bits (half-ulp
    relative error ``2**-4``) down to its smallest normal ``2**-6``, below which the absolute
    step is ``2**-9`` (half: ``2**-10``) in scaled units.
    """
    rows, cols = w.shape[-2:]
    br, bc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    x = w.float()
    padded = torch.nn.functional.pad(x.abs(), (0, bc * block[1] - cols, 0, br * block[0] - rows))
    tiles = padded.reshape(*w.shape[:-2], br, block[0], bc, block[1])
    scale = _scale_from_amax(tiles.amax(dim=(-3, -1)), FP8_MAX, scale_dtype)
    q = (x / _expand_scale(scale, block, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack e2m1 codes (two per byte, low nibble first) to float32 ``[..., 2 * n]``."""
    u8 = packed.contiguous().view(torch.uint8)
    codes = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).reshape(*u8.shape[:-1], 2 * u8.shape[-1])
    return _e2m1_table(packed.device)[codes.long()]


def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Round each value to the nearest e2m1 number; returns its 4-bit code as ``uint8``.

    Values beyond ±6 saturate; ties go to the smaller magnitude.
    """
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=values.device)
    v = values.float()
    idx = (v.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)
    sign = torch.signbit(v).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., 2 * n]`` into bytes ``[..., n]`` (even element in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def dequant_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group: int = DEFAULT_FP4_GROUP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise packed e2m1 ``[..., out, in/2]`` with per-``group`` scales ``[..., out, in/group]``."""
    values = unpack_fp4(packed)
    cols = values.shape[-1]
    if cols % group:
        raise WeightLoadError(f"FP4 weight with {cols} inputs is not a multiple of the scale group {group}")
    _check_scale_shape(scale, (*values.shape[:-1], cols // group), f"FP4 group {group}")
    return (values * scale.float().repeat_interleave(group, dim=-1)).to(dtype)


def quant_fp4(
    w: torch.Tensor, group: int = DEFAULT_FP4_GROUP, scale_dtype: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w`` ``[..., out, in]`` to packed e2m1 with per-``group`` scales -> ``(packed, scale)``.

    Each element's error is at most ``max(|w| / 4, s / 4)`` for its group scale ``s``: the gap
    between neighbouring e2m1 magnitudes is at most a quarter of the larger one above 1 and
    0.5 below it.
    """
    cols = w.shape[-1]
    if cols % group:
        raise ValueError(f"FP4 quantisation needs inputs ({cols}) to be a multiple of the group ({group})")
    x = w.float()
    grouped = x.reshape(*w.shape[:-1], cols // group, group)
    scale = _scale_from_amax(grouped.abs().amax(dim=-1), FP4_MAX, scale_dtype)
    codes = encode_e2m1(x / scale.float().repeat_interleave(group, dim=-1))
    return pack_fp4(codes), scale
