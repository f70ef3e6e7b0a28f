"""The packed KV formats by name (:data:`PACKED_KV_FORMATS`): what a cache spec's ``kv_format``
allocates, and what a backend may store in place of one of the core's formats.

A model chooses a spec's ``kv_format`` (:mod:`deepinfer_core.models.cache_spec`: ``"fp8"`` for
DeepSeek-V4's packed rows, the block-scaled names for V4.1's release formats); a backend whose
kernels read another layout of the same rows names the substitution in
:attr:`~deepinfer_core.backends.BackendSpec.kv_formats` (``{"fp8": "fp8_tile128"}``: Ascend's
per-tile rows instead of FlashMLA's), and the engine allocates that format instead
(:func:`~deepinfer_core.models.cache_spec.with_kv_formats`).  Every format is a
:class:`~deepinfer_core.ops.kv_format.PackedKVPool`, so the model and the reference ops read and
write any of them through that interface alone; a substitute changes the quantisation (the
reference then runs the same format, so backend and reference still agree), not the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .kv_blockscaled import BLOCK_FORMATS, BlockScaledKVPool, block_row_bytes
from .kv_format import Fp8KVPool, PackedKVPool, fp8_row_bytes
from .kv_tile import FORMAT as TILE_FORMAT
from .kv_tile import TileFp8KVPool, tile_row_bytes


@dataclass(frozen=True)
class PackedKVFormat:
    """A packed format as a cache spec names it.

    Attributes:
        name: the ``kv_format`` name.
        row_bytes: ``(dim, rope_dim) -> bytes`` of one row (raises ``ValueError`` for rows the
            format cannot hold).
        zeros: ``(rows, dim, rope_dim, device) ->`` a pool of ``rows`` zero rows.
        summary: one line: what the rows hold.
    """

    name: str
    row_bytes: Callable[[int, int], int]
    zeros: Callable[[int, int, int, torch.device | str], PackedKVPool]
    summary: str


def _block(name: str) -> PackedKVFormat:
    return PackedKVFormat(
        name,
        lambda dim, rope_dim: block_row_bytes(name, dim),
        lambda rows, dim, rope_dim, device: BlockScaledKVPool.zeros(rows, dim, name, device),
        f"DeepSeek-V4.1 release rows ({name}, blocks of {BLOCK_FORMATS[name].block})",
    )


PACKED_KV_FORMATS: dict[str, PackedKVFormat] = {
    "fp8": PackedKVFormat(
        "fp8",
        fp8_row_bytes,
        lambda rows, dim, rope_dim, device: Fp8KVPool.zeros(rows, dim, rope_dim, device),
        "FlashMLA's V4 rows: e4m3 nope values, a UE8M0 scale per 64, bfloat16 rope values",
    ),
    TILE_FORMAT: PackedKVFormat(
        TILE_FORMAT,
        lambda dim, rope_dim: tile_row_bytes(dim),
        lambda rows, dim, rope_dim, device: TileFp8KVPool.zeros(rows, dim, device),
        "Ascend's per-tile rows: every value e4m3, a float32 power-of-two scale per 128",
    ),
    **{name: _block(name) for name in BLOCK_FORMATS},
}
"""Every packed ``kv_format`` by name."""


def packed_kv_format(name: str) -> PackedKVFormat:
    """The format ``name``; ``ValueError`` (one line listing the known ones) otherwise."""
    try:
        return PACKED_KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown kv_format {name!r}; packed formats: {sorted(PACKED_KV_FORMATS)}") from None


def check_substitutes(substitutes: Mapping[str, str]) -> str | None:
    """``None`` when ``substitutes`` (a backend's ``kv_formats``) maps packed format names to
    other packed format names, else what is wrong (one line)."""
    if not isinstance(substitutes, Mapping):
        return f"must be a mapping of kv_format name to kv_format name, got {type(substitutes).__name__}"
    for core, own in substitutes.items():
        for name in (core, own):
            if name not in PACKED_KV_FORMATS:
                return f"unknown kv_format {name!r}; packed formats: {sorted(PACKED_KV_FORMATS)}"
        if core == own:
            return f"maps {core!r} to itself"
    return None
