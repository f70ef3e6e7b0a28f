"""The token filters of the draw: top-k then top-p, and min-p, as boolean keep masks."""

from __future__ import annotations

import torch


def top_k_top_p_keep(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Which tokens survive top-k then top-p, as a bool mask ``[B, V]`` in vocabulary order.

    Args:
        logits: ``[B, V]`` fp32 (already temperature-scaled).
        top_ks: ``[B]`` int64; ``<= 0`` = off.
        top_ps: ``[B]`` float; ``1`` = off.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    keep_sorted = _keep_sorted(sorted_logits, top_ks, top_ps)
    keep = torch.empty_like(keep_sorted)
    keep.scatter_(1, order, keep_sorted)
    return keep


def min_p_keep(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability under ``softmax(scaled)`` is at least ``min_p`` x the largest."""
    probs = torch.softmax(scaled, dim=-1)
    return probs >= min_ps[:, None] * probs.amax(dim=-1, keepdim=True)


def _keep_sorted(sorted_logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    V = sorted_logits.shape[-1]
    ranks = torch.arange(V, device=sorted_logits.device)
    k = torch.where(top_ks > 0, top_ks.clamp(max=V), torch.full_like(top_ks, V))
    keep = ranks[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly before each token
    keep &= before < top_ps[:, None]
    keep[:, 0] = True
    return keep
