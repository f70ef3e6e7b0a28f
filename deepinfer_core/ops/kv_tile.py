"""Packed FP8 KV rows with one float32 scale per tile of 128 values: the key layout of Ascend's
``npu_kv_quant_sparse_flash_attention`` (``key_quant_mode=2`` per-tile quantisation,
``quant_scale_repo_mode=1``: the scales stored in the row, ``tile_size=128``,
``rope_head_dim=64``), kv format ``"fp8_tile128"``.

A :class:`TileFp8KVPool` holds ``N`` rows of ``D = dim`` values; with ``P`` = ``D`` rounded up
to a multiple of 128 and ``T = P / 128`` tiles, a row is ``P + 2*64 + 4*T`` bytes:

=======================  ==========================================  ======================
bytes                    content                                     D = 512 (V4-Flash)
=======================  ==========================================  ======================
``[0, P)``               every value, ``float8_e4m3fn`` (zero        ``[0, 512)``
                         padded from ``D`` to ``P``)
``[P, P + 128)``         the operator's 64-wide ``bfloat16`` rope    ``[512, 640)``
                         operand: zero (not part of the row)
``[P + 128, row)``       one ``float32`` scale per tile of 128       ``[640, 656)``
=======================  ==========================================  ======================

so a 512-wide row takes 656 bytes (the operator's ``KV_D = 512 + 64*2 + 4*4``) against 592 in
:class:`~deepinfer_core.ops.kv_format.Fp8KVPool` and 1024 in bfloat16.  Every channel is
quantised, the rope channels included: the operator's value operand is the 512-wide quantised
part only (MLA-absorb: ``V`` = the dequantised key without its rope operand), and a model whose
attention output carries the rope channels (DeepSeek-V4: ``K = V`` over the whole 512-wide
head) must read them from there.  The 128 bytes of the rope operand are the price of a row the
operator reads in place; the reader may use that operand for something of its own (the
ascend950 backend folds the attention sinks into it), the pool never stores into it.

**Quantisation** (the exact definition; a backend's ``cache_write`` must store the same
bytes).  For each tile of 128 values (the last one zero padded) with ``amax = max |x|``
(fp32), the scale is the power of two ``2**e`` with ``e`` the smallest integer such that
``amax <= 448 * 2**e``, clamped to ``[-126, 126]``, and ``2**-9`` for an all-zero tile (the
rule of :func:`~deepinfer_core.ops.kv_format.ue8m0_exponents`), stored as its ``float32`` value.  The
stored value is ``float8_e4m3fn(x * 2**-e)``, rounded to nearest even (the product is exact).
A power of two is one float32 scale among those the operator takes; it makes dequantisation
exact, so every reader (the reference in bfloat16, an operator in float32) sees the same key
values.  **Dequantisation** is ``float(fp8) * scale``: exact in fp32, and in bfloat16 barring
underflow.

Error bound: as :class:`~deepinfer_core.ops.kv_format.Fp8KVPool`'s nope values with the tile's
``amax``: a value comes back within ``max(2**-4 * |x|, 2**-10 * 2**e)`` of ``x``, where
``2**e < amax / 224``.  The rope channels lose what bfloat16 keeps (``2**-9 * |x|``); DeepSeek-
V4.1's release format quantises them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_format import FP8_MAX, PackedKVPool, pow2, ue8m0_exponents

TILE = 128
"""Values per float32 scale (the operator's ``tile_size``)."""
ROPE_SLOT = 64
"""Width of the operator's bfloat16 rope operand in every row (its ``rope_head_dim``)."""
FORMAT = "fp8_tile128"
"""The kv format name of these rows (:mod:`deepinfer_core.models.cache_spec`)."""


@dataclass(frozen=True)
class TileRowLayout:
    """Byte offsets of one row (see the module docstring)."""

    dim: int
    padded: int  # P: e4m3 values at [0, P)
    rope_offset: int  # the rope operand's bfloat16 values at [rope_offset, rope_offset + 2*ROPE_SLOT)
    scale_offset: int  # float32 scales at [scale_offset, scale_offset + 4*tiles)
    tiles: int
    row_bytes: int


def tile_row_layout(dim: int) -> TileRowLayout:
    """The row layout of ``dim`` values."""
    if dim < 1:
        raise ValueError(f"dim={dim} must be >= 1")
    tiles = -(-dim // TILE)
    padded = tiles * TILE
    scale_offset = padded + 2 * ROPE_SLOT
    return TileRowLayout(dim, padded, padded, scale_offset, tiles, scale_offset + 4 * tiles)


def tile_row_bytes(dim: int) -> int:
    """Bytes of one row (656 for ``dim=512``)."""
    return tile_row_layout(dim).row_bytes


def quantize_tile_rows(values: torch.Tensor) -> torch.Tensor:
    """``values`` ``[..., D]`` (any float dtype) packed as ``uint8 [..., row_bytes]``.

    Shapes only, no host synchronisation (capturable in a device graph).
    """
    lay = tile_row_layout(values.shape[-1])
    lead = values.shape[:-1]
    x = values.reshape(-1, lay.dim).float()
    m = x.shape[0]
    tiles = F.pad(x, (0, lay.padded - lay.dim)).view(m, lay.tiles, TILE)
    e = ue8m0_exponents(tiles.abs().amax(dim=-1))
    q = (tiles * pow2(-e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scales = pow2(e).contiguous().view(torch.uint8).view(m, 4 * lay.tiles)
    rope = q.new_zeros(m, 2 * ROPE_SLOT, dtype=torch.uint8)
    return torch.cat([q.view(torch.uint8).view(m, lay.padded), rope, scales], dim=1).view(
        *lead, lay.row_bytes
    )


def dequantize_tile_rows(packed: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows ``uint8 [..., row_bytes]`` back to ``[..., dim]`` values in ``dtype``."""
    lay = tile_row_layout(dim)
    if packed.shape[-1] != lay.row_bytes:
        raise ValueError(f"packed rows have {packed.shape[-1]} bytes, expected {lay.row_bytes}")
    lead = packed.shape[:-1]
    p = packed.reshape(-1, lay.row_bytes)
    m = p.shape[0]
    scales = p[:, lay.scale_offset :].contiguous().view(torch.float32)  # [m, tiles]
    q = p[:, : lay.padded].contiguous().view(torch.float8_e4m3fn).float().view(m, lay.tiles, TILE)
    out = (q * scales.unsqueeze(-1)).view(m, lay.padded)[:, :dim]
    return out.to(dtype).reshape(*lead, dim)


@dataclass(frozen=True, eq=False)
class TileFp8KVPool(PackedKVPool):
    """A KV pool of ``N`` rows of ``dim`` values in the per-tile FP8 format (module docstring).

    Ops take it wherever they take a :class:`~deepinfer_core.ops.kv_format.PackedKVPool`.

    Attributes:
        data: ``uint8 [N, row_bytes]`` the packed rows.
        dim: logical row width ``D``.
    """

    data: torch.Tensor
    dim: int

    def __post_init__(self) -> None:
        self._check_data(tile_row_bytes(self.dim), f"{FORMAT} rows of {self.dim} values")

    @classmethod
    def zeros(cls, rows: int, dim: int, device: torch.device | str = "cpu") -> TileFp8KVPool:
        """A pool of ``rows`` zero rows (every value dequantises to 0)."""
        return cls(torch.zeros(rows, tile_row_bytes(dim), dtype=torch.uint8, device=device), dim)

    @classmethod
    def from_values(cls, values: torch.Tensor) -> TileFp8KVPool:
        """A pool holding ``values`` ``[N, D]``, quantised."""
        return cls(quantize_tile_rows(values), values.shape[-1])

    @property
    def layout(self) -> TileRowLayout:
        """Byte offsets of a row."""
        return tile_row_layout(self.dim)

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[M, dim]`` as packed rows ``uint8 [M, row_bytes]`` of this pool's format."""
        if values.shape[-1] != self.dim:
            raise ValueError(f"values have {values.shape[-1]} channels, the pool holds {self.dim}")
        return quantize_tile_rows(values)

    def unpack(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed rows ``uint8 [..., row_bytes]`` as ``[..., dim]`` values in ``dtype``."""
        return dequantize_tile_rows(packed, self.dim, dtype)

    def scales(self) -> torch.Tensor:
        """The per-tile scales, ``float32 [N, tiles]`` (a copy of ``data``'s scale bytes)."""
        lay = self.layout
        return self.data[:, lay.scale_offset :].contiguous().view(torch.float32)

    def __repr__(self) -> str:
        rows, dev = self.data.shape[0], self.device
        return f"TileFp8KVPool(rows={rows}, dim={self.dim}, device={dev})"
