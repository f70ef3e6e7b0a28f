"""Sample cases at the shapes the cpu kernels are built for (the built-in tiny model's decode
step: 64 tokens, 4 streams of 64, 4 attention heads of 32, 8 indexer heads of 16) and at the
edges of their loops (other stream counts, odd widths, no token, strided inputs, queries with no
key, tied indexer scores)."""

from __future__ import annotations

import torch

from deepinfer_core.ops._cases import randn
from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.compressor import window_case


def _strided(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x], dim=-1)[..., : x.shape[-1]]


def hc_pre_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    def case(t: int, n: int, d: int, iters: int, strided: bool = False) -> tuple[tuple, dict]:
        streams = randn(g, t, n, d, dtype=dtype)
        fn = randn(g, (2 + n) * n, n * d, scale=0.1)
        base, scale = randn(g, (2 + n) * n), 1 + randn(g, 3, scale=0.1)
        args = (_strided(streams) if strided else streams, fn, base, scale)
        return (*args, 1e-6, 1e-6, iters), {}

    return [case(64, 4, 64, 20), case(5, 3, 10, 7, strided=True), case(0, 4, 16, 20), case(3, 2, 9, 1)]


def hc_post_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    def case(t: int, n: int, d: int) -> tuple[tuple, dict]:
        return (
            randn(g, t, d, dtype=dtype),
            randn(g, t, n, d, dtype=dtype),
            randn(g, t, n).sigmoid(),
            randn(g, t, n, n).softmax(-1),
        ), {}

    return [case(64, 4, 64), case(5, 3, 11), case(0, 4, 8)]


def hc_head_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    def case(t: int, n: int, d: int) -> tuple[tuple, dict]:
        return (
            randn(g, t, n, d, dtype=dtype),
            randn(g, n, n * d, scale=0.1),
            randn(g, n),
            randn(g, 1).abs(),
            1e-6,
            1e-6,
        ), {}

    return [case(64, 4, 64), case(5, 3, 11), case(0, 4, 8)]


def rms_norm_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    return [
        ((randn(g, 64, 64, dtype=dtype), 1 + randn(g, 64, scale=0.1), 1e-6), {}),
        ((_strided(randn(g, 7, 13, dtype=dtype)), None, 1e-5), {}),
        ((randn(g, 64, 8, 16, dtype=dtype), None, 1e-6), {}),
        ((randn(g, 0, 32, dtype=dtype), None, 1e-6), {}),
    ]


def _window_rows(g: torch.Generator, t: int, n: int, width: int) -> torch.Tensor:
    idx = torch.randint(-1, n, (t, width), generator=g)
    idx[:, 0] = torch.randint(0, n, (t,), generator=g)
    return idx


def _paged(g: torch.Generator, t: int, requests: int, pages: int, epp: int) -> PagedIndex:
    table = torch.stack([torch.randperm(requests * pages, generator=g)[:pages] for _ in range(requests)])
    counts = torch.randint(0, pages * epp + 1, (t,), generator=g)
    return PagedIndex(table, torch.randint(0, requests, (t,), generator=g), counts, epp, pages * epp)


def sparse_attention_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """The tiny model's decode step (64 queries, 4 heads of 32): the window ring (8 rows, some
    unused), this step's keys (a strided slice, as the model passes them), the compressed
    entries through a paged index; a query with no key at all; no query."""
    t, h, d = 64, 4, 32
    ring, entries = randn(g, 64 * 8, d, dtype=dtype), randn(g, 8 * 16, d, dtype=dtype)
    chunk = randn(g, t, h + 1, d, dtype=dtype)[:, h]  # strided rows
    ring_idx = _window_rows(g, t, ring.shape[0], 8)
    chunk_idx = torch.arange(t).view(t, 1)
    none = ring_idx.clone()
    none[5] = -1
    no_chunk = chunk_idx.clone()
    no_chunk[5] = -1
    paged = _paged(g, t, 8, 4, 4)
    sinks = randn(g, h)
    q = lambda n: randn(g, n, h, d, dtype=dtype)  # noqa: E731
    return [
        ((q(t), [ring, chunk, entries], [ring_idx, chunk_idx, paged], sinks, d**-0.5), {}),
        ((q(t), [ring, chunk], [none, no_chunk], sinks, d**-0.5), {}),
        ((q(0), [ring, chunk], [ring_idx[:0], chunk_idx[:0]], sinks, d**-0.5), {}),
    ]


def apply_rope_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """Queries and key of the tiny model ([64, 5, 32], 8 rope channels), the attention output
    (strided), the indexer's queries ([64, 8, 16]), a [T, D] key, every channel rotating."""
    cs = lambda t, half: (randn(g, t, half), randn(g, t, half))  # noqa: E731
    return [
        ((randn(g, 64, 5, 32, dtype=dtype), *cs(64, 4)), {}),
        ((_strided(randn(g, 64, 4, 32, dtype=dtype)), *cs(64, 4)), {}),
        ((randn(g, 64, 8, 16, dtype=dtype), *cs(64, 4)), {}),
        ((randn(g, 7, 16, dtype=dtype), *cs(7, 8)), {}),
        ((randn(g, 0, 4, 32, dtype=dtype), *cs(0, 4)), {}),
    ]


def compress_entries_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """The tiny model's compressors (CSA: windows of 2 x 4 rows, the first half empty in a
    sequence's first window; HCA: 16 rows), 32 channels of which 8 rotate, YaRN-scaled."""

    def case(m: int, length: int, first_empty: bool) -> tuple[tuple, dict]:
        d, n = 32, 40
        gate = randn(g, m, length, d)
        if first_empty and m:
            gate[0, : length // 2] = float("-inf")
        inv_freq = 1.0 / (160000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
        positions = torch.randint(0, 256, (m,), generator=g) * 4
        dest = torch.randperm(n, generator=g)[:m]
        args = (randn(g, m, length, d, dtype=dtype), gate, 1 + randn(g, d, scale=0.1), 1e-6, positions)
        return (*args, inv_freq, 1.2, randn(g, n, d, dtype=dtype), dest), {}

    return [case(16, 8, True), case(4, 16, False), case(0, 8, False)]


def compress_windows_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """The tiny model's compressor steps: CSA (windows of 4 rows, carries, page snapshots) at a
    16-request decode step, HCA (16 rows)."""
    return [
        window_case(g, dtype, 16, 16, 4, 32, True, rope_dim=8),
        window_case(g, dtype, 16, 4, 16, 32, False, rope_dim=8),
    ]


def indexer_topk_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """The tiny model's indexer (64 queries, 8 heads of 16, top 4) over paged entries and
    explicit lists with unused slots, candidates that repeat a key (tied scores: the earlier
    column wins), fewer valid candidates than k, k above the candidate count."""
    t, h, d = 64, 8, 16
    keys = randn(g, 8 * 16, d, dtype=dtype)
    q, w = randn(g, t, h, d, dtype=dtype), randn(g, t, h)
    explicit = _window_rows(g, t, keys.shape[0], 12)
    explicit[:, 6] = explicit[:, 2]  # a tie in every row
    explicit[3, 1:] = -1
    return [
        ((q, w, keys, _paged(g, t, 8, 4, 4), 4, d**-0.5), {}),
        ((q, w, keys, explicit, 4, d**-0.5), {}),
        ((q, w, keys, explicit[:, :3], 4, d**-0.5), {}),
    ]


OWN_CASES = {
    "hc_pre": hc_pre_cases,
    "hc_post": hc_post_cases,
    "hc_head": hc_head_cases,
    "rms_norm": rms_norm_cases,
    "sparse_attention": sparse_attention_cases,
    "apply_rope": apply_rope_cases,
    "compress_entries": compress_entries_cases,
    "compress_windows": compress_windows_cases,
    "indexer_topk": indexer_topk_cases,
}
