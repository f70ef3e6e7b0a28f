"""Grammar masks and logits processors on every verified position of a speculative step: row
``i`` of a chunk sees the request's output plus its drafts ``d1 .. di``, as plain decoding would
after them (the matchers and processors advance over the drafts, then roll back)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.sampling.batch import SamplingBatch
from deepinfer_core.sampling.penalties import bitmask_words

if TYPE_CHECKING:
    from deepinfer_core.engine.logits_processing import LogitsProcessors
    from deepinfer_core.engine.request import Request
    from deepinfer_core.engine.structured import StructuredOutputs


def structured_rows(
    structured: StructuredOutputs,
    vocab: int,
    batch: SamplingBatch,
    reqs: list[Request],
    drafts: list[list[int]],
    owner: list[tuple[int, int]],
) -> None:
    """The packed token bitmask of every row: a request's matcher is advanced over its
    drafts one at a time (as far as the grammar accepts them) between the rows' fills,
    then rolled back.  Rows after a draft the grammar rejects stay unconstrained: that
    draft cannot be accepted, so their tokens are never used."""
    bitmask = torch.full((len(owner), bitmask_words(vocab)), -1, dtype=torch.int32)
    first_row = first_rows(owner)
    valid = {}
    for ci, req in enumerate(reqs):
        m = req.structured_matcher
        if m is not None:
            m.consume(req.output_token_ids[m.num_consumed :])
            valid[ci] = m.num_valid(drafts[ci]) if drafts[ci] else 0
    constrained: list[int] = []
    for i in range(1 + max((len(d) for d in drafts), default=0)):
        by_backend: dict[str, list[tuple[Any, int]]] = {}
        for ci, n_valid in valid.items():
            if i <= n_valid and i <= len(drafts[ci]):
                req = reqs[ci]
                if i:
                    req.structured_matcher.consume([drafts[ci][i - 1]])
                row = first_row[ci] + i
                by_backend.setdefault(req.params.structured_outputs.backend, []).append(
                    (req.structured_matcher, row)
                )
                constrained.append(row)
        for name, pairs in by_backend.items():
            structured.backend(name).fill_bitmasks(pairs, bitmask)
    for ci, n_valid in valid.items():
        if n_valid:
            reqs[ci].structured_matcher.rollback(min(n_valid, len(drafts[ci])))
    structured.finish(batch, bitmask, constrained)


def processor_rows(
    procs: LogitsProcessors,
    logits: torch.Tensor,
    reqs: list[Request],
    drafts: list[list[int]],
    owner: list[tuple[int, int]],
) -> torch.Tensor:
    """Logits processors on every row: each gets a request's new output tokens, then per
    verified position ``i`` its draft ``d_i`` and one ``apply`` over the rows at ``i``;
    afterwards the drafts are rolled back (``on_rollback``)."""
    order = procs.feed(reqs)
    first_row = first_rows(owner)
    with torch.inference_mode():
        for i in range(1 + max((len(d) for d in drafts), default=0)):
            for name in order:
                ids: list[str | None] = [None] * len(owner)
                any_row = False
                for ci, req in enumerate(reqs):
                    if name in req.logits_processors and i <= len(drafts[ci]):
                        if i:
                            procs.get(name).on_tokens(req.request_id, [drafts[ci][i - 1]])
                        ids[first_row[ci] + i] = req.request_id
                        any_row = True
                if any_row:
                    logits = procs.get(name).apply(logits, ids)
    for ci, req in enumerate(reqs):
        if drafts[ci]:
            for name in req.logits_processors:
                procs.get(name).on_rollback(req.request_id, len(drafts[ci]))
    return logits


def first_rows(owner: list[tuple[int, int]]) -> dict[int, int]:
    """The first logits row of each chunk, from the rows' ``(chunk, position)``."""
    first: dict[int, int] = {}
    for row, (ci, _) in enumerate(owner):
        first.setdefault(ci, row)
    return first
