"""Attention ops: sparse multi-source MQA with sinks, compressor pooling, indexer top-k.

V4 attention is MQA with one shared K=V head.  Each query attends to key rows drawn from
several *sources* (the sliding-window ring, the current chunk's keys, the compressed-entry
pool).  A source's rows are given either as an explicit list per query, FlashMLA-sparse style
(an index ``-1`` marks an unused slot), or as a :class:`PagedIndex`: the first ``counts[t]``
entries of a paged pool, located through a block table, as FlashMLA's and DeepGEMM's paged
kernels read them (no per-query list that grows with the context).  A pool may be a plain
``[N, D]`` tensor or a packed :class:`~deepinfer_core.ops.kv_format.PackedKVPool`
(``kv_cache_dtype="fp8"``: V4's :class:`~deepinfer_core.ops.kv_format.Fp8KVPool`, V4.1's
:class:`~deepinfer_core.ops.kv_blockscaled.BlockScaledKVPool`), read as its rows dequantised to
the queries' dtype; so may the indexer's key pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._cases import randn
from .cast import cast
from .kv_blockscaled import BlockScaledKVPool
from .kv_format import Fp8KVPool, KVPool, PackedKVPool
from .kv_tile import TileFp8KVPool
from .modes import KEY_BLOCK, batch_invariant_enabled, pad_cols, padded_len, row_padded
from .registry import define_op


@dataclass(frozen=True)
class PagedIndex:
    """Entries ``0 .. counts[t]-1`` of a paged pool, for each query ``t``.

    Entry ``e`` of query ``t`` lives in pool row
    ``block_table[token_rows[t], e // entries_per_page] * entries_per_page + e % entries_per_page``.
    Every page an entry below its query's count lives in must be allocated (a page id ``>= 0``):
    the reference reads a negative id's entries as missing keys (negative rows) and the
    indexer's selections pick them as ``-1``, but the attention kernels read rows without that
    check.

    Attributes:
        block_table: ``[R, P]`` int64 page ids, one row per request.
        token_rows: ``[T]`` int64 row of ``block_table`` of each query.
        counts: ``[T]`` int64 visible entries of each query (clamped to ``max_count``).
        entries_per_page: pool rows per page (``page_size // ratio``).
        max_count: a static upper bound of ``counts`` (a Python int: shapes derive from it,
            never from tensor values).
    """

    block_table: torch.Tensor
    token_rows: torch.Tensor
    counts: torch.Tensor
    entries_per_page: int
    max_count: int

    def rows(self) -> torch.Tensor:
        """The explicit ``[T, max_count]`` pool rows (``-1`` past each query's count); computed
        once per index (the layers of a step that share an index share its rows).  Not to be
        modified in place."""
        rows = self.__dict__.get("_rows")
        if rows is None:
            e = torch.arange(self.max_count, device=self.counts.device)
            cols = (e // self.entries_per_page).clamp(max=self.block_table.shape[1] - 1)
            pages = self.block_table.index_select(0, self.token_rows).index_select(1, cols)
            rows = pages * self.entries_per_page + e % self.entries_per_page
            rows = torch.where(e.unsqueeze(0) < self.counts.unsqueeze(1), rows, -1)
            object.__setattr__(self, "_rows", rows)  # a cache beside the (frozen) fields
        return rows

    def select(self, rows: torch.Tensor) -> PagedIndex:
        """The index of the queries ``rows`` (for callers that pad or split the queries)."""
        return PagedIndex(
            self.block_table, self.token_rows[rows], self.counts[rows], self.entries_per_page, self.max_count
        )


def _as_rows(index: torch.Tensor | PagedIndex) -> torch.Tensor:
    """An explicit ``[T, K]`` row list from either form of a source's index."""
    return index.rows() if isinstance(index, PagedIndex) else index


def gather_rows(pool: KVPool, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``idx`` (``-1`` read as row 0: the caller masks them) of ``pool``, ``[*idx.shape, D]``:
    a plain pool's rows as they are, a packed pool's dequantised to ``dtype``."""
    if isinstance(pool, PackedKVPool):
        return pool.dequantize_rows(idx.clamp(min=0), dtype)
    return F.embedding(idx.clamp(min=0), pool)  # row gather (fastest on CPU)


def _paged_case(g: torch.Generator, t: int, n_pages: int, epp: int) -> PagedIndex:
    """A random paged index over ``n_pages`` pages of ``epp`` entries (pages shuffled)."""
    table = torch.randperm(n_pages, generator=g).view(1, -1).repeat(2, 1)
    table[1] = table[1].flip(0)
    counts = torch.randint(0, n_pages * epp + 1, (t,), generator=g)
    return PagedIndex(table, torch.randint(0, 2, (t,), generator=g), counts, epp, n_pages * epp)


def _attn_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    t, h, d = 6, 4, 32
    pool_a, pool_b = randn(g, 20, d, dtype=dtype), randn(g, 9, d, dtype=dtype)
    idx_a = torch.randint(-1, 20, (t, 5), generator=g)
    idx_b = torch.randint(-1, 9, (t, 3), generator=g)
    idx_a[:, 0] = 0  # at least one valid key per query
    paged = _paged_case(g, t, 3, 4)
    pool_c = randn(g, 12, d, dtype=dtype)
    # packed FP8 pools (kv_cache_dtype="fp8": 8 of the 32 channels are rope, in bf16): a ring,
    # this step's rows in the model dtype, and paged entries
    ring8 = Fp8KVPool.from_values(randn(g, 20, d, dtype=dtype, scale=2.0), rope_dim=8)
    ckv8 = Fp8KVPool.from_values(randn(g, 12, d, dtype=dtype), rope_dim=8)
    # V4.1's block-scaled pools: an MXFP8 ring, this step's rows plain, NVFP4-like entries
    ring_mx = BlockScaledKVPool.from_values(randn(g, 20, d, dtype=dtype, scale=2.0), "fp8_ue8m0")
    ckv_nv = BlockScaledKVPool.from_values(randn(g, 12, d, dtype=dtype), "fp4_e4m3")
    # per-tile FP8 pools (a backend's substitute for fp8): a ring and paged entries
    ring_t = TileFp8KVPool.from_values(randn(g, 20, d, dtype=dtype, scale=2.0))
    ckv_t = TileFp8KVPool.from_values(randn(g, 12, d, dtype=dtype))
    return [
        ((randn(g, t, h, d, dtype=dtype), [pool_a, pool_b], [idx_a, idx_b], randn(g, h), d**-0.5), {}),
        ((randn(g, t, h, d, dtype=dtype), [pool_a, pool_c], [idx_a, paged], randn(g, h), d**-0.5), {}),
        (
            (
                randn(g, t, h, d, dtype=dtype),
                [ring8, pool_b, ckv8],
                [idx_a, idx_b, paged],
                randn(g, h),
                d**-0.5,
            ),
            {},
        ),
        (
            (
                randn(g, t, h, d, dtype=dtype),
                [ring_mx, pool_b, ckv_nv],
                [idx_a, idx_b, paged],
                randn(g, h),
                d**-0.5,
            ),
            {},
        ),
        (
            (
                randn(g, t, h, d, dtype=dtype),
                [ring_t, pool_b, ckv_t],
                [idx_a, idx_b, paged],
                randn(g, h),
                d**-0.5,
            ),
            {},
        ),
    ]


@define_op("sparse_attention", "attention", batch_invariant=True, sample_cases=_attn_cases)
@row_padded({"q": 0.0, "indices": -1})
def sparse_attention(
    q: torch.Tensor,
    kv_pools: Sequence[KVPool],
    indices: Sequence[torch.Tensor | PagedIndex],
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Single-KV-head attention over per-query key lists, with a per-head sink logit.

    Args:
        q: ``[T, H, D]`` queries.
        kv_pools: sources of key(=value) rows, each ``[N_i, D]`` in q's dtype, or a packed
            :class:`~deepinfer_core.ops.kv_format.PackedKVPool` of ``N_i`` rows of ``D`` values
            (``kv_cache_dtype="fp8"``: an ``Fp8KVPool``, a ``TileFp8KVPool`` or a
            ``BlockScaledKVPool``), whose rows count as their dequantised values in q's dtype
            (``PackedKVPool.dequantize_rows``: for ``Fp8KVPool`` and ``TileFp8KVPool`` exact, an
            e4m3 value times a power of two, and ``Fp8KVPool``'s bfloat16 rope values; for a
            block-scaled pool the fp32 product of element and scale, cast).
        indices: per source, ``[T, K_i]`` int64 row indices into that pool (``-1`` = no key),
            or a :class:`PagedIndex` (its entries in entry order, as if listed explicitly).
        sinks: ``[H]`` float32 sink logits: joined to each head's softmax, then dropped.
        scale: softmax scale (``D**-0.5`` for V4).

    Returns:
        ``[T, H, D]`` in q's dtype: ``sum_k softmax([s_k..., sink])_k * v_k``; logits and
        softmax in fp32.  A query with no valid key returns zeros.

    Batch invariance: a query's result depends only on the sequence of its *valid* keys
    (sources in order, then columns), never on where or how many ``-1`` slots there are:
    the mode compacts the valid keys to the front and reduces them in fixed blocks of
    ``KEY_BLOCK`` keys with an online softmax (see :func:`_sparse_attention_blocked`).
    """
    indices = [_as_rows(idx) for idx in indices]
    if batch_invariant_enabled():
        return _sparse_attention_blocked(q, kv_pools, indices, sinks, scale)
    keys, valid = [], []
    for pool, idx in zip(kv_pools, indices, strict=True):
        keys.append(gather_rows(pool, idx, q.dtype))
        valid.append(idx >= 0)
    f32 = torch.float32
    kv = cast(torch.cat(keys, dim=1), f32)  # [T, K, D]
    bias = torch.where(torch.cat(valid, dim=1), 0.0, float("-inf")).unsqueeze(1)  # [T, 1, K]
    logits = torch.baddbmm(bias, cast(q, f32), kv.transpose(1, 2), alpha=scale)  # [T, H, K]
    sink = cast(sinks, f32).view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return cast(torch.bmm(probs, kv), q.dtype)


def _sparse_attention_blocked(
    q: torch.Tensor,
    kv_pools: Sequence[KVPool],
    indices: Sequence[torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Batch-invariant :func:`sparse_attention` (split-KV with a fixed split size).

    Each query's valid keys are compacted, in source-then-column order, to the front of its
    list (for the V4 window that is position order, however the window is split between
    the ring and this step's rows), padded to whole blocks of ``KEY_BLOCK`` keys and
    reduced block by block with an online softmax that starts from the sink (``m = sink``,
    ``l = 1``).  A block of padding leaves ``m``, ``l`` and the output bitwise unchanged, so
    the longest list in the batch does not matter.
    """
    keys, valid = [], []
    for pool, idx in zip(kv_pools, indices, strict=True):
        keys.append(gather_rows(pool, idx, q.dtype))  # dequantising is exact per element: no batch effect
        valid.append(idx >= 0)
    kv, ok = torch.cat(keys, dim=1).float(), torch.cat(valid, dim=1)  # [T, K, D], [T, K]
    t, h, d = q.shape
    order = torch.sort((~ok).to(torch.uint8), dim=1, stable=True).indices  # valid first
    nb = max(1, padded_len(ok.shape[1], KEY_BLOCK) // KEY_BLOCK)
    order = pad_cols(order, nb * KEY_BLOCK, 0)
    ok = pad_cols(ok.gather(1, order[:, : ok.shape[1]]), nb * KEY_BLOCK, False)
    kv = kv.gather(1, order.unsqueeze(-1).expand(-1, -1, d))  # [T, nb*KB, D]
    kv = kv.view(t, nb, KEY_BLOCK, d).transpose(0, 1).contiguous()  # [nb, T, KB, D]
    bias = torch.where(ok, 0.0, float("-inf")).view(t, nb, 1, KEY_BLOCK).transpose(0, 1).contiguous()
    qf = q.float()
    m = sinks.float().view(1, h, 1).expand(t, h, 1).contiguous()
    den = torch.ones_like(m)
    acc = qf.new_zeros(t, h, d)
    for b in range(nb):
        logits = torch.baddbmm(bias[b], qf, kv[b].transpose(1, 2), alpha=scale)  # [T, H, KB]
        m_new = torch.maximum(m, logits.amax(dim=-1, keepdim=True))
        p = torch.exp(logits - m_new)
        alpha = torch.exp(m - m_new)
        den = den * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, kv[b])
        m = m_new
    return cast(acc / den, q.dtype)


def _pool_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    gate = randn(g, 3, 8, 16)
    gate[0, :4] = float("-inf")
    return [((randn(g, 3, 8, 16, dtype=dtype), gate), {})]


@define_op("compress_pool", "attention", batch_invariant=True, sample_cases=_pool_cases)
@row_padded({"kv": 0.0, "gate": 0.0})
def compress_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling of compressor windows.

    Args:
        kv: ``[M, L, D]`` the L source rows of each of M windows (model dtype).
        gate: ``[M, L, D]`` float32 gate logits (position bias included; ``-inf`` = empty
            slot).

    Returns:
        ``[M, D]`` in kv's dtype: ``sum_l softmax_l(gate)[l] * kv[l]`` per channel, the
        softmax in fp32 and cast to kv's dtype before the weighted sum.
    """
    return (kv * cast(gate.softmax(dim=1, dtype=torch.float32), kv.dtype)).sum(dim=1)


def _topk_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    t, h, d, n = 5, 8, 16, 12
    cand = torch.arange(n).repeat(t, 1)
    cand[1, 6:] = -1
    cand[2, 2:] = -1
    paged = _paged_case(g, t, 3, 4)
    keys_mx = BlockScaledKVPool.from_values(randn(g, n, 32, dtype=dtype), "fp4_ue8m0")  # V4.1's MXFP4 keys
    return [
        ((randn(g, t, h, d, dtype=dtype), randn(g, t, h), randn(g, n, d, dtype=dtype), cand, 4, d**-0.5), {}),
        (
            (randn(g, t, h, d, dtype=dtype), randn(g, t, h), randn(g, n, d, dtype=dtype), paged, 4, d**-0.5),
            {},
        ),
        ((randn(g, t, h, 32, dtype=dtype), randn(g, t, h), keys_mx, paged, 4, 32**-0.5), {}),
        # head weights in the activation dtype, a column slice of a fused projection (as V4 passes)
        (
            (
                randn(g, t, h, d, dtype=dtype),
                randn(g, t, 3 * h, dtype=dtype)[:, h : 2 * h],
                randn(g, n, d, dtype=dtype),
                cand,
                4,
                d**-0.5,
            ),
            {},
        ),
    ]


@define_op("indexer_topk", "attention", batch_invariant=True, sample_cases=_topk_cases)
@row_padded({"q": 0.0, "weights": 0.0, "candidates": -1})
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: KVPool,
    candidates: torch.Tensor | PagedIndex,
    k: int,
    scale: float,
) -> torch.Tensor:
    """Lightning-indexer selection of compressed entries.

    Score of candidate ``c`` for query ``t``: ``sum_h weights[t,h] * relu(q[t,h]·key[c]) * scale``
    (fp32).  Keeps the ``k`` best valid candidates.  Ties are broken deterministically
    toward the earlier candidate column (stable descending sort), so the choice never
    depends on tensor length or batch composition.

    Args:
        q: ``[T, H, D]`` indexer queries; weights: ``[T, H]`` head weights (any float dtype and
            strides; read as float32).
        key_pool: ``[N, D]`` indexer keys, or a packed
            :class:`~deepinfer_core.ops.kv_format.PackedKVPool` of ``N`` rows of ``D`` (V4.1's
            MXFP4 keys with ``kv_cache_dtype="fp8"``), read as its rows dequantised to q's dtype.
        candidates: ``[T, C]`` int64 rows of ``key_pool`` each query may pick (``-1`` = none),
            or a :class:`PagedIndex` (columns = entries in order, ``C = max_count``).
        k: how many to keep; scale: score scale (``D**-0.5``).

    Returns:
        ``[T, min(k, C)]`` int64 chosen pool rows, best first; ``-1`` where fewer than
        ``k`` valid candidates exist.  In batch-invariant mode the picks come in candidate
        column order instead, so attention sees the same key sequence whether a query's
        entries went through the indexer or (every query having at most ``k``) not; the
        scores are computed in fixed blocks of ``KEY_BLOCK`` candidates.
    """
    candidates = _as_rows(candidates)
    if batch_invariant_enabled():
        scores = _indexer_scores_blocked(q, weights, key_pool, candidates, scale)
    else:
        f32 = torch.float32
        keys = cast(gather_rows(key_pool, candidates, q.dtype), f32)  # [T, C, D]
        scores = torch.bmm(cast(q, f32), keys.transpose(1, 2)).relu_().mul_(scale)  # [T, H, C]
        scores = torch.bmm(cast(weights, f32).unsqueeze(1), scores).squeeze(1)  # sum over heads: [T, C]
    valid = candidates >= 0
    scores = scores.masked_fill(~valid, float("-inf"))
    kk = min(k, candidates.shape[1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :kk]
    if batch_invariant_enabled():  # picks in column order: see the docstring
        order = order.sort(dim=-1).values
    picked = candidates.gather(1, order)
    return torch.where(valid.gather(1, order), picked, torch.full_like(picked, -1))


def _indexer_scores_blocked(
    q: torch.Tensor, weights: torch.Tensor, key_pool: KVPool, candidates: torch.Tensor, scale: float
) -> torch.Tensor:
    """Indexer scores ``[T, C]`` computed in fixed blocks of ``KEY_BLOCK`` candidate columns,
    so a score's GEMMs have the same shape whatever the batch's widest candidate list."""
    t, c = candidates.shape
    nb = max(1, padded_len(c, KEY_BLOCK) // KEY_BLOCK)
    cand = pad_cols(candidates, nb * KEY_BLOCK, -1)
    keys = gather_rows(key_pool, cand, q.dtype).float()  # [T, nb*KB, D]
    keys = keys.view(t, nb, KEY_BLOCK, -1).transpose(0, 1).contiguous()  # [nb, T, KB, D]
    qf, wf = q.float(), weights.float().unsqueeze(1)  # [T, H, D], [T, 1, H]
    blocks = []
    for b in range(nb):
        s = torch.bmm(qf, keys[b].transpose(1, 2)).relu_().mul_(scale)  # [T, H, KB]
        blocks.append(torch.bmm(wf, s).squeeze(1))  # [T, KB]
    return torch.cat(blocks, dim=1)[:, :c]
