"""What a drafter that follows the target is told after a step (:func:`computed_chunks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_core.engine.request import RequestStatus
from deepinfer_core.speculative.drafter import ComputedChunk

if TYPE_CHECKING:
    from deepinfer_core.engine.scheduler import SchedulerOutput


def computed_chunks(sched: SchedulerOutput, hidden: torch.Tensor | None = None) -> list[ComputedChunk]:
    """The positions each running request of ``sched`` computed and kept in that step (requests
    finished or preempted since are left out); ``hidden``: the step's hidden rows."""
    computed: list[ComputedChunk] = []
    row = 0
    for req, c in zip(sched.requests, sched.chunks, strict=True):
        first, row = row, row + c.num_tokens
        if req.status is not RequestStatus.RUNNING or req.block_table[: len(c.block_table)] != c.block_table:
            continue  # finished, or preempted since
        end = min(c.end_pos, req.num_computed_tokens)
        if end <= c.start_pos:
            continue
        assert req.seq_slot is not None
        computed.append(
            ComputedChunk(
                request_id=req.request_id,
                start_pos=c.start_pos,
                token_ids=req.token_slice(c.start_pos + 1, end + 1),
                hidden_row=first,
                sampled=c.sample and end == req.num_tokens - 1,
                seq_slot=req.seq_slot,
                block_table=list(req.block_table),
                table_key=(req.request_id, req.table_version),
                window_from=c.window_from,
                cached_until=c.cached_until,
                hidden=hidden,
            )
        )
    return computed
