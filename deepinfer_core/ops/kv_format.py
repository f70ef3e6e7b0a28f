"""KV-cache storage formats: the packed-pool interface, and the packed FP8 rows of FlashMLA's
DeepSeek-V4 layout.

A plain KV pool is an ``[N, D]`` tensor in the model dtype.  A packed pool holds ``N`` logical
rows of ``D`` values as bytes, ``data: uint8 [N, row_bytes]``; every packed format derives from
:class:`PackedKVPool`, the interface the ops rely on (``cache_write`` stores
:meth:`~PackedKVPool.quantize`'s bytes at rows of ``data``, the readers call
:meth:`~PackedKVPool.dequantize_rows`).  The formats: :class:`Fp8KVPool` (below; V4,
``kv_cache_dtype="fp8"``) and the block-scaled formats of DeepSeek-V4.1's release
(:class:`~deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool`: MXFP8 window records, NVFP4-like
compressed entries, MXFP4 indexer keys), and the per-tile FP8 rows Ascend's sparse attention
operator reads (:class:`~deepinfer_core.ops.kv_tile.TileFp8KVPool`), which a backend may store
in place of :class:`Fp8KVPool` (:mod:`deepinfer_core.models.cache_spec`).

An :class:`Fp8KVPool` holds the
same ``N`` logical rows of ``D = head_dim`` values packed into ``row_bytes`` bytes each
(``data``: ``uint8 [N, row_bytes]``); with ``R = rope_dim`` (the trailing channels that
``apply_rope`` rotates):

=====================  =========================================  ======================
bytes                  content                                    V4-Flash (D=512, R=64)
=====================  =========================================  ======================
``[0, D-R)``           the "nope" values, ``float8_e4m3fn``        ``[0, 448)``
``[ro, ro + 2R)``      the rope values, ``bfloat16`` (``ro`` =     ``[448, 576)``
                       ``D-R`` rounded up to even)
``[so, so + G)``       one UE8M0 scale per 64 nope values          ``[576, 583)``
                       (``G = ceil((D-R)/64)``, ``so = ro + 2R``)
``[so + G, row)``      zero padding to a multiple of 16 bytes      ``[583, 592)``
=====================  =========================================  ======================

so V4-Flash takes 592 bytes per row against 1024 in bfloat16.  Each row's first 576 bytes
(nope then rope) and its 8 scale bytes (7 and a zero) are FlashMLA's ``MODEL1_FP8Sparse``
per-token payload; FlashMLA groups a page's scale bytes after the page's payloads, whereas
here every row keeps its own (the window ring is addressed by row, not by page), and rows
start on 16 bytes, so that a kernel can read them in 16-byte vectors (8 more bytes a row).

**Quantisation** (the exact definition; a backend's ``cache_write`` must store the same
bytes).  For each group ``g`` of up to 64 nope values with ``amax = max |x|`` (fp32), the
scale is the power of two ``2**e`` with ``e`` the smallest integer such that
``amax <= 448 * 2**e`` (``2**ceil(log2(amax / 448))`` computed exactly: from
``frexp(amax) = (m, k)``, ``e = k - 9`` if ``m <= 0.875`` else ``k - 8``), clamped to
``[-126, 126]``; the scale byte is ``e + 127`` (UE8M0, ``torch.float8_e8m0fnu``).  The
stored value is ``float8_e4m3fn(x * 2**-e)``, rounded to nearest even (the product is exact:
a power-of-two scaling, and ``|x * 2**-e| <= 448``).  The rope values are rounded to
bfloat16.  **Dequantisation** is ``float(fp8) * 2**(byte - 127)`` (exact in fp32, and in
bfloat16 barring underflow) and the bfloat16 rope values as they are.

Error bound: e4m3 keeps 3 mantissa bits and its subnormal step is ``2**-9``, so a nope value
comes back within ``max(2**-4 * |x|, 2**-10 * 2**e)`` of ``x``, where ``2**e < amax / 224``
(``e`` is the smallest exponent that fits, so ``amax > 448 * 2**(e-1)``); a rope value within
``2**-9 * |x|`` (bfloat16 rounding).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
SCALE_GROUP = 64
"""Nope values per UE8M0 scale."""
ROW_ALIGN = 16
"""Packed rows are padded to a multiple of this many bytes (16: every row of a pool starts on
16 bytes, the width of a GPU's vector loads)."""
_E_MIN, _E_MAX = -126, 126  # scale exponents kept: 2**e and 2**-e are normal fp32 numbers


@dataclass(frozen=True)
class Fp8RowLayout:
    """Byte offsets of one packed row (see the module docstring)."""

    dim: int
    rope_dim: int
    nope: int  # nope values (= bytes), at [0, nope)
    rope_offset: int  # bf16 rope values at [rope_offset, rope_offset + 2*rope_dim)
    scale_offset: int  # UE8M0 scales at [scale_offset, scale_offset + groups)
    groups: int
    row_bytes: int


def fp8_row_layout(dim: int, rope_dim: int) -> Fp8RowLayout:
    """The packed row layout of ``dim`` values whose trailing ``rope_dim`` stay in bfloat16."""
    if not 0 <= rope_dim <= dim or dim < 1:
        raise ValueError(f"rope_dim={rope_dim} must be in [0, dim={dim}] (dim >= 1)")
    nope = dim - rope_dim
    rope_offset = nope + nope % 2
    scale_offset = rope_offset + 2 * rope_dim
    groups = -(-nope // SCALE_GROUP)
    row_bytes = -(-(scale_offset + groups) // ROW_ALIGN) * ROW_ALIGN
    return Fp8RowLayout(dim, rope_dim, nope, rope_offset, scale_offset, groups, row_bytes)


def fp8_row_bytes(dim: int, rope_dim: int) -> int:
    """Bytes of one packed row (592 for V4-Flash's ``dim=512, rope_dim=64``)."""
    return fp8_row_layout(dim, rope_dim).row_bytes


def quantize_fp8_rows(values: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """``values`` ``[..., D]`` (any float dtype) packed as ``uint8 [..., row_bytes]``.

    Shapes only, no host synchronisation (capturable in a device graph).
    """
    lay = fp8_row_layout(values.shape[-1], rope_dim)
    lead = values.shape[:-1]
    x = values.reshape(-1, lay.dim).float()
    m = x.shape[0]
    nope = F.pad(x[:, : lay.nope], (0, lay.groups * SCALE_GROUP - lay.nope)).view(m, lay.groups, SCALE_GROUP)
    e = ue8m0_exponents(nope.abs().amax(dim=-1))
    inv = pow2(-e)
    q = (nope * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(torch.uint8).view(m, lay.groups * SCALE_GROUP)[:, : lay.nope]
    rope = x[:, lay.nope :].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = (e + 127).to(torch.uint8)
    parts = [q]
    if lay.rope_offset > lay.nope:
        parts.append(q.new_zeros(m, lay.rope_offset - lay.nope))
    parts += [rope, scales]
    tail = lay.row_bytes - lay.scale_offset - lay.groups
    if tail:
        parts.append(q.new_zeros(m, tail))
    return torch.cat(parts, dim=1).view(*lead, lay.row_bytes)


def dequantize_fp8_rows(
    packed: torch.Tensor, dim: int, rope_dim: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed rows ``uint8 [..., row_bytes]`` back to ``[..., dim]`` values in ``dtype``."""
    lay = fp8_row_layout(dim, rope_dim)
    if packed.shape[-1] != lay.row_bytes:
        raise ValueError(f"packed rows have {packed.shape[-1]} bytes, expected {lay.row_bytes}")
    lead = packed.shape[:-1]
    p = packed.reshape(-1, lay.row_bytes)
    m = p.shape[0]
    scales = pow2(p[:, lay.scale_offset : lay.scale_offset + lay.groups].to(torch.int32) - 127)
    scales = scales.unsqueeze(-1).expand(m, lay.groups, SCALE_GROUP).reshape(m, lay.groups * SCALE_GROUP)
    scales = scales[:, : lay.nope]
    nope = p[:, : lay.nope].view(torch.float8_e4m3fn).float() * scales
    rope = p[:, lay.rope_offset : lay.rope_offset + 2 * lay.rope_dim].contiguous().view(torch.bfloat16)
    return torch.cat([nope.to(dtype), rope.to(dtype)], dim=1).view(*lead, dim)


def ue8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per group, the scale exponent ``e`` of a group of largest magnitude ``amax`` (fp32): the
    smallest integer with ``amax <= 448 * 2**e``, clamped to ``[-126, 126]`` (int32).

    Exact: from ``frexp(amax) = (m, k)``, ``e = k - 9`` if ``m <= 0.875`` else ``k - 8``; an
    all-zero group (``frexp(0) = (0, 0)``) takes ``e = -9``.
    """
    mant, expo = torch.frexp(amax.float())  # amax = mant * 2**expo, mant in [0.5, 1)
    return (expo - 9 + (mant > 0.875).to(expo.dtype)).clamp(_E_MIN, _E_MAX)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0**e`` (float32) of int exponents in [-126, 127], exactly: built from the bits."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


class PackedKVPool(ABC):
    """A KV pool of ``N`` rows of ``dim`` values stored packed: ``data`` ``uint8 [N, row_bytes]``.

    The interface every packed format implements (a frozen dataclass holding ``data``, ``dim``
    and its format's parameters); ops test ``isinstance(pool, PackedKVPool)`` and use only this:
    ``cache_write`` stores :meth:`quantize`'s bytes at rows of ``data``, readers dequantise the
    rows they read (:meth:`dequantize_rows`), a model needing a pool of the same format for rows
    of its own makes one with :meth:`empty_rows`.  Each row is packed independently of the
    others, and neither direction synchronises with the host.
    """

    data: torch.Tensor
    dim: int

    @abstractmethod
    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[M, dim]`` (any float dtype) as packed rows ``uint8 [M, row_bytes]`` of
        this pool's format."""

    @abstractmethod
    def unpack(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed rows ``uint8 [..., row_bytes]`` of this format as ``[..., dim]`` values in ``dtype``."""

    def _check_data(self, want: int, what: str) -> None:
        """Raise a :class:`ValueError` unless ``data`` is ``uint8 [N, want]`` (``what``: the
        format's rows, for the message)."""
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != want:
            raise ValueError(
                f"{type(self).__name__} data must be uint8 [N, {want}] for {what}; "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )

    def empty_rows(self, rows: int) -> PackedKVPool:
        """A pool of this one's format and parameters of ``rows`` rows on the same device, their
        bytes undefined until written (no fill kernel): for rows ``cache_write`` stores whole
        right away."""
        data = torch.empty(rows, self.data.shape[1], dtype=torch.uint8, device=self.data.device)
        return replace(self, data=data)  # type: ignore[type-var]

    def dequantize_rows(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``rows`` (int64 of any shape, each in ``[0, N)``) as ``[*rows.shape, dim]`` in ``dtype``."""
        packed = self.data.index_select(0, rows.reshape(-1)).view(*rows.shape, self.data.shape[1])
        return self.unpack(packed, dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every row, ``[N, dim]`` in ``dtype``."""
        return self.unpack(self.data, dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one packed row."""
        return self.data.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        """The logical shape ``(N, dim)``."""
        return (self.data.shape[0], self.dim)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.data.numel()


@dataclass(frozen=True, eq=False)
class Fp8KVPool(PackedKVPool):
    """A KV pool of ``N`` rows of ``dim`` values in the packed FP8 format (module docstring).

    Ops take it wherever the contract says a pool may be packed (``cache_write``'s ``cache``,
    ``sparse_attention``'s ``kv_pools``); everything else reads it through
    :meth:`dequantize_rows`.

    Attributes:
        data: ``uint8 [N, row_bytes]`` the packed rows.
        dim: logical row width ``D``.
        rope_dim: trailing channels ``R`` stored in bfloat16.
    """

    data: torch.Tensor
    dim: int
    rope_dim: int

    def __post_init__(self) -> None:
        self._check_data(fp8_row_bytes(self.dim, self.rope_dim), f"dim={self.dim}, rope_dim={self.rope_dim}")

    @classmethod
    def zeros(cls, rows: int, dim: int, rope_dim: int, device: torch.device | str = "cpu") -> Fp8KVPool:
        """A pool of ``rows`` zero rows (every value dequantises to 0)."""
        data = torch.zeros(rows, fp8_row_bytes(dim, rope_dim), dtype=torch.uint8, device=device)
        return cls(data, dim, rope_dim)

    @classmethod
    def from_values(cls, values: torch.Tensor, rope_dim: int) -> Fp8KVPool:
        """A pool holding ``values`` ``[N, D]``, quantised."""
        return cls(quantize_fp8_rows(values, rope_dim), values.shape[-1], rope_dim)

    @property
    def layout(self) -> Fp8RowLayout:
        """Byte offsets of a row."""
        return fp8_row_layout(self.dim, self.rope_dim)

    def quantize(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` ``[M, dim]`` as packed rows ``uint8 [M, row_bytes]`` of this pool's format."""
        if values.shape[-1] != self.dim:
            raise ValueError(f"values have {values.shape[-1]} channels, the pool holds {self.dim}")
        return quantize_fp8_rows(values, self.rope_dim)

    def unpack(self, packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed rows ``uint8 [..., row_bytes]`` as ``[..., dim]`` values in ``dtype``."""
        return dequantize_fp8_rows(packed, self.dim, self.rope_dim, dtype)

    def scales(self) -> torch.Tensor:
        """The UE8M0 scales, ``float8_e8m0fnu [N, groups]`` (a view of ``data``)."""
        lay = self.layout
        return self.data[:, lay.scale_offset : lay.scale_offset + lay.groups].view(torch.float8_e8m0fnu)

    def __repr__(self) -> str:
        rows, dev = self.data.shape[0], self.device
        return f"Fp8KVPool(rows={rows}, dim={self.dim}, rope_dim={self.rope_dim}, device={dev})"


KVPool = torch.Tensor | PackedKVPool
"""What an op accepts as a KV pool: a plain ``[N, D]`` tensor or a packed pool (an
:class:`Fp8KVPool`, a :class:`~deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool`, a
:class:`~deepinfer_core.ops.kv_tile.TileFp8KVPool`)."""
