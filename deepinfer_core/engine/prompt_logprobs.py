"""Prompt logprobs: which logits rows belong to whom, and the per-prompt-token entries.

A prefill chunk of a request with ``prompt_logprobs`` set is run with ``all_logits=True``: the
model runner then returns every row of that chunk (in order) instead of only the last one.
Row ``j`` of a chunk starting at position ``s`` is the distribution of the token at position
``s + j + 1``; for prompt tokens that gives ``{actual token: logprob}`` plus the top-k, from
``log_softmax`` of the raw logits (as vLLM).  The sampling row of such a chunk is its last row.

The values are computed on the logits' device (no host sync); the host reads each request's
``[rows, 2k + 2]`` results in one copy when they are recorded (prefill chunks with
``prompt_logprobs`` only, never a decode step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer_core.sampling.logprobs import top_logprobs
from deepinfer_core.sampling.transfer import host_to_device

if TYPE_CHECKING:
    from deepinfer_core.contract.batch import SeqChunk
    from deepinfer_core.engine.request import Request


def logit_rows(chunks: Sequence[SeqChunk]) -> tuple[list[int], list[int | None]]:
    """Where each chunk's logits are in the runner's output.

    Returns:
        ``(sample_rows, first_rows)``: the rows each sampling chunk samples from, in chunk
        order (its last token's; with ``num_draft`` drafts, one per verified position); and
        per chunk the first of its rows when it has ``all_logits``, else ``None``.
    """
    sample_rows: list[int] = []
    first_rows: list[int | None] = []
    row = 0
    for c in chunks:
        first_rows.append(row if c.all_logits else None)
        row += c.num_logit_rows
        if c.sample:
            if c.num_draft:
                sample_rows.extend(range(row - 1 - c.num_draft, row))
            else:
                sample_rows.append(row - 1)
    return sample_rows, first_rows


def record_prompt_logprobs(
    requests: Sequence[Request],
    chunks: Sequence[SeqChunk],
    logits: torch.Tensor,
    first_rows: Sequence[int | None],
) -> None:
    """Add the prompt logprobs computed by this step's ``all_logits`` chunks to their requests."""
    for req, chunk, first in zip(requests, chunks, first_rows, strict=True):
        if first is None or req.prompt_logprobs is None or req.params.prompt_logprobs is None:
            continue
        # positions p in the chunk whose next token p + 1 is a prompt token still missing
        lo = max(chunk.start_pos, len(req.prompt_logprobs) - 1)
        hi = min(chunk.end_pos, req.num_prompt_tokens - 1)
        if lo >= hi:
            continue
        rows = logits[first + lo - chunk.start_pos : first + hi - chunk.start_pos]
        targets = host_to_device(req.prompt_token_ids[lo + 1 : hi + 1], logits.device).long()
        k = req.params.prompt_logprobs
        entries = top_logprobs(rows, targets, [k] * (hi - lo))  # computed on the device ...
        req.add_prompt_logprobs(lo, [e for e in entries if e is not None])  # ... read here
