"""Attention ops: sparse multi-source MQA with sinks, compressor pooling, indexer top-k.

V4 attention is MQA with one shared K=V head.  Each query attends to an explicit list of
key rows drawn from several *sources* (the sliding-window ring, the current chunk's keys,
the compressed-entry pool), FlashMLA-sparse style: an index ``-1`` marks an unused slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ._cases import randn
from .registry import define_op


def _attn_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    t, h, d = 6, 4, 32
    pool_a, pool_b = randn(g, 20, d, dtype=dtype), randn(g, 9, d, dtype=dtype)
    idx_a = torch.randint(-1, 20, (t, 5), generator=g)
    idx_b = torch.randint(-1, 9, (t, 3), generator=g)
    idx_a[:, 0] = 0  # at least one valid key per query
    return [((randn(g, t, h, d, dtype=dtype), [pool_a, pool_b], [idx_a, idx_b], randn(g, h), d**-0.5), {})]


@define_op("sparse_attention", "attention", batch_invariant=True, sample_cases=_attn_cases)
def sparse_attention(
    q: torch.Tensor,
    kv_pools: Sequence[torch.Tensor],
    indices: Sequence[torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Single-KV-head attention over per-query key lists, with a per-head sink logit.

    Args:
        q: ``[T, H, D]`` queries.
        kv_pools: sources of key(=value) rows, each ``[N_i, D]`` in q's dtype.
        indices: per source, ``[T, K_i]`` int64 row indices into that pool; ``-1`` = no key.
        sinks: ``[H]`` float32 sink logits: joined to each head's softmax, then dropped.
        scale: softmax scale (``D**-0.5`` for V4).

    Returns:
        ``[T, H, D]`` in q's dtype: ``sum_k softmax([s_k..., sink])_k * v_k``; logits and
        softmax in fp32.  A query with no valid key returns zeros.
    """
    keys, valid = [], []
    for pool, idx in zip(kv_pools, indices, strict=True):
        keys.append(F.embedding(idx.clamp(min=0), pool))  # row gather (fastest on CPU)
        valid.append(idx >= 0)
    kv = torch.cat(keys, dim=1).float()  # [T, K, D]
    bias = torch.where(torch.cat(valid, dim=1), 0.0, float("-inf")).unsqueeze(1)  # [T, 1, K]
    logits = torch.baddbmm(bias, q.float(), kv.transpose(1, 2), alpha=scale)  # [T, H, K]
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.bmm(probs, kv).to(q.dtype)


def _pool_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    gate = randn(g, 3, 8, 16)
    gate[0, :4] = float("-inf")
    return [((randn(g, 3, 8, 16, dtype=dtype), gate), {})]


@define_op("compress_pool", "attention", batch_invariant=True, sample_cases=_pool_cases)
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
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def _topk_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    t, h, d, n = 5, 8, 16, 12
    cand = torch.arange(n).repeat(t, 1)
    cand[1, 6:] = -1
    cand[2, 2:] = -1
    return [
        ((randn(g, t, h, d, dtype=dtype), randn(g, t, h), randn(g, n, d, dtype=dtype), cand, 4, d**-0.5), {})
    ]


@define_op("indexer_topk", "attention", batch_invariant=True, sample_cases=_topk_cases)
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: torch.Tensor,
    candidates: torch.Tensor,
    k: int,
    scale: float,
) -> torch.Tensor:
    """Lightning-indexer selection of compressed entries.

    Score of candidate ``c`` for query ``t``: ``sum_h weights[t,h] * relu(q[t,h]·key[c]) * scale``
    (fp32).  Keeps the ``k`` best valid candidates.  Ties are broken deterministically
    toward the earlier candidate column (stable descending sort), so the choice never
    depends on tensor length or batch composition.

    Args:
        q: ``[T, H, D]`` indexer queries; weights: ``[T, H]`` float32 head weights.
        key_pool: ``[N, D]`` indexer keys.
        candidates: ``[T, C]`` int64 rows of ``key_pool`` each query may pick (``-1`` = none).
        k: how many to keep; scale: score scale (``D**-0.5``).

    Returns:
        ``[T, min(k, C)]`` int64 chosen pool rows, best first; ``-1`` where fewer than
        ``k`` valid candidates exist.
    """
    keys = F.embedding(candidates.clamp(min=0), key_pool).float()  # [T, C, D]
    scores = torch.bmm(q.float(), keys.transpose(1, 2)).relu_().mul_(scale)  # [T, H, C]
    scores = torch.bmm(weights.float().unsqueeze(1), scores).squeeze(1)  # sum over heads: [T, C]
    valid = candidates >= 0
    scores = scores.masked_fill(~valid, float("-inf"))
    kk = min(k, candidates.shape[1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :kk]
    picked = candidates.gather(1, order)
    return torch.where(valid.gather(1, order), picked, torch.full_like(picked, -1))
