"""``indexer_topk`` in one TileLang launch for prefill rows: the grouped scores kernel
(:mod:`deepinfer_cuda_sm100.tl.indexer_grouped`) built with ``select``, so each CTA, having
scored its two tokens' whole rows, also picks their top ``k``
(:mod:`deepinfer_cuda_sm100.tl.group_topk_device`) instead of a second launch reading the
scores back.

It takes paged candidates of at most
:data:`~deepinfer_cuda_sm100.tl.group_topk_device.MAX_COLUMNS` entries a row (a CTA spans the
row: every block of 128 entries) and at most :data:`~deepinfer_cuda_sm100.tl.group_topk_device.
MAX_K` picks.  The scores are the grouped kernel's, bit for bit (the same build up to the
selection after them), and the picks those of every selection path: the top ``min(k, count)``
of a token's entries, best first, equal scores by the earlier entry, ``-1`` past them.  The
dispatcher (:mod:`deepinfer_cuda_sm100.indexer_select`) runs it where the measured table found
it faster than the scores and the selection apart.
"""

import torch

from deepinfer_core.ops.attention import PagedIndex

from . import group_topk_device
from . import indexer_grouped as grouped
from .indexer import BN
from .pdl import tl_pdl_enabled

BLOCKS = group_topk_device.MAX_COLUMNS // BN
"""Blocks a CTA spans: a whole row of the longest it takes."""


def configuration() -> tuple:
    """The options (after ``dtype``) of :func:`~deepinfer_cuda_sm100.tl.indexer_grouped.
    build_grouped_scores` the fused launch runs: the default group, warpgroups and overlap,
    a whole row a CTA, selecting."""
    return (BLOCKS, 2, tl_pdl_enabled(), grouped.WARPGROUPS, grouped.overlaps(2), True)


def supports(q, weights, key_pool, candidates, k: int) -> bool | str:
    """``True`` when the fused launch takes this call: one the grouped scores take, whose rows
    a CTA spans and whose picks its shared memory holds; else why not (one line)."""
    problem = grouped.supports(q, weights, key_pool, candidates)
    if problem is not True:
        return problem
    c = int(candidates.max_count)
    if c > group_topk_device.MAX_COLUMNS:
        return f"{c} candidates a row: the in-CTA selection takes at most {group_topk_device.MAX_COLUMNS}"
    if min(int(k), c) > group_topk_device.MAX_K:
        return f"{min(int(k), c)} picks a row: the in-CTA selection takes at most {group_topk_device.MAX_K}"
    return True


def indexer_topk(q, weights, key_pool, candidates: PagedIndex, k: int, scale: float) -> torch.Tensor:
    """The op on a call :func:`supports` takes: ``[T, min(k, C)]`` int64 pool rows, best first
    (``C``: ``candidates.max_count``)."""
    t, c = q.shape[0], int(candidates.max_count)
    picks = torch.empty((t, min(int(k), c)), dtype=torch.int64, device=q.device)
    if t == 0 or picks.shape[1] == 0:
        return picks
    scores = torch.empty((t, c), dtype=torch.float32, device=q.device)  # the kernel's scratch
    grouped.launch(q, weights, key_pool, candidates, scale, scores, configuration(), picks)
    return picks
