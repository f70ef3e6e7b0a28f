"""Cache specs: what each layer of a hybrid-attention model keeps between steps.

A model declares, per layer, a list of specs; :class:`HybridCache` allocates them.  Three
kinds cover DeepSeek-V4 and leave room for V4.1:

* :class:`RingSpec` -- a per-sequence ring of the last ``width`` token rows (the sliding
  window), plus ``spare`` rows for speculative decoding (``spare`` = the most draft tokens
  of a verify step, 0 without speculation): ``rows = width + spare`` per slot, and the row of
  position ``p`` for slot ``s`` is ``s*rows + p % rows``.  Queries still read only the last
  ``width`` positions; the spare rows are where rejected draft positions land, so they never
  overwrite a position the window still needs and a rollback needs no cache operation.
* :class:`PagedSpec` -- entries produced every ``ratio`` tokens (compressed KV, indexer
  keys), stored in pages shared by all layers: page ``j`` of a request covers positions
  ``[j*page_size, (j+1)*page_size)`` and holds ``page_size // ratio`` entries per layer.
  Row of entry ``e``: ``page*(page_size//ratio) + (e*ratio % page_size)//ratio``.
* :class:`SlotStateSpec` -- fixed-size per-sequence state (the compressor's partial windows
  and overlap carries), ``[num_slots, *shape]``.
* :class:`PageStateSpec` -- fixed-size state per page, ``[num_pages, *shape]`` (the CSA
  overlap carry at the page's end, so a prefix-cache hit can resume the compressor there).

Any spec may set ``alias_of=(layer, name)`` to read another layer's storage instead of
owning one (V4.1's decoder layers read a source layer's compressed cache).

A ring or paged spec may set ``kv_format="fp8"`` (with ``rope_dim``, the trailing channels
``apply_rope`` rotates): its rows are then stored packed, an
:class:`~deepinfer_core.ops.kv_format.Fp8KVPool` (e4m3 nope values with one UE8M0 scale per
64, bfloat16 rope values: FlashMLA's V4 layout, 592 bytes per 512-wide row) instead of a
tensor in the spec dtype; the model sets it on the caches ``sparse_attention`` reads when the
engine runs with ``kv_cache_dtype="fp8"``.  The block-scaled formats of DeepSeek-V4.1's release
(``kv_format`` ``"fp8_ue8m0"``, ``"fp4_e4m3"``, ``"fp4_ue8m0"``: one scale byte per block of 32 /
16 / 32 values, ``dim`` a whole number of blocks) store a
:class:`~deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool` (528 / 288 bytes per 512-wide
row, 68 per 128-wide one).  A backend may name a substitute for a packed format
(:attr:`~deepinfer_core.backends.BackendSpec.kv_formats`, applied by :func:`with_kv_formats`):
``fp8_tile128`` (:class:`~deepinfer_core.ops.kv_tile.TileFp8KVPool`, the rows Ascend's sparse
attention operator reads, 656 bytes per 512-wide row) in place of ``fp8``.  Memory accounting
(:func:`spec_bytes`, :attr:`HybridCache.nbytes`) counts the packed bytes.

Every tensor has one extra *trash* slot (``num_slots``) and page (``num_pages``) beyond
what the cache manager hands out: fixed-shape step plans send the writes they do not need
there, so no step has to filter its rows by value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import torch

from deepinfer_core.ops.kv_format import KVPool, PackedKVPool
from deepinfer_core.ops.kv_registry import packed_kv_format

KVFormat = Literal["plain", "fp8", "fp8_tile128", "fp8_ue8m0", "fp4_e4m3", "fp4_ue8m0"]
"""Storage of a ring / paged spec's rows: ``plain`` (a tensor in the spec dtype) or a packed
format of :data:`~deepinfer_core.ops.kv_registry.PACKED_KV_FORMATS`: ``fp8``
(:class:`~deepinfer_core.ops.kv_format.Fp8KVPool` rows, V4), ``fp8_tile128``
(:class:`~deepinfer_core.ops.kv_tile.TileFp8KVPool` rows, a backend's substitute for ``fp8``)
or a block-scaled format (:class:`~deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool` rows,
V4.1's release)."""


@dataclass(frozen=True)
class RingSpec:
    """Sliding-window ring of ``dim``-wide rows per sequence slot: a window of ``width``
    positions, stored in ``width + spare`` rows (:attr:`rows`; see the module docstring)."""

    name: str
    width: int
    dim: int
    dtype: torch.dtype | None = None  # None: the model dtype
    alias_of: tuple[int, str] | None = None
    kv_format: KVFormat = "plain"
    rope_dim: int = 0  # trailing channels kept in bfloat16 by the fp8 format (only)
    spare: int = 0  # rows beyond the window: the most draft tokens of a verify step

    @property
    def rows(self) -> int:
        """Rows per slot: the row of position ``p`` of slot ``s`` is ``s*rows + p % rows``."""
        return self.width + self.spare


@dataclass(frozen=True)
class PagedSpec:
    """Paged entries, one per ``ratio`` positions, of ``dim`` channels."""

    name: str
    ratio: int
    dim: int
    dtype: torch.dtype | None = None
    alias_of: tuple[int, str] | None = None
    kv_format: KVFormat = "plain"
    rope_dim: int = 0  # trailing channels kept in bfloat16 by the fp8 format (only)


@dataclass(frozen=True)
class SlotStateSpec:
    """Per-sequence state tensor of ``shape`` (after the slot dimension)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    alias_of: tuple[int, str] | None = None


@dataclass(frozen=True)
class PageStateSpec:
    """Per-page state tensor of ``shape`` (after the page dimension)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    alias_of: tuple[int, str] | None = None


CacheSpec = RingSpec | PagedSpec | SlotStateSpec | PageStateSpec


def spec_bytes(spec: CacheSpec, page_size: int, model_dtype: torch.dtype) -> tuple[int, int]:
    """Bytes the spec costs ``(per page, per sequence slot)``."""
    if spec.alias_of is not None:
        return 0, 0
    if isinstance(spec, PagedSpec | RingSpec):
        row = _row_bytes(spec, model_dtype)
        if isinstance(spec, PagedSpec):
            return (page_size // spec.ratio) * row, 0
        return 0, spec.rows * row
    item = torch.empty((), dtype=spec.dtype or model_dtype).element_size()
    n = 1
    for s in spec.shape:
        n *= s
    return (n * item, 0) if isinstance(spec, PageStateSpec) else (0, n * item)


def _row_bytes(spec: RingSpec | PagedSpec, model_dtype: torch.dtype) -> int:
    """Bytes of one row of a ring or paged spec (packed rows for a packed ``kv_format``)."""
    if spec.kv_format == "plain":
        return spec.dim * torch.empty((), dtype=spec.dtype or model_dtype).element_size()
    try:
        return packed_kv_format(spec.kv_format).row_bytes(spec.dim, spec.rope_dim)
    except ValueError as e:
        raise ValueError(f"cache spec {spec.name!r}: {e}") from None


def _packed_zeros(spec: RingSpec | PagedSpec, rows: int, device: torch.device | str) -> PackedKVPool:
    """The zeroed packed pool of ``rows`` rows of a spec of a packed ``kv_format``."""
    return packed_kv_format(spec.kv_format).zeros(rows, spec.dim, spec.rope_dim, device)


def with_kv_formats(specs: list[list[CacheSpec]], substitutes: Mapping[str, str]) -> list[list[CacheSpec]]:
    """``specs`` with every ring / paged spec whose ``kv_format`` is a key of ``substitutes``
    stored in the format it maps to (a backend's
    :attr:`~deepinfer_core.backends.BackendSpec.kv_formats`); the rest unchanged."""
    if not substitutes:
        return specs
    return [
        [
            replace(s, kv_format=substitutes[s.kv_format])
            if isinstance(s, RingSpec | PagedSpec) and s.kv_format in substitutes
            else s
            for s in layer
        ]
        for layer in specs
    ]


class HybridCache:
    """The tensors of every layer's cache specs.

    Args:
        specs: ``specs[layer]`` is that layer's list of specs.
        num_pages, page_size, num_slots: pool geometry (see :class:`KVCacheManager`); one trash
            page and slot are added.
        dtype, device: model dtype (for specs without their own) and device.
    """

    def __init__(
        self,
        specs: list[list[CacheSpec]],
        num_pages: int,
        page_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.trash_slot, self.trash_page = num_slots, num_pages
        num_pages, num_slots = num_pages + 1, num_slots + 1  # the trash rows
        self._tensors: dict[tuple[int, str], KVPool] = {}
        for layer, layer_specs in enumerate(specs):
            for spec in layer_specs:
                if spec.alias_of is not None:
                    continue
                dt = spec.dtype or dtype
                if isinstance(spec, PagedSpec):
                    if page_size % spec.ratio:
                        raise ValueError(f"page_size {page_size} is not a multiple of ratio {spec.ratio}")
                    shape: tuple[int, ...] = (num_pages * (page_size // spec.ratio), spec.dim)
                elif isinstance(spec, RingSpec):
                    shape = (num_slots * spec.rows, spec.dim)
                elif isinstance(spec, PageStateSpec):
                    shape = (num_pages, *spec.shape)
                else:
                    shape = (num_slots, *spec.shape)
                if isinstance(spec, PagedSpec | RingSpec) and spec.kv_format != "plain":
                    _row_bytes(spec, dtype)  # rejects an unknown format, a row of partial blocks
                    self._tensors[(layer, spec.name)] = _packed_zeros(spec, shape[0], device)
                else:
                    self._tensors[(layer, spec.name)] = torch.zeros(shape, dtype=dt, device=device)
        for layer, layer_specs in enumerate(specs):
            for spec in layer_specs:
                if spec.alias_of is not None:
                    self._tensors[(layer, spec.name)] = self._tensors[spec.alias_of]

    def get(self, layer: int, name: str) -> KVPool:
        """The storage of ``layer``'s spec ``name``: a tensor, or a packed pool (an ``Fp8KVPool``,
        a ``BlockScaledKVPool``) for a spec of a packed ``kv_format``."""
        return self._tensors[(layer, name)]

    @property
    def nbytes(self) -> int:
        """Total bytes held (aliases counted once)."""
        seen = {id(t): t for t in self._tensors.values()}
        return sum(
            t.nbytes if isinstance(t, PackedKVPool) else t.numel() * t.element_size() for t in seen.values()
        )
