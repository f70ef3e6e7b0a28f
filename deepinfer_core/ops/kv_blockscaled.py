"""Block-scaled packed KV-cache rows: the byte formats of DeepSeek-V4.1's release.

A :class:`BlockScaledKVPool` holds ``N`` rows of ``D`` values; each row is split into blocks of
``B`` consecutive values with one scale byte per block:

=============  =======  ==================  ====  ====================  ==========================
format         element  scale byte          B     bytes per row         release (V4.1)
=============  =======  ==================  ====  ====================  ==========================
``fp8_ue8m0``  e4m3     UE8M0 (``2**e``)    32    ``D + D/32``          window records, D=512: 528
``fp4_e4m3``   e2m1     e4m3                16    ``D/2 + D/16``        compressed entries: 288
``fp4_ue8m0``  e2m1     UE8M0 (``2**e``)    32    ``D/2 + D/32``        indexer keys, D=128: 68
=============  =======  ==================  ====  ====================  ==========================

Row layout: the element bytes first -- ``D`` ``float8_e4m3fn`` bytes, or ``D/2`` bytes of e2m1
codes, two per byte, the even value in the low nibble (as the FP4 weights,
:func:`~deepinfer_core.weights.quant.pack_fp4`) -- then the ``D/B`` scale bytes in block order;
no padding.  An e2m1 code is ``s e e m`` (sign bit 3); a UE8M0 byte ``b`` means ``2**(b-127)``.
``D`` must be a multiple of ``B``.

**Quantisation** is exactly DeepSeek-V4.1's ``kv_qdq`` op (the reference that defines these
numerics, :func:`deepinfer_core.models.deepseek_v41.ops.kv_qdq`, which computes its scales and
e2m1 rounding with this module's :func:`block_scales` and :func:`e2m1_codes`), so a stored row
dequantises to bit for bit what ``kv_qdq`` returns for it (``tests/models/v41`` checks both
against an independent oracle).  All in fp32, per block with ``amax = max |x|``:

- ``fp8_ue8m0``: ``s = 2**ceil(log2(max(amax, 1e-4) * (1/448)))`` (the product rounded to
  fp32, the power of two read from its bits), stored as the UE8M0 byte; element
  ``e4m3(clamp(x / s, ±448))`` (torch's cast: round to nearest even).
- ``fp4_ue8m0``: ``s = 2**ceil(log2(max(amax, 6 * 2**-126) * (1/6)))``; element
  ``e2m1(clamp(x / s, ±6))``.
- ``fp4_e4m3``: ``s = e4m3(min(max(amax, 6 * 2**-9) / 6, 448))`` (torch's cast of the clamped
  value: the same on every device), stored as its e4m3 byte;
  element as ``fp4_ue8m0`` (``x / s`` rounded to fp32 first: ``s`` is not a power of two).

``e2m1`` rounds to the nearest of ``0, .5, 1, 1.5, 2, 3, 4, 6`` with ties to the even code, and
keeps the sign bit (``-0.0`` and values that round to zero stay negative zeros).
**Dequantisation**: ``float(element) * s`` in fp32, then cast to the requested dtype.  Inputs
must be finite.

Storing ``kv_qdq``'s *output* again is not always a no-op: ``fp8_ue8m0`` and ``fp4_ue8m0`` are
idempotent (a re-derived scale can only halve, and both grids are closed under doubling), but
``fp4_e4m3`` is not for blocks whose scale is an e4m3 subnormal (``amax`` below ``6 * 2**-6``):
a scale rounded up to an even code can be re-derived smaller and clamp the largest value.  So
values go to a packed pool unquantised; the pool quantises them once.

Everything is shapes-only (no host synchronisation, no host-built tensors): capturable in a
device graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer_core.weights.quant import unpack_fp4

from .kv_format import FP8_MAX, PackedKVPool

BlockFormat = Literal["fp8_ue8m0", "fp4_e4m3", "fp4_ue8m0"]
"""The block-scaled formats, named as ``kv_qdq`` names them."""


@dataclass(frozen=True)
class BlockFormatInfo:
    """One block-scaled format: ``bits`` per element (8: e4m3, 4: e2m1), the scale byte's kind
    (``ue8m0``: a power of two; else e4m3) and the values per scale ``block``."""

    bits: int
    ue8m0: bool
    block: int

    def row_bytes(self, dim: int) -> int:
        """Bytes of a packed row of ``dim`` values (a multiple of :attr:`block`)."""
        return dim * self.bits // 8 + dim // self.block


BLOCK_FORMATS: dict[str, BlockFormatInfo] = {
    "fp8_ue8m0": BlockFormatInfo(bits=8, ue8m0=True, block=32),
    "fp4_e4m3": BlockFormatInfo(bits=4, ue8m0=False, block=16),
    "fp4_ue8m0": BlockFormatInfo(bits=4, ue8m0=True, block=32),
}
"""Every block-scaled format by name."""

FP4_MAX = 6.0
"""Largest e2m1 magnitude."""


def block_format(fmt: str) -> BlockFormatInfo:
    """The format ``fmt`` (a :data:`BlockFormat` name); ``ValueError`` for another name."""
    try:
        return BLOCK_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown block-scaled KV format {fmt!r}; known: {sorted(BLOCK_FORMATS)}") from None


def block_row_bytes(fmt: str, dim: int) -> int:
    """Bytes of a packed row of ``dim`` values in format ``fmt`` (528 for ``fp8_ue8m0`` at 512,
    288 for ``fp4_e4m3`` at 512, 68 for ``fp4_ue8m0`` at 128); ``ValueError`` unless ``dim`` is a
    positive multiple of the format's block."""
    info = block_format(fmt)
    if dim < 1 or dim % info.block:
        raise ValueError(f"{fmt}: a row of {dim} values is not a whole number of {info.block}-value blocks")
    return info.row_bytes(dim)


def packs(fmt: str, dim: int) -> bool:
    """Whether rows of ``dim`` values can be stored in format ``fmt`` (whole blocks)."""
    return dim >= 1 and dim % block_format(fmt).block == 0


def _ue8m0_byte(p: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(p)) + 127`` as ``int32`` for float32 ``p > 0``, from the IEEE bits (the UE8M0
    byte of ``2**ceil(log2(p))``; a power of two stays itself)."""
    bits = p.contiguous().view(torch.int32)
    return (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(max=255)


def _ue8m0_value(byte: torch.Tensor) -> torch.Tensor:
    """``2.0**(byte - 127)`` (float32) of UE8M0 bytes in ``[1, 255]``, exactly (built from the bits;
    byte 0, only in a never-written row, reads as 0 and 255 as infinity)."""
    return (byte.to(torch.int32) << 23).view(torch.float32)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """The 4-bit e2m1 codes (``uint8``) of float32 ``y`` (already within ``[-6, 6]``): the nearest
    e2m1 value, ties to the even code, the sign bit of ``y`` kept."""
    mag = y.abs()
    code = (mag > 0.25).to(torch.uint8)  # a tie goes to the even code: down at .25, 1.25, 2.5, 5
    code += mag >= 0.75
    code += mag > 1.25
    code += mag >= 1.75
    code += mag > 2.5
    code += mag >= 3.5
    code += mag > 5.0
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The float32 values of 4-bit e2m1 ``codes`` (sign bit 3): magnitude code ``c`` is ``c / 2``
    up to 4, then 3, 4, 6 (elementwise arithmetic only: capturable)."""
    c = (codes & 7).float()
    mag = torch.where(c > 4, c - 2 + (c == 7).float(), c * 0.5)
    return torch.where((codes & 8) != 0, -mag, mag)


def block_scales(amax: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of format ``fmt``, from its float32 ``amax = max |x|``: the scale (float32) and
    the byte that stores it (``uint8``: UE8M0 exponent or e4m3) — the module docstring's rule."""
    info = BLOCK_FORMATS[fmt]
    if info.ue8m0:
        qmax = FP8_MAX if info.bits == 8 else FP4_MAX
        floor = 1e-4 if info.bits == 8 else FP4_MAX * 2.0**-126
        byte = _ue8m0_byte(amax.clamp_min(floor) * (1.0 / qmax))
        return _ue8m0_value(byte), byte.to(torch.uint8)
    # clamped first: torch's cast saturates on the CPU but gives NaN past 448 on CUDA
    s8 = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
    return s8.float(), s8.view(torch.uint8)


def quantize_block_rows(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """``values`` ``[..., D]`` (any float dtype) packed as ``uint8 [..., row_bytes]`` in ``fmt``."""
    dim = values.shape[-1]
    row = block_row_bytes(fmt, dim)
    info = BLOCK_FORMATS[fmt]
    lead = values.shape[:-1]
    nb = dim // info.block
    blocks = values.float().reshape(-1, nb, info.block)
    m = blocks.shape[0]
    scale, scale_bytes = block_scales(blocks.abs().amax(dim=-1, keepdim=True), fmt)
    y = blocks / scale
    if info.bits == 8:
        elements = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).view(m, dim)
    else:
        codes = e2m1_codes(y.clamp(-FP4_MAX, FP4_MAX)).view(m, dim)
        elements = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return torch.cat([elements, scale_bytes.view(m, nb)], dim=1).view(*lead, row)


def dequantize_block_rows(
    packed: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed rows ``uint8 [..., row_bytes]`` of ``fmt`` back to ``[..., dim]`` values in ``dtype``."""
    row = block_row_bytes(fmt, dim)
    if packed.shape[-1] != row:
        raise ValueError(f"packed {fmt} rows have {packed.shape[-1]} bytes, expected {row} for dim={dim}")
    info = BLOCK_FORMATS[fmt]
    lead = packed.shape[:-1]
    p = packed.reshape(-1, row)
    m, nb = p.shape[0], dim // info.block
    element_bytes = row - nb
    raw = p[:, element_bytes:]
    scale = _ue8m0_value(raw) if info.ue8m0 else raw.view(torch.float8_e4m3fn).float()
    elements = p[:, :element_bytes]
    values = elements.view(torch.float8_e4m3fn).float() if info.bits == 8 else unpack_fp4(elements)
    out = values.view(m, nb, info.block) * scale.view(m, nb, 1)
    return out.view(*lead, dim).to(dtype)


@dataclass(frozen=True, eq=False)
class BlockScaledKVPool(PackedKVPool):
    """A KV pool of ``N`` rows of ``dim`` values in a block-scaled format (module docstring).

    Ops take it wherever they take a :class:`~deepinfer_core.ops.kv_format.PackedKVPool`
    (``cache_write``'s ``cache``; ``sparse_attention``'s ``kv_pools``; ``indexer_topk``'s and
    ``deepseek_v41.candidate_blocks``' ``key_pool``).

    Attributes:
        data: ``uint8 [N, row_bytes]`` the packed rows.
        dim: logical row width ``D`` (a multiple of the format's block).
        fmt: the format (:data:`BlockFormat`).
    """

    data: torch.Tensor
    dim: int
    fmt: str

    def __post_init__(self) -> None:
        self._check_data(block_row_bytes(self.fmt, self.dim), f"{self.fmt} rows of {self.dim} values")

    @classmethod
    def zeros(cls, rows: int, dim: int, fmt: str, device: torch.device | str = "cpu") -> BlockScaledKVPool:
        """A pool of ``rows`` zero rows (every value dequantises to 0)."""
        data = torch.zeros(rows, block_row_bytes(fmt, dim), dtype=torch.uint8, device=device)
        return cls(data, dim, fmt)

    @classmethod
    def from_values(cls, values: torch.Tensor, fmt: str) -> BlockScaledKVPool:
        """A pool holding ``values`` ``[N, D]``, quantised."""
        return cls(quantize_block_rows(values, fmt), values.shape[-1], fmt)

    @property
    def block(self) -> int:
        """Values per scale byte."""
        return BLOCK_FORMATS[self.fmt].block

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[M, dim]`` as packed rows ``uint8 [M, row_bytes]`` of this pool's format."""
        if values.shape[-1] != self.dim:
            raise ValueError(f"values have {values.shape[-1]} channels, the pool holds {self.dim}")
        return quantize_block_rows(values, self.fmt)

    def unpack(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed rows ``uint8 [..., row_bytes]`` as ``[..., dim]`` values in ``dtype``."""
        return dequantize_block_rows(packed, self.fmt, self.dim, dtype)

    def __repr__(self) -> str:
        rows, dev = self.data.shape[0], self.device
        return f"BlockScaledKVPool(rows={rows}, dim={self.dim}, fmt={self.fmt!r}, device={dev})"
