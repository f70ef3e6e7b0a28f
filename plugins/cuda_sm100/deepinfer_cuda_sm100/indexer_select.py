"""``indexer_topk``'s selection by the fastest of four exact paths, by measurement.

- ``"triton"``: the radix select of :mod:`deepinfer_cuda_sm100.kernels.indexer` (one program
  per query row: four histogram passes, then the picks);
- ``"triton_rows"``: the row selection of :mod:`deepinfer_cuda_sm100.kernels.indexer_rows`
  for rows of at most :data:`~deepinfer_cuda_sm100.kernels.indexer_rows.ROW_MAX_COLUMNS`
  candidates (a program holds its row in registers and fixes the threshold bit by bit
  from counts, no histograms);
- ``"threshold"``: the same module's threshold path for few long rows (several programs per
  row: strided group maxima of unique 64-bit keys give a threshold, the few keys above it are
  sorted; :func:`~deepinfer_cuda_sm100.kernels.indexer.plan_select` decides its segments and
  keeps the radix select where the rows are short);
- ``"torch"``: ``torch.topk`` over 64-bit keys that make the order total -- the score's
  order-preserving integer image in the high 32 bits, ``C - 1 - column`` in the low 32 -- so
  equal scores rank by column (the earlier first), exactly the contract's stable descending
  order, whatever ``torch.topk`` does with ties of its own (there are none).  Many programs
  per row: faster where few rows hold many candidates (long contexts).

All four give the same picks in the same order (best first); batch-invariant mode (picks in
column order) and calls off the GPU keep the radix select.  A call takes the path the measured table of
this GPU's architecture (:mod:`deepinfer_cuda_sm100.kernel_choice`, op ``"indexer_select"``,
keyed by query rows ``T`` and candidates ``C``; re-measured by ``python
plugins/cuda_sm100/scripts/bench_attention.py --only indexer --write-choices``) found faster
at the nearest measured shape, Triton where none was measured.  Static shapes only: a
captured graph replays what it captured.

The scores themselves come from the Triton kernel or one of two TileLang ones, chosen the same
way (op ``"indexer_scores"``, keyed by candidate form, dtype, heads, head dim, ``T`` and ``C``;
:func:`choose_scores`): ``"tilelang"`` (:mod:`deepinfer_cuda_sm100.tl.indexer`: wgmma over key
rows gathered into shared memory, a token a CTA) and ``"tilelang_grouped"``
(:mod:`deepinfer_cuda_sm100.tl.indexer_grouped`: paged candidates, each gathered key block
serving several tokens of one request; bitwise the former).  TileLang only where it can compile
here, the call fits it, the engine is not in batch-invariant mode (TileLang and Triton sum over
heads in different orders) and the table measured it faster.
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.modes import batch_invariant_enabled
from deepinfer_cuda_sm100 import kernel_choice, tl
from deepinfer_cuda_sm100.tl import indexer as tl_indexer
from deepinfer_cuda_sm100.tl import indexer_grouped as tl_grouped
from deepinfer_cuda_sm100.tl.launch_args import TL_DTYPES

OP = "indexer_select"
"""The op name of the selection points in the measured table."""
PATHS = frozenset({"triton", "triton_rows", "threshold", "torch"})
SCORE_OP = "indexer_scores"
"""The op name of the scoring points in the measured table."""
SCORE_PATHS = frozenset({"triton", "tilelang", "tilelang_grouped"})


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """``[T, C]`` int64 keys whose descending order is the scores' stable descending order:
    the fp32 bits mapped to an order-preserving int32 (negative values' magnitude bits
    flipped), shifted up 32, plus ``C - 1 - column``."""
    t, c = scores.shape
    bits = scores.contiguous().view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    columns = torch.arange(c - 1, -1, -1, device=scores.device, dtype=torch.int64)
    return (ordered.to(torch.int64) << 32) | columns


def select_topk_torch(
    scores: torch.Tensor, k: int, candidates: torch.Tensor | PagedIndex | None = None
) -> torch.Tensor:
    """:func:`~deepinfer_cuda_sm100.kernels.indexer.select_topk` (best first) by ``torch.topk``
    on :func:`ordered_keys`: ``[T, min(k, C)]`` int64 pool rows, ``-1`` for a pick whose score
    is ``-inf`` (an invalid candidate)."""
    t, c = scores.shape
    kk = min(int(k), c)
    if t == 0 or kk == 0:
        return torch.empty((t, kk), dtype=torch.int64, device=scores.device)
    cols = torch.topk(ordered_keys(scores), kk, dim=1, sorted=True).indices
    if isinstance(candidates, PagedIndex):
        epp = candidates.entries_per_page
        pages = candidates.block_table[candidates.token_rows[:, None], cols // epp]
        rows = pages.to(torch.int64) * epp + cols % epp
    elif candidates is None:
        rows = cols
    else:
        rows = candidates.gather(1, cols).to(torch.int64)
    invalid = scores.gather(1, cols) == float("-inf")
    return rows.masked_fill(invalid, -1)


def choose_path(scores: torch.Tensor, candidates) -> str:
    """``"triton"``, ``"triton_rows"``, ``"threshold"`` or ``"torch"`` for the selection of
    ``scores`` (see the module docstring)."""
    if batch_invariant_enabled() or scores.device.type != "cuda":
        return "triton"
    from deepinfer_cuda_sm100.kernels import indexer_rows

    t, c = scores.shape
    kind = "paged" if isinstance(candidates, PagedIndex) else "rows"
    available = PATHS if indexer_rows.supports(c) else PATHS - {"triton_rows"}
    return kernel_choice.choose(
        OP, kind, "float32", 0, 0, t, c, kernel_choice.device_arch(scores.device), available
    )


def choose_scores(q, weights, key_pool, candidates) -> str:
    """``"triton"``, ``"tilelang"`` or ``"tilelang_grouped"`` for the scores of this call (see
    the module docstring)."""
    if batch_invariant_enabled() or q.device.type != "cuda":
        return "triton"
    if tl_indexer.supports(q, weights, key_pool, candidates) is not True:
        return "triton"
    if not tl.usable_for("indexer_topk", "the Triton indexer scores serve every call"):
        return "triton"
    t, h, d = q.shape
    paged = isinstance(candidates, PagedIndex)
    c = int(candidates.max_count) if paged else candidates.shape[1]
    available = SCORE_PATHS
    if tl_grouped.supports(q, weights, key_pool, candidates) is not True:
        available = available - {"tilelang_grouped"}
    return kernel_choice.choose(
        SCORE_OP, "paged" if paged else "rows", TL_DTYPES[q.dtype], h, d, t, c,
        kernel_choice.device_arch(q.device), available,
    )  # fmt: skip


def scores_of(q, weights, key_pool, candidates, scale) -> torch.Tensor:
    """The ``[T, C]`` fp32 scores by the path :func:`choose_scores` picks."""
    path = choose_scores(q, weights, key_pool, candidates)
    if path == "tilelang_grouped":
        return tl_grouped.indexer_scores(q, weights, key_pool, candidates, scale)
    if path == "tilelang":
        return tl_indexer.indexer_scores(q, weights, key_pool, candidates, scale)
    from deepinfer_cuda_sm100.kernels import indexer

    return indexer.indexer_scores(q, weights, key_pool, candidates, scale)


def indexer_topk(q, weights, key_pool, candidates, k, scale) -> torch.Tensor:
    """The op: the scores :func:`choose_scores` picks, then the selection :func:`choose_path`
    picks."""
    from deepinfer_cuda_sm100.kernels import indexer, indexer_rows

    scores = scores_of(q, weights, key_pool, candidates, scale)
    path = choose_path(scores, candidates)
    if path == "torch":
        return select_topk_torch(scores, k, candidates)
    if path == "triton_rows":
        return indexer_rows.select_topk_rows(scores, k, candidates)
    # the radix select unless the table measured the threshold path faster here
    return indexer.select_topk(scores, k, candidates, segments=None if path == "threshold" else 0)
