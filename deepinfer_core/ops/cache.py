"""Cache writes: every store into a KV cache goes through an op, so a backend can own the
cache's format (an FP8 window ring, FP4 compressed entries) without touching the model."""

from __future__ import annotations

import torch

from ._cases import randn
from .registry import define_op


def _write_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    cache = randn(g, 10, 8, dtype=dtype)
    rows = torch.randperm(10, generator=g)[:4]
    return [((cache, rows, randn(g, 4, 8, dtype=dtype)), {}), ((cache, rows[:0], randn(g, 0, 8)), {})]


# not marked batch_invariant: it does no arithmetic (each row is a copy), so there is
# nothing a batch could change
@define_op("cache_write", "cache", sample_cases=_write_cases)
def cache_write(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Store rows in place: ``cache[rows[i]] = values[i]``, cast to the cache's dtype.

    Args:
        cache: ``[N, ...]`` a cache tensor (a window ring, an entry pool, a slot state).
        rows: ``[M]`` int64 destination rows.  Distinct, except rows of the cache's trash
            slot / page (fixed-shape plans send unneeded writes there; which of several writes
            to a trash row survives is unspecified, as nothing reads it).
        values: ``[M, ...]`` the rows to store (any float dtype).

    Returns:
        ``cache`` (written in place).
    """
    return cache.index_copy_(0, rows, values.to(cache.dtype))
