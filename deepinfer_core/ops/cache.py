"""Cache writes: every store into a KV cache goes through an op, so a backend can own the
cache's format (an FP8 window ring, FP4 compressed entries) without touching the model."""

from __future__ import annotations

import torch

from ._cases import randn
from .cast import cast
from .kv_blockscaled import BlockScaledKVPool
from .kv_format import Fp8KVPool, KVPool, PackedKVPool
from .kv_tile import TileFp8KVPool
from .registry import define_op


def _write_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    cache = randn(g, 10, 8, dtype=dtype)
    rows = torch.randperm(10, generator=g)[:4]
    # packed FP8 pools: V4-Flash's row (448 nope + 64 rope) and a narrow one whose nope part
    # is not a whole scale group; values of very different magnitudes per group
    fp8 = Fp8KVPool.from_values(randn(g, 12, 512, dtype=dtype, scale=3.0), rope_dim=64)
    vals = randn(g, 3, 512, dtype=dtype) * torch.tensor([1e-3, 1.0, 50.0]).to(dtype).view(3, 1)
    narrow = Fp8KVPool.zeros(6, 40, rope_dim=8)
    # V4.1's block-scaled pools (window records, compressed entries, indexer keys), rows of
    # magnitudes from 1e-6 (an e4m3 subnormal scale) to 50, one all zero
    mags = torch.tensor([1e-6, 1e-3, 1.0, 50.0, 0.0]).to(dtype).view(5, 1)
    dest = torch.tensor([6, 1, 3, 0, 7])
    blocks = [
        (BlockScaledKVPool.zeros(8, 64, fmt), dest, randn(g, 5, 64, dtype=dtype) * mags)
        for fmt in ("fp8_ue8m0", "fp4_e4m3", "fp4_ue8m0")
    ]
    # per-tile FP8 pools: a 512-wide row of four tiles, a narrow one of a partial tile
    tile = TileFp8KVPool.zeros(12, 512)
    tile_narrow = TileFp8KVPool.zeros(6, 40)
    return [
        ((cache, rows, randn(g, 4, 8, dtype=dtype)), {}),
        ((tile, torch.tensor([7, 0, 11]), vals), {}),
        ((tile_narrow, torch.tensor([5, 2]), randn(g, 2, 40, dtype=dtype) * mags[2:4]), {}),
        ((cache, rows[:0], randn(g, 0, 8)), {}),
        ((fp8, torch.tensor([7, 0, 11]), vals), {}),
        ((narrow, torch.tensor([5, 2]), randn(g, 2, 40, dtype=dtype)), {}),
        *[(case, {}) for case in blocks],
    ]


# not marked batch_invariant: each row is stored independently of the others (a copy, or a
# per-row quantisation), so there is nothing a batch could change
@define_op("cache_write", "cache", sample_cases=_write_cases)
def cache_write(cache: KVPool, rows: torch.Tensor, values: torch.Tensor) -> KVPool:
    """Store rows in place: ``cache[rows[i]] = values[i]``, cast to the cache's format.

    Args:
        cache: ``[N, ...]`` a cache tensor (a window ring, an entry pool, a slot state), or a
            packed pool of ``N`` rows of ``D`` values (a pool of ``kv_cache_dtype="fp8"``): an
            :class:`~deepinfer_core.ops.kv_format.Fp8KVPool`, a
            :class:`~deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool` or a
            :class:`~deepinfer_core.ops.kv_tile.TileFp8KVPool`.
        rows: ``[M]`` int64 destination rows.  Distinct, except rows of the cache's trash
            slot / page (fixed-shape plans send unneeded writes there; which of several writes
            to a trash row survives is unspecified, as nothing reads it).
        values: ``[M, ...]`` the rows to store (any float dtype); ``[M, D]`` for a packed pool.

    Returns:
        ``cache`` (written in place).

    A plain tensor takes ``values`` cast to its dtype.  A packed pool takes them quantised as
    its format defines, exactly (the same bytes): an FP8 pool as
    :mod:`deepinfer_core.ops.kv_format` does (per row, the nope values in e4m3 with one
    power-of-two UE8M0 scale per 64, the trailing rope values in bfloat16), a block-scaled pool
    as :mod:`deepinfer_core.ops.kv_blockscaled` does (e4m3 or e2m1 values, one UE8M0 or e4m3
    scale per block: bit for bit DeepSeek-V4.1's ``kv_qdq`` once dequantised), a per-tile pool
    as :mod:`deepinfer_core.ops.kv_tile` does (every value e4m3, one power-of-two float32 scale
    per 128); no host
    synchronisation either way.
    """
    if isinstance(cache, PackedKVPool):
        cache.data.index_copy_(0, rows, cache.quantize(values))
        return cache
    return cache.index_copy_(0, rows, cast(values, cache.dtype))
