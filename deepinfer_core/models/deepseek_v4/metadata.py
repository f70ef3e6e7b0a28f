"""Per-step index plans of a flat varlen batch, derived on the device.

From the host's O(batch) scalars (:class:`~deepinfer_core.contract.step_inputs.StepInputs`)
this builds, with torch ops only, every per-token plan the layers share: positions, the
sliding-window key rows, and per compress ratio the compressor's window plan and each
query's paged entry list.  All shapes depend only on static ints (tokens, requests, the
bound on positions), never on tensor values, and nothing reads a value back to the host, so
a decode step can be captured in a CUDA graph.  Rows that a plan does not need (tokens that
leave no ring row, windows beyond those closed this step, requests without a carry to
restore) point at the cache's *trash* slot / page instead of being filtered out.

Speculative decoding.  A verify step runs ``1+k`` tokens of a request (positions
``p..p+k``, ``k <= S`` with ``S = num_spec_tokens``); the engine then accepts a prefix
``p..p+a`` and simply continues at ``p+a+1``: no cache operation undoes what the rejected
positions wrote.  So the per-slot state is laid out such that nothing a rejected position
writes is read before it is rewritten (with ``S = 0`` every formula below reduces to the
plain layout, bit for bit):

* window ring: ``W + S`` rows per slot, row of position ``q``: ``slot*(W+S) + q % (W+S)``;
  queries still see the last ``W`` positions, and a step writes the rows of its last
  ``W + S`` positions, so a rejected position never lands on a row the window still needs.
* compressor partial-window buffer (per ratio ``r``): ``nb = 1 + ceil(S/r)`` windows per
  slot (:func:`buffer_windows`), ``nb*r`` rows, row ``slot*nb*r + q % (nb*r)``; a step
  writes every token of the last ``nb`` windows it touches (``q >= (end//r - nb + 1)*r``),
  so the accepted tokens of a window that rejected tokens closed are still buffered.
* CSA overlap carry: ``nb`` carries per slot, window ``w``'s at row ``slot*nb + w % nb``;
  a step saves the carries of the last ``nb`` windows it closes per request (others go to
  the trash slot), and window ``w`` reads ``w-1``'s at ``(w-1) % nb``.
* compressed entries and indexer keys need nothing: an entry of a window closed by rejected
  tokens is invisible to every query (position ``t`` sees entries ``w < (t+1)//r``) until
  the window closes again and rewrites it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer_core.contract.step_inputs import REQ_FIELDS, StepInputs
from deepinfer_core.models.context_parallel import CPPlan, plan_step
from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.cast import cast

from .plan_tensors import kept, kept_arange, kept_scalar
from .window_plans import StepView, WindowPlan, buffer_windows, window_plans

__all__ = [
    "LocalRows",
    "StepMetadata",
    "WindowPlan",
    "buffer_windows",
    "build_metadata",
    "with_context_parallel",
]


@dataclass
class StepMetadata:
    """Everything the layers need to run one step of a flat batch (``T`` token rows)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    window_ring: torch.Tensor  # [T, W] ring rows (-1 none); the ring has W+S rows per slot
    window_chunk: torch.Tensor  # [T, W] token rows of this step (-1 none)
    ring_rows: torch.Tensor  # [T] ring row each token's key is written to (trash if none)
    plans: dict[int, WindowPlan]
    sample_rows: torch.Tensor  # [S] token rows whose logits are wanted
    num_slots: int  # real slots; slot num_slots is the trash slot
    real_tokens: torch.Tensor | None = None  # [T] bool: the row belongs to a request (not padding)
    # context parallelism (None: this rank computes every row): the step's row split, and the
    # per-query plans of this rank's local rows (see with_context_parallel)
    cp: CPPlan | None = None
    local: LocalRows | None = None


@dataclass
class LocalRows:
    """The per-query plans of a context-parallel rank's ``L`` local rows (:attr:`CPPlan.local_rows`):
    the rows of :class:`StepMetadata`'s per-token tensors that this rank computes.  Everything a
    cache needs (window keys, compressor plans) stays in natural order over all ``T`` rows."""

    input_ids: torch.Tensor  # [L]
    positions: torch.Tensor  # [L]
    window_ring: torch.Tensor  # [L, W]
    window_chunk: torch.Tensor  # [L, W] rows of the step (natural order, all ranks' rows)
    real_tokens: torch.Tensor | None  # [L] bool: the row belongs to a request (not padding)
    entries: dict[int, PagedIndex]  # per ratio, the local queries' visible entries


def build_metadata(
    inputs: StepInputs,
    window: int,
    ratios: list[int],
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens: int = 0,
) -> StepMetadata:
    """Derive the step's plans on the inputs' device (see the module docstring).

    ``num_spec_tokens`` (``S``): the most draft tokens of a verify step; it sets the ring's
    and the compressor state's geometry and must equal the value the caches were built with.
    ``page_size`` must be a multiple of every ratio (a page holds whole compressed entries).

    Every op here is a kernel launch of its own (in a captured decode graph too) on a handful
    of integers, so the plans are derived in few of them: each token's request fields come
    with one gather, the per-token plans of all ratios are computed together (``[ratios, T]``,
    a plan reads its row) as are the window plans of the ratios that close as many windows,
    and tensors that depend only on static ints are made once and kept (:func:`~.plan_tensors.kept`).
    """
    bad = [r for r in ratios if page_size % r]
    if bad:
        raise ValueError(f"page_size {page_size} is not a multiple of the compress ratios {bad}")
    t, n_req = inputs.num_tokens, inputs.num_reqs
    dev = inputs.input_ids.device
    fields = inputs.fields()  # [F, R] (a view of the packed buffer)
    slot, start, length = (fields[REQ_FIELDS.index(n)] for n in ("slot", "start", "len"))
    end = start + length
    tok = kept_arange(t, dev)
    rows = window + num_spec_tokens  # ring rows per slot: W + S
    decode = inputs.one_token_each()
    if decode:  # token i is request i's only one: no gathers
        tok_req, per_token, pos, d = tok, fields, start, None
    else:
        # d: a request's first token row minus its start position (row = pos + d); cum: its
        # chunk's end row
        d_cum = torch.empty((2, n_req), dtype=torch.int64, device=dev)
        cum = torch.cumsum(length, 0, out=d_cum[1])
        d = torch.sub(cum, end, out=d_cum[0])
        # the last boundary left out: a token past every other request's is the last one's
        # (as with all of them, clamped to R-1: cum is sorted)
        tok_req = torch.searchsorted(cum[:-1], tok, right=True)
        per_token = fields.index_select(1, tok_req)  # [F, T]: each token's request fields
        d_t, cum_t = d_cum.index_select(1, tok_req).unbind(0)
        pos = tok - d_t
    slot_t, start_t, from_t, prev_row_t = (
        per_token[REQ_FIELDS.index(n)] for n in ("slot", "start", "window_from", "prev_row")
    )
    ids = inputs.input_ids
    if inputs.prev_tokens is not None and inputs.prev_tokens.shape[0]:  # async: tokens on the device
        src = cast(inputs.prev_tokens.index_select(0, prev_row_t.clamp(min=0)), ids.dtype)
        pending = prev_row_t >= 0  # the pending token is the first of its request's chunk
        if not decode:
            pending &= pos == start_t
        ids = torch.where(pending, src, ids)

    # sliding window: keys at positions pos-W+1 .. pos, of this step's chunk (from its start)
    # or of earlier steps (in the ring), none before the request's window_from
    ahead = kept(("window", window), dev, lambda: torch.arange(1 - window, 1, device=dev))
    kpos = pos.unsqueeze(1) + ahead
    before = kpos < from_t.unsqueeze(1)
    # (a decode step's chunk is the token itself)
    earlier = kept(("window<0", window), dev, lambda: ahead < 0) if decode else kpos < start_t.unsqueeze(1)
    # a key of the chunk is in the token row of its position: kpos + d = tok + (kpos - pos)
    window_chunk = (tok.unsqueeze(1) + ahead).masked_fill_(before | earlier, -1)
    ring = kpos % rows
    # (before >= earlier) == not (a valid key before the chunk)
    window_ring = torch.add(ring, slot_t.unsqueeze(1), alpha=rows).masked_fill_(before >= earlier, -1)
    # a chunk's last W+S positions leave their key in the ring (distinct rows); others, the
    # trash slot's: pos < end - rows, i.e. cum > tok + rows (a decode token is its chunk's last)
    ring_slot = slot_t
    if not decode:
        ring_slot = torch.where(
            cum_t > kept_arange(t + rows, dev)[rows:], kept_scalar(num_slots, dev), slot_t
        )
    ring_rows = torch.add(ring[:, -1] if window else pos % rows, ring_slot, alpha=rows)

    tables = inputs.block_tables.index_select(0, slot)  # [R, P]
    step = StepView(inputs, fields, end, d, tables, tok_req, pos, per_token, num_slots, page_size, trash_page)
    plans = window_plans(step, sorted(set(ratios)), num_spec_tokens)
    return StepMetadata(
        input_ids=ids,
        positions=pos,
        window_ring=window_ring,
        window_chunk=window_chunk,
        ring_rows=ring_rows,
        plans=plans,
        sample_rows=inputs.sample_rows,
        num_slots=num_slots,
        real_tokens=slot_t < num_slots,
    )


def with_context_parallel(
    md: StepMetadata, inputs: StepInputs, cp_size: int, cp_rank: int, group, min_tokens: int
) -> StepMetadata:
    """``md`` with a context-parallel plan when the step holds a chunk of at least ``min_tokens``
    rows of a real request (not the trash slot's padding): such chunks are split zig-zag over
    the ``cp_size`` ranks of ``group`` (:func:`~deepinfer_core.models.context_parallel.plan_step`);
    ``md`` unchanged otherwise.

    Needs the chunk lengths on the host: one small device-to-host copy, made only when the step
    has at least ``min_tokens`` tokens at all (so not in ordinary decode steps) and never under
    graph capture.
    """
    if cp_size <= 1 or inputs.num_tokens < min_tokens:
        return md
    dev = md.positions.device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return md
    lengths, slots = torch.stack([inputs.req["len"], inputs.req["slot"]]).tolist()
    split = [n >= min_tokens and s != md.num_slots for n, s in zip(lengths, slots, strict=True)]
    if not any(split):
        return md
    plan = plan_step(lengths, split, md.sample_rows, cp_size, cp_rank, group, dev)
    rows = plan.local_rows
    local = LocalRows(
        input_ids=md.input_ids.index_select(0, rows),
        positions=md.positions.index_select(0, rows),
        window_ring=md.window_ring.index_select(0, rows),
        window_chunk=md.window_chunk.index_select(0, rows),
        real_tokens=None if md.real_tokens is None else md.real_tokens.index_select(0, rows),
        entries={r: p.entries.select(rows) for r, p in md.plans.items()},
    )
    return replace(md, cp=plan, local=local)
