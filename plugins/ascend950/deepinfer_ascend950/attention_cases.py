"""Conformance cases at the shapes the attention operators take (the op's own cases are narrower
than the operators allow): ``sparse_attention`` with 512-wide heads, ``indexer_topk`` with
128-wide keys, 8 heads and pages of 16 entries.  Each builds the sources the V4 model passes:
a window split between a ring and this step's rows (a strided view), and compressed entries as
a paged index or as top-k picks with holes; plain, and packed as the backend stores
``kv_cache_dtype="fp8"`` (``fp8_tile128``).
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_tile import TileFp8KVPool

Cases = list[tuple[tuple, dict]]


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _paged(g: torch.Generator, t: int, requests: int, pages: int, epp: int) -> PagedIndex:
    """Each query's entries through its request's row of shuffled pages."""
    table = torch.randperm(requests * pages + 2, generator=g)[: requests * pages].view(requests, pages)
    rows = torch.randint(0, requests, (t,), generator=g)
    counts = torch.randint(0, pages * epp + 1, (t,), generator=g)
    return PagedIndex(table, rows, counts, epp, pages * epp)


def sparse_attention_cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
    """Sliding window, HCA (paged entries) and CSA (top-k picks) calls, 512-wide heads."""
    t, h, d, w = 5, 8, 512, 16
    qkv = _randn(g, t, h + 1, d, dtype=dtype, scale=0.2)
    q, kv = qkv[:, :h], qkv[:, h]  # strided views, as the model passes them
    ring = _randn(g, 3 * w, d, dtype=dtype)
    ring_idx = torch.randint(-1, 3 * w, (t, w), generator=g)
    chunk_idx = torch.where(torch.arange(t).view(-1, 1) >= torch.arange(t).view(1, -1), torch.arange(t), -1)
    ring_idx[-1] = -1  # a query whose only keys are this step's
    sinks = _randn(g, h)
    scale = d**-0.5
    paged = _paged(g, t, 2, 3, 16)
    entries = _randn(g, (2 * 3 + 2) * 16, d, dtype=dtype)
    picks = torch.randint(-1, entries.shape[0], (t, 12), generator=g)
    empty = torch.full((t, w), -1)
    # kv_cache_dtype="fp8" on this backend: every source in the per-tile FP8 rows, this step's
    # keys packed too (the model packs them in the ring's format)
    ring_t, kv_t = TileFp8KVPool.from_values(ring), TileFp8KVPool.from_values(kv)
    entries_t = TileFp8KVPool.from_values(entries)
    return [
        ((q, [ring_t, kv_t, entries_t], [ring_idx, chunk_idx, paged], sinks, scale), {}),
        ((q, [ring_t, kv_t, entries_t], [ring_idx, chunk_idx, picks], sinks * 4, scale), {}),
        ((q, [ring_t], [empty], sinks, scale), {}),  # only the sink: zeros
        ((q, [ring, kv], [ring_idx, chunk_idx], sinks, scale), {}),
        ((q, [ring, kv, entries], [ring_idx, chunk_idx, paged], sinks, scale), {}),
        ((q, [ring, kv, entries], [ring_idx, chunk_idx, picks], sinks, scale), {}),
        ((q, [ring], [empty], sinks, scale), {}),  # no key at all: zeros
    ]


def indexer_cases(g: torch.Generator, dtype: torch.dtype) -> Cases:
    """Paged candidates: integer data (exact scores, many ties) and random data whose weights
    are exact in ``dtype`` (the operator takes the weights in q's dtype)."""
    t, h, d, epp = 6, 8, 128, 16
    paged = _paged(g, t, 2, 4, epp)
    n = (2 * 4 + 2) * epp
    q = torch.randint(-2, 3, (t, h, d), generator=g).to(dtype)
    keys = torch.randint(-2, 3, (n, d), generator=g).to(dtype)
    wts = torch.randint(-2, 3, (t, h), generator=g).float()
    rq = _randn(g, t, h, d, dtype=dtype)
    rkeys = _randn(g, n, d, dtype=dtype)
    rwts = (_randn(g, t, h) * h**-0.5).to(dtype).float()
    return [
        ((q, wts, keys, paged, 8, 0.125), {}),
        ((q, wts, keys, paged, 100, 0.125), {}),  # k past the entries: [T, max_count], -1 tails
        ((rq, rwts, rkeys, paged, 16, d**-0.5), {}),
    ]
