"""Balanced context parallelism (CP): one long prefill chunk shared by the ranks of a CP group.

The ranks of a CP group mirror one data-parallel replica: they run the same steps on the same
requests and keep bitwise identical caches.  In a step whose batch holds a prefill chunk of at
least :data:`CP_MIN_TOKENS` tokens, that chunk's rows are split into ``2 * C`` contiguous pieces
assigned zig-zag (rank ``i`` holds pieces ``i`` and ``2C - 1 - i``, :func:`balanced_pieces`), so
every rank carries the same causal-attention work (:func:`rank_costs`); every other row of the
step (decodes, short prefills) is computed by every rank.  A rank's *local rows* go through
the per-token work; what the caches need from every row is all-gathered and put back in natural
order (:func:`gather_natural`), so each rank writes the full cache state a single process would.
See ``docs/distributed.md`` ("Context parallelism") and :mod:`deepinfer_core.models.deepseek_v4.model`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

CP_MIN_TOKENS = 1024
"""Default shortest prefill chunk that a CP group splits over its ranks; shorter chunks are
computed by every rank (an all-gather per attention layer costs more than it saves there).  The
environment variable :data:`CP_MIN_TOKENS_ENV` overrides it when a model is built."""

CP_MIN_TOKENS_ENV = "DEEPINFER_CP_MIN_TOKENS"


def cp_min_tokens(env: Mapping[str, str] | None = None) -> int:
    """The CP threshold: ``$DEEPINFER_CP_MIN_TOKENS`` in ``env`` (default ``os.environ``) when
    set, else :data:`CP_MIN_TOKENS`; a one-line error naming the variable when not an integer >= 1."""
    env = os.environ if env is None else env
    raw = env.get(CP_MIN_TOKENS_ENV)
    if raw is None or not raw.strip():
        return CP_MIN_TOKENS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {CP_MIN_TOKENS_ENV}={raw!r}: expected an integer") from None
    if value < 1:
        raise ValueError(f"environment variable {CP_MIN_TOKENS_ENV}={raw!r}: must be >= 1")
    return value


# ---- the split -----------------------------------------------------------------------------
def piece_bounds(num_tokens: int, cp_size: int) -> list[int]:
    """The ``2 * cp_size + 1`` boundaries of the zig-zag pieces of ``num_tokens`` rows.

    Rank ``i``'s share (``num_tokens // C`` rows, one more for the first ``num_tokens % C``
    ranks) is cut into a front piece (``ceil(share / 2)`` rows, piece ``i``) and a back piece
    (the rest, piece ``2C - 1 - i``); front pieces are laid out in rank order from the start,
    back pieces in reverse rank order after them, so rank row counts differ by at most one.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    c = cp_size
    share = [num_tokens // c + (i < num_tokens % c) for i in range(c)]
    sizes = [-(-s // 2) for s in share] + [s // 2 for s in reversed(share)]
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return bounds


def piece_rank(piece: int, cp_size: int) -> int:
    """The rank holding zig-zag piece ``piece`` (of ``2 * cp_size``): ``i`` and ``2C - 1 - i``
    belong to rank ``i``."""
    return piece if piece < cp_size else 2 * cp_size - 1 - piece


def balanced_pieces(num_tokens: int, cp_size: int) -> list[torch.Tensor]:
    """Per rank, the rows (``0 .. num_tokens - 1``, ascending) the zig-zag split gives it."""
    b = piece_bounds(num_tokens, cp_size)
    out = []
    for i in range(cp_size):
        j = 2 * cp_size - 1 - i
        out.append(torch.cat([torch.arange(b[i], b[i + 1]), torch.arange(b[j], b[j + 1])]))
    return out


def contiguous_pieces(num_tokens: int, cp_size: int) -> list[torch.Tensor]:
    """Per rank, the rows of the naive split into ``cp_size`` contiguous pieces (for comparison)."""
    return [t for t in torch.arange(num_tokens).tensor_split(cp_size)]


def rank_costs(pieces: Sequence[torch.Tensor], start: int = 0) -> list[int]:
    """Causal attention work per rank: a query at position ``p`` attends ``p + 1`` keys (the
    chunk's rows are positions ``start, start + 1, ...``; ``start`` = the tokens already cached)."""
    return [int((rows + start + 1).sum()) for rows in pieces]


# ---- the step plan -------------------------------------------------------------------------
@dataclass
class CPPlan:
    """How one step's ``T`` rows are spread over a CP group of ``size`` ranks.

    Every rank holds ``L`` local rows (padded with other ranks' rows to the group's largest
    count: those are computed and discarded).  Gathering a per-row tensor stacks the ranks'
    ``[L, ...]`` tensors rank-major into ``[size * L, ...]``; row ``j`` of the step in natural
    order is stacked row ``gather_index[j]`` (its owner's; rows every rank computes are taken
    from rank 0's, so all ranks agree to the bit whatever their kernels did).

    Attributes:
        local_rows: ``[L]`` int64 natural row of each local row.
        gather_index: ``[T]`` int64 stacked row of each natural row.
        sample_index: ``[S]`` int64 ``gather_index`` of the step's sampling rows.
        num_local: ``L``; size, rank: the group's size and this rank's place in it.
        group: the CP process group.
        split: per split chunk, ``(first row, rows)`` (for logs and tests).
    """

    local_rows: torch.Tensor
    gather_index: torch.Tensor
    sample_index: torch.Tensor
    num_local: int
    size: int
    rank: int
    group: Any
    split: list[tuple[int, int]]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[L, ...]`` (this rank's local rows) -> ``[T, ...]`` every row, in natural order."""
        return gather_natural(x, self.gather_index, self.size, self.group)

    def gather_samples(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[L, ...]`` -> ``[S, ...]``: the sampling rows, each from its owner.  Only
        ``S`` rows per rank travel (not the whole step)."""
        s = self.sample_index.shape[0]
        owner, row = self.sample_index // self.num_local, self.sample_index % self.num_local
        mine = x.index_select(0, row)  # rows of other owners are placeholders, never picked
        stacked = all_gather_rows(mine, self.size, self.group)  # [size * S, ...]
        return stacked.index_select(0, owner * s + torch.arange(s, device=owner.device))


def plan_step(
    lengths: Sequence[int],
    split: Sequence[bool],
    sample_rows: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    group: Any,
    device: torch.device,
) -> CPPlan:
    """The :class:`CPPlan` of a step of requests of ``lengths`` rows each (in row order), whose
    chunks with ``split[i]`` set are spread zig-zag over the ``cp_size`` ranks."""
    c = cp_size
    t = sum(lengths)
    owner = torch.full((t,), -1, dtype=torch.int64)  # -1: every rank computes the row
    chunks: list[tuple[int, int]] = []
    offset = 0
    for n, s in zip(lengths, split, strict=True):
        if s:
            for i, rows in enumerate(balanced_pieces(n, c)):
                owner[offset + rows] = i
            chunks.append((offset, n))
        offset += n
    mine = (owner[None, :] == -1) | (owner[None, :] == torch.arange(c)[:, None])  # [C, T]
    counts = mine.sum(dim=1)
    num_local = int(counts.max())
    # a rank's rows first (ascending), then others' rows as padding
    order = torch.sort((~mine).to(torch.uint8), dim=1, stable=True).indices[:, :num_local]
    pos = mine.cumsum(dim=1) - 1  # index of each row in each rank's local list
    src = owner.clamp(min=0)
    gather_index = src * num_local + pos.gather(0, src[None, :]).squeeze(0)
    gather_index = gather_index.to(device)
    return CPPlan(
        local_rows=order[cp_rank].to(device),
        gather_index=gather_index,
        sample_index=gather_index.index_select(0, sample_rows.to(device)),
        num_local=num_local,
        size=c,
        rank=cp_rank,
        group=group,
        split=chunks,
    )


# ---- collectives ---------------------------------------------------------------------------
def all_gather_rows(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """Every rank's ``x`` ``[L, ...]`` (equal shapes), stacked rank-major: ``[size * L, ...]``."""
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    # all_gather_single: all_gather_into_tensor's name from torch 2.13 on (the old one warns)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)
    return out


def gather_natural(x: torch.Tensor, gather_index: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """All-gather ``x`` ``[L, ...]`` over ``group`` and reorder: ``[T, ...]`` with row ``j`` =
    stacked row ``gather_index[j]`` (see :class:`CPPlan`)."""
    return all_gather_rows(x, size, group).index_select(0, gather_index)
