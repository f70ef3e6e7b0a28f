"""Per-step plans of DeepSeek-V4.1: V4's, plus the full-resolution (ratio 1) entry plan.

The window rows, and for each compress ratio ``r > 1`` the compressor's window plan and each
query's visible entries, are exactly V4's (:func:`~deepinfer_core.models.deepseek_v4.metadata.
build_metadata`: V4.1's ratio-2 compressor is V4's non-overlapping one without a position
bias).  A ratio-1 kv source (the CED decoder's, layer 20 of the release) projects one entry per
token: :class:`FullPlan` gives each token's pool row and each query's visible entries (those of
positions ``<= t``).  Engram layers read each token's look-back ids: :class:`LookbackPlan`.
With the decoder-side prefill tail on, the layers after the last kv source run only on some of
the step's rows: :class:`TailPlan`.  A DSpark block step (the drafter's rows, non-causal inside
a block) has its own window plan: :func:`build_dspark_metadata`.  Everything is derived on the
device from shapes alone, as V4's plans.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer_core.contract.step_inputs import StepInputs
from deepinfer_core.models.deepseek_v4.metadata import StepMetadata, build_metadata
from deepinfer_core.models.deepseek_v4.plan_op import derive_plans
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.attention import PagedIndex


@dataclass
class FullPlan:
    """Entries of a ratio-1 kv source: one per token.

    ``dest`` ``[T]``: the pool row of each token's entry (page of its position in its request's
    block table), or a trash-page row for a token before its request's prefix-cache boundary
    (its entry is cached; replayed tokens never rewrite it); ``entries``: each query's visible
    entries, positions ``0..t``.
    """

    dest: torch.Tensor
    entries: PagedIndex


@dataclass
class LookbackPlan:
    """Where each token's Engram look-back ids come from.

    The ids of a request's last ``R = K + S`` positions (``K`` look-back ids, ``S`` draft tokens)
    wait in a per-slot ring (``[slots + 1, R]``, position ``q`` at ``slot*R + q % R``), so each
    request carries its own history: interleaved requests never share one, and with async
    scheduling the ids stay on the device.  ``src`` ``[T, K]``: for look-back ``s`` (column
    ``s - 1``) of each token, an index into ``[this step's ids (T) ; the flat ring]``, or ``-1``
    (the pad id) before the request's start or its replay start (``window_from``);
    ``ring_rows`` ``[T]``: the ring row each token's id is written to (the trash slot's for all
    but a chunk's last ``R`` positions, so the writes are distinct).
    """

    src: torch.Tensor
    ring_rows: torch.Tensor


@dataclass
class V41StepMetadata:
    """V4's plans (``v4``: window rows, ratio > 1 compressor plans) plus the ratio-1 plan and the
    Engram look-back plan."""

    v4: StepMetadata
    full: FullPlan | None
    lookback: LookbackPlan | None = None
    tail: TailPlan | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        return self.v4.input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self.v4.positions

    @property
    def sample_rows(self) -> torch.Tensor:
        return self.v4.sample_rows

    def entries(self, ratio: int) -> PagedIndex:
        """Each query's visible entries of ratio ``ratio`` (``(t + 1) // ratio`` of them)."""
        if ratio == 1:
            assert self.full is not None
            return self.full.entries
        return self.v4.plans[ratio].entries


@dataclass
class TailPlan:
    """The rows the decoder layers (those after the last kv source) run on in a step with the
    decoder-side prefill tail (see :func:`tail_plan`).

    ``rows`` ``[K]``: the step rows kept, in step order (padding past the real ones: row 0,
    which sees no window key and writes the trash slot's ring); ``md``: the plans of the kept
    rows for those layers: window keys renumbered into the kept rows (and masked below each
    request's tail start), ring rows, visible entries, and ``sample_rows`` as kept-row indices.
    Its compressor plans are the step's and serve no layer (decoder layers are no kv sources).
    """

    rows: torch.Tensor
    md: V41StepMetadata


def tail_plan(
    inputs: StepInputs, md: V41StepMetadata, window: int, tail: int, num_slots: int, num_spec_tokens: int = 0
) -> TailPlan | None:
    """Which rows the decoder layers run on, keeping at most ``tail`` rows of each request.

    Request ``i`` (chunk ``[start, end)``) keeps the rows at positions ``>= k0 = min(end - tail,
    first sampled position)``: its chunk's last ``tail`` rows, and every row whose logits are
    wanted (prompt logprobs: every row, the exact full prefill).  When ``k0 > start`` the tail
    starts inside the chunk and the decoder layers' window keys below ``k0`` are treated as
    absent (they were never computed); otherwise the request's window is the usual one (keys
    from ``window_from``: a chunk shorter than the tail reads the previous chunk's last
    ``tail >= W`` rows, all computed).  ``None`` when every row is kept whatever the values
    (the step has at most ``tail`` tokens, or as many logit rows as tokens: decode and verify
    steps, graphs included), so those steps run unchanged.  The kept rows are gathered into a
    static ``K = min(T, R * tail + N)`` rows (``R`` requests, ``N`` logit rows: a request keeps
    at most ``tail`` rows plus its logit rows, which are a suffix of its chunk): no host sync.
    """
    t, n_req, n_s = inputs.num_tokens, inputs.num_reqs, inputs.sample_rows.shape[0]
    if t <= tail or n_s >= t or n_req == 0:
        return None
    k = min(t, n_req * tail + n_s)
    req = inputs.req
    dev = inputs.input_ids.device
    slot, start = req["slot"], req["start"]
    end = start + req["len"]
    cum = torch.cumsum(req["len"], 0)
    offset = cum - req["len"]
    tok_req = torch.searchsorted(cum, torch.arange(t, device=dev), right=True).clamp_(max=n_req - 1)
    pos = md.positions
    srows = inputs.sample_rows
    s_req, s_pos = tok_req.index_select(0, srows), pos.index_select(0, srows)
    first = end.clone().scatter_reduce_(0, s_req, s_pos, "amin")  # first logit row's position
    k0 = torch.minimum(end - tail, first)
    lo = torch.maximum(k0, start)  # first kept position
    keys_from = torch.where(k0 > start, k0, req["window_from"])
    kept = end - lo
    kcum = torch.cumsum(kept, 0)
    koff = kcum - kept
    j = torch.arange(k, device=dev)
    jreq = torch.searchsorted(kcum, j, right=True).clamp_(max=n_req - 1)
    live = j < kcum[-1]
    jpos = torch.where(live, lo[jreq] + j - koff[jreq], pos[0])
    rows = torch.where(live, offset[jreq] + jpos - start[jreq], 0)
    kpos = jpos[:, None] - (window - 1) + torch.arange(window, device=dev)
    valid = live[:, None] & (kpos >= keys_from[jreq][:, None])
    in_chunk = kpos >= start[jreq][:, None]
    none = torch.full_like(kpos, -1)
    window_chunk = torch.where(valid & in_chunk, koff[jreq][:, None] + kpos - lo[jreq][:, None], none)
    ring_n = window + num_spec_tokens
    window_ring = torch.where(valid & ~in_chunk, slot[jreq][:, None] * ring_n + kpos % ring_n, none)
    ring_rows = torch.where(live, md.v4.ring_rows.index_select(0, rows), num_slots * ring_n)
    samples = koff.index_select(0, s_req) + s_pos - lo.index_select(0, s_req)
    v4 = replace(
        md.v4,
        input_ids=md.v4.input_ids.index_select(0, rows),
        positions=jpos,
        window_ring=window_ring,
        window_chunk=window_chunk,
        ring_rows=ring_rows,
        plans={r: replace(p, entries=p.entries.select(rows)) for r, p in md.v4.plans.items()},
        sample_rows=samples,
        cp=None,
        local=None,
    )
    full = None
    if md.full is not None:
        full = FullPlan(dest=md.full.dest.index_select(0, rows), entries=md.full.entries.select(rows))
    return TailPlan(rows=rows, md=V41StepMetadata(v4=v4, full=full))


def build_v41_metadata(
    inputs: StepInputs,
    window: int,
    ratios: list[int],
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens: int = 0,
    lookback: int = 0,
    tail: int | None = None,
    ops: OpTable | None = None,
) -> V41StepMetadata:
    """The step's plans for compress ``ratios`` (0 and duplicates ignored); with ``lookback >
    0`` the Engram look-back of that many ids (:class:`LookbackPlan`); with ``tail`` the rows
    the decoder layers run on (:func:`tail_plan`).  V4's part of a fixed-shape step comes from
    ``ops``'s ``deepseek_v4.fixed_step_plans`` (:func:`~deepinfer_core.models.deepseek_v4.
    plan_op.derive_plans`; its reference without ``ops``)."""
    md = _build(inputs, window, ratios, page_size, num_slots, trash_page, num_spec_tokens, lookback, ops)
    if tail is not None:
        md.tail = tail_plan(inputs, md, window, tail, num_slots, num_spec_tokens)
    return md


def _build(
    inputs: StepInputs,
    window: int,
    ratios: list[int],
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens: int,
    lookback: int,
    ops: OpTable | None,
) -> V41StepMetadata:
    pooled = sorted({r for r in ratios if r > 1})
    v4 = derive_plans(ops, inputs, window, pooled, page_size, num_slots, trash_page, num_spec_tokens)
    if 1 not in ratios and lookback == 0:
        return V41StepMetadata(v4=v4, full=None)
    t, n_req = inputs.num_tokens, inputs.num_reqs
    req = inputs.req
    dev = inputs.input_ids.device
    cum = torch.cumsum(req["len"], 0)
    tok = torch.arange(t, device=dev)
    tok_req = torch.searchsorted(cum, tok, right=True).clamp_(max=max(n_req - 1, 0))
    pos = v4.positions
    full = None
    if 1 in ratios:
        tables = inputs.block_tables.index_select(0, req["slot"])  # [R, P]
        col = (pos // page_size).clamp(max=tables.shape[1] - 1)
        page = tables[tok_req, col]
        live = pos >= req["cached"][tok_req]
        dest = torch.where(live, page * page_size + pos % page_size, trash_page * page_size)
        entries = PagedIndex(
            block_table=tables,
            token_rows=tok_req,
            counts=pos + 1,
            entries_per_page=page_size,
            max_count=inputs.max_end,
        )
        full = FullPlan(dest=dest, entries=entries)
    plan = None
    if lookback:
        rows = lookback + num_spec_tokens  # ring rows per slot
        slot, start = req["slot"][tok_req], req["start"][tok_req]
        end = start + req["len"][tok_req]
        q = pos[:, None] - torch.arange(1, lookback + 1, device=dev)  # [T, K]
        in_chunk = q >= start[:, None]
        in_ring = ~in_chunk & (q >= req["window_from"][tok_req][:, None]) & (q >= 0)
        ring = t + slot[:, None] * rows + q % rows
        src = torch.where(in_chunk, tok[:, None] - (pos[:, None] - q), torch.where(in_ring, ring, -1))
        ring_rows = torch.where(pos >= end - rows, slot, num_slots) * rows + pos % rows
        plan = LookbackPlan(src=src, ring_rows=ring_rows)
    return V41StepMetadata(v4=v4, full=full, lookback=plan)


def build_dspark_metadata(
    inputs: StepInputs,
    window: int,
    block: int,
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens: int = 0,
) -> V41StepMetadata:
    """The plans of a DSpark block step: each chunk is one request's block (at most ``block``
    rows) anchored at its start ``P`` (the anchor's position; ``window_from`` as in a target step).

    Every row of a request sees the same context keys, its draft rings' rows of positions
    ``[max(P - W, window_from, 0), P - 1]`` (``window_ring``, ``[T, W]``), and every row of its
    block (``window_chunk``, ``[T, block]``: non-causal inside the block).  ``ring_rows`` are
    the trash slot's (the block writes no request's ring); ``sample_rows`` are the inputs'.
    """
    v4 = build_metadata(inputs, window, [], page_size, num_slots, trash_page, num_spec_tokens)
    t, n_req = inputs.num_tokens, inputs.num_reqs
    req = inputs.req
    dev = inputs.input_ids.device
    cum = torch.cumsum(req["len"], 0)
    offset = cum - req["len"]
    tok_req = torch.searchsorted(cum, torch.arange(t, device=dev), right=True).clamp_(max=max(n_req - 1, 0))
    anchor = req["start"][tok_req]
    kpos = anchor[:, None] - window + torch.arange(window, device=dev)  # P-W .. P-1
    valid = (kpos >= req["window_from"][tok_req][:, None]) & (kpos >= 0)
    rows = window + num_spec_tokens
    none = torch.full_like(kpos, -1)
    window_ring = torch.where(valid, req["slot"][tok_req][:, None] * rows + kpos % rows, none)
    j = torch.arange(block, device=dev)
    in_block = j[None, :] < req["len"][tok_req][:, None]
    window_chunk = torch.where(in_block, offset[tok_req][:, None] + j, -1)
    ring_rows = num_slots * rows + v4.positions % rows
    v4 = replace(v4, window_ring=window_ring, window_chunk=window_chunk, ring_rows=ring_rows)
    return V41StepMetadata(v4=v4, full=None)
