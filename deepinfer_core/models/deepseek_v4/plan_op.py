"""The plans of a fixed-shape step as an op of the contract: ``deepseek_v4.fixed_step_plans``.

A fixed-shape step (a decode, verify or mixed graph's, :attr:`StepInputs.spans` ``None``)
derives every per-token plan from static ints and the device's O(batch) fields.  Its
reference, :func:`~.metadata.build_metadata`, does that in about ninety small PyTorch ops,
each a kernel launch of a captured graph; a backend may derive them in a few launches.  An
unpadded step's shapes follow the host's values (exactly the windows it closes), so it is not
this op's: the model builds its plans with :func:`~.metadata.build_metadata` directly.

The op joins the contract when this module is imported (the model module imports it); the
model falls back to the reference for an op table built before that (:func:`plans_op`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.contract.step_inputs import StepInputBuffers, StepInputs
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.registry import define_op

from .metadata import StepMetadata, build_metadata

NAME = "deepseek_v4.fixed_step_plans"
CASE_SLOTS = 8
"""Sequence slots of the conformance steps (:func:`sample_steps`); slot 8 is their trash slot."""
CASE_TRASH_PAGE = 99
"""The conformance steps' trash page."""


def plans_op(ops: OpTable | None) -> Callable[..., Any]:
    """``ops``'s ``deepseek_v4.fixed_step_plans`` (the reference without a table or when
    ``ops`` predates this module's import)."""
    try:
        return fixed_step_plans if ops is None else ops[NAME]
    except KeyError:
        return fixed_step_plans


def derive_plans(
    ops: OpTable | None,
    inputs: StepInputs,
    window: int,
    ratios: list[int],
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens: int = 0,
) -> StepMetadata:
    """A step's plans: a fixed-shape step's through ``ops``'s ``deepseek_v4.fixed_step_plans``
    (a backend may derive them in a few launches), an unpadded step's (shapes from the host's
    values) with :func:`~.metadata.build_metadata`."""
    if inputs.spans is None:
        plans = plans_op(ops)
        return plans(inputs, window, tuple(ratios), page_size, num_slots, trash_page, num_spec_tokens)
    return build_metadata(inputs, window, list(ratios), page_size, num_slots, trash_page, num_spec_tokens)


def step_case(
    chunks: list[SeqChunk],
    num_tokens: int,
    num_reqs: int,
    *,
    num_slots: int,
    max_pages: int,
    trash_page: int,
    max_end: int,
    prev_tokens: torch.Tensor | None = None,
    decoding: bool = False,
) -> StepInputs:
    """A fixed-shape step's inputs on the CPU, packed as the model runner packs them
    (``num_tokens`` / ``num_reqs`` with padding; the sampled rows are the real tokens')."""
    bufs = StepInputBuffers(num_tokens, num_reqs, num_slots, max_pages, trash_page, torch.device("cpu"))
    rows = list(range(sum(len(c.token_ids) for c in chunks)))
    return bufs.prepare(chunks, rows, prev_tokens, num_tokens, num_reqs, max_end, decoding=decoding)


def _chunk(slot: int, start: int, n: int, page_size: int, **kw) -> SeqChunk:
    pages = -(-(start + n) // page_size)
    table = [100 + 10 * slot + j for j in range(pages)]  # distinct pages per slot
    return SeqChunk(slot, list(range(7, 7 + n)), start, table, **kw)


def sample_steps(
    page_size: int, num_slots: int = CASE_SLOTS, max_pages: int = 8
) -> list[tuple[StepInputs, int]]:
    """Fixed-shape steps covering the plans' cases, each with its ``num_spec_tokens``: a decode
    bucket (positions closing windows and pages, an async pending token), verify steps with
    two and five drafts (the latter buffering more windows of the small ratio), a mixed step
    (prefill chunks, a prefix hit's replay and resume, decodes, padding), and a bucket of
    padding only."""
    trash = CASE_TRASH_PAGE
    end = max_pages * page_size
    ps = page_size
    geo = {"num_slots": num_slots, "max_pages": max_pages, "trash_page": trash, "max_end": end}
    prev = torch.tensor([41, 42, 43], dtype=torch.int64)
    decode = [
        _chunk(0, 3, 1, ps),
        _chunk(2, ps - 1, 1, ps),
        _chunk(5, 2 * ps + 6, 1, ps, prev_row=1),
        _chunk(6, 0, 1, ps),
    ]
    verify = [_chunk(1, 5, 3, ps, num_draft=2), _chunk(3, ps - 2, 3, ps, num_draft=2)]
    deep = [_chunk(1, ps - 3, 6, ps, num_draft=5), _chunk(6, 2 * ps + 1, 6, ps, num_draft=5)]
    mixed = [
        _chunk(0, 0, 9, ps),  # a prompt's first chunk
        _chunk(4, ps, ps + 3, ps, cached_until=2 * ps),  # a prefix hit's replay past its boundary
        _chunk(7, 2 * ps, 3, ps, cached_until=2 * ps, window_from=ps),  # resumes at its boundary
        _chunk(2, 4 * ps - 1, 1, ps, prev_row=0),
    ]
    return [
        (step_case(decode, 8, 9, **geo, prev_tokens=prev, decoding=True), 0),
        (step_case(verify, 9, 4, **geo, decoding=True), 2),
        (step_case(deep, 18, 4, **geo, decoding=True), 5),
        (step_case(mixed, sum(len(c.token_ids) for c in mixed) + 5, 6, **geo, prev_tokens=prev), 0),
        (step_case([], 4, 5, **geo, decoding=True), 0),
    ]


def plan_cases(geometries: tuple[tuple[int, tuple[int, ...], int], ...]):
    """The sample-case function of the op's :func:`sample_steps` at each ``(window, ratios,
    page_size)`` of ``geometries`` (the op's own cases; a backend's at the shapes it targets)."""

    def cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
        del g, dtype  # integer plans: the steps are fixed
        return [
            ((inputs, window, ratios, ps, CASE_SLOTS, CASE_TRASH_PAGE, spec), {})
            for window, ratios, ps in geometries
            for inputs, spec in sample_steps(ps)
        ]

    return cases


@define_op(NAME, "metadata", sample_cases=plan_cases(((8, (4, 8), 16), (6, (4,), 8), (8, (), 16))))
def fixed_step_plans(
    inputs: StepInputs,
    window: int,
    ratios: tuple[int, ...],
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens: int = 0,
) -> StepMetadata:
    """The :class:`~.metadata.StepMetadata` of a fixed-shape step (``inputs.spans`` is ``None``):
    :func:`~.metadata.build_metadata` of the same arguments, whose module docstring is the
    layout (positions, the sliding window's ring and chunk rows, per compress ratio the
    compressor's window plan and each query's paged entries).

    Shapes follow static ints only: ``T`` = ``inputs.num_tokens`` tokens, ``R`` =
    ``inputs.num_reqs`` requests (padding included), per ratio ``r`` ``min(T, T // r + R)``
    windows of which the first ``live`` are real.  A ``decoding`` step leaves out the prefix
    hits' carry restores.  Every output is an int64 tensor (``real_tokens`` bool), equal bit
    for bit to the reference's; no value is read back to the host, so a graph may capture it.
    """
    if inputs.spans is not None:
        raise ValueError("fixed_step_plans takes a fixed-shape step (inputs.spans None): use build_metadata")
    return build_metadata(inputs, window, list(ratios), page_size, num_slots, trash_page, num_spec_tokens)
