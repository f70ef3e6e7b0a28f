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


@dataclass
class WindowPlan:
    """The compressor work of one step for one compress ratio ``r`` (``M`` window rows).

    Each slot buffers ``nb`` windows (``nb*r`` rows, :func:`buffer_windows`) and keeps ``nb``
    overlap carries (see the module docstring); ``N`` = real slots + the trash slot.  Staging
    rows are ``[buffer rows of all slots (N*nb*r) ; this step's token rows]``.  ``windows``
    ``[M, r]`` are the staging rows of each window closed this step (position ``q`` of an
    earlier step: buffer row ``slot*nb*r + q % (nb*r)``; padding windows read row 0 and write
    to the trash page); ``prev`` ``[M]`` indexes ``[carries of all slots (N*nb) ; windows' own
    first-half rows (M) ; empty]`` for the overlap series (window ``w`` reads carry row
    ``slot*nb + (w-1) % nb`` when ``w-1`` closed in an earlier step); ``positions`` ``[M]``
    the first position of each window; ``dest`` ``[M]`` the pool row of each new entry;
    ``carry_rows`` ``[M]`` the carry row ``slot*nb + w % nb`` each window's first half is
    saved to (the trash slot's for padding windows and for all but the last ``nb`` windows
    its request closes, so the writes are distinct); per token ``[T]``, ``buf_rows`` is where
    its projections go in the partial-window buffer (tokens of the last ``nb`` windows the
    chunk touches; the trash slot for the others); ``entries`` each query's visible entries
    (those of windows closed at or before it).  Prefix caching: windows closing at or before
    a request's ``cached`` boundary are skipped (their entries are cached);
    ``restore_rows``/``restore_page`` load the overlap carry at that boundary from the page
    snapshot into carry row ``slot*nb + (cached//r - 1) % nb``; ``snap_page`` saves the
    carry of each window that ends a page.  An unpadded step leaves out what the host knows
    it does not need: ``restore_*`` are ``None`` when no request reaches its boundary,
    ``snap_page`` when no window ends a page (a fixed-shape step always has all of them).
    """

    ratio: int
    windows: torch.Tensor
    prev: torch.Tensor
    positions: torch.Tensor
    dest: torch.Tensor
    carry_rows: torch.Tensor
    buf_rows: torch.Tensor
    entries: PagedIndex
    restore_rows: torch.Tensor | None
    restore_page: torch.Tensor | None
    snap_page: torch.Tensor | None


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


def buffer_windows(ratio: int, num_spec_tokens: int) -> int:
    """Windows of ratio ``ratio`` each slot buffers (and CSA carries it keeps): ``1 +
    ceil(S/r)``, enough that the windows a verify step's rejected tokens close never
    displace one the accepted tokens still need (see the module docstring)."""
    return 1 + -(-num_spec_tokens // ratio)


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
    and tensors that depend only on static ints are made once and kept (:func:`_kept`).
    """
    bad = [r for r in ratios if page_size % r]
    if bad:
        raise ValueError(f"page_size {page_size} is not a multiple of the compress ratios {bad}")
    t, n_req = inputs.num_tokens, inputs.num_reqs
    dev = inputs.input_ids.device
    fields = inputs.fields()  # [F, R] (a view of the packed buffer)
    slot, start, length = (fields[REQ_FIELDS.index(n)] for n in ("slot", "start", "len"))
    end = start + length
    tok = _arange(t, dev)
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
    ahead = _kept(("window", window), dev, lambda: torch.arange(1 - window, 1, device=dev))
    kpos = pos.unsqueeze(1) + ahead
    before = kpos < from_t.unsqueeze(1)
    # (a decode step's chunk is the token itself)
    earlier = _kept(("window<0", window), dev, lambda: ahead < 0) if decode else kpos < start_t.unsqueeze(1)
    # a key of the chunk is in the token row of its position: kpos + d = tok + (kpos - pos)
    window_chunk = (tok.unsqueeze(1) + ahead).masked_fill_(before | earlier, -1)
    ring = kpos % rows
    # (before >= earlier) == not (a valid key before the chunk)
    window_ring = torch.add(ring, slot_t.unsqueeze(1), alpha=rows).masked_fill_(before >= earlier, -1)
    # a chunk's last W+S positions leave their key in the ring (distinct rows); others, the
    # trash slot's: pos < end - rows, i.e. cum > tok + rows (a decode token is its chunk's last)
    ring_slot = slot_t
    if not decode:
        ring_slot = torch.where(cum_t > _arange(t + rows, dev)[rows:], _scalar(num_slots, dev), slot_t)
    ring_rows = torch.add(ring[:, -1] if window else pos % rows, ring_slot, alpha=rows)

    tables = inputs.block_tables.index_select(0, slot)  # [R, P]
    step = _Step(inputs, fields, end, d, tables, tok_req, pos, per_token, num_slots, page_size, trash_page)
    plans = _window_plans(step, sorted(set(ratios)), num_spec_tokens)
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


@dataclass
class _Step:
    """What the window plans read of a step: its inputs, per request (``[R]``) the fields
    (``[F, R]``), ``end`` and ``d`` (its first token row minus its start; ``None`` in a
    decode step, where it is ``arange(R) - start``), the requests' block tables, and per token
    (``[T]``) its request row, its position and its request's fields (``[F, T]``)."""

    inputs: StepInputs
    fields: torch.Tensor
    end: torch.Tensor
    d: torch.Tensor | None
    tables: torch.Tensor
    tok_req: torch.Tensor
    pos: torch.Tensor
    per_token: torch.Tensor
    num_slots: int
    page_size: int
    trash_page: int

    def field(self, name: str) -> torch.Tensor:
        """A request field, per request ``[R]``."""
        return self.fields[REQ_FIELDS.index(name)]

    def token_field(self, name: str) -> torch.Tensor:
        """A request field, per token ``[T]``."""
        return self.per_token[REQ_FIELDS.index(name)]


def _window_plans(step: _Step, ratios: list[int], num_spec_tokens: int) -> dict[int, WindowPlan]:
    """The :class:`WindowPlan` of each ratio (sorted, distinct): the per-token plans of all of
    them computed together (``[ratios, T]``), the windows of the ratios that close as many of
    them together (:func:`_closed_windows`)."""
    if not ratios:
        return {}
    inputs, pos, dev = step.inputs, step.pos, step.pos.device
    n_req, t = inputs.num_reqs, inputs.num_tokens
    trash = step.num_slots
    decode = step.d is None
    nbs = [buffer_windows(r, num_spec_tokens) for r in ratios]
    ratio = _col(ratios, dev)
    span = _col([nb * r for r, nb in zip(ratios, nbs, strict=True)], dev)  # buffer rows per slot
    last = step.end // ratio  # [n, R]: each request's end // r
    last_t = last if decode else last.index_select(1, step.tok_req)  # [n, T]
    # tokens of the last nb windows the chunk touches wait in the buffer (distinct rows), those
    # from (end // r - nb + 1) * r, not those below a prefix hit's cached boundary (an unpadded
    # step knows whether there are any)
    kept_from = torch.addcmul(
        _col([(1 - nb) * r for r, nb in zip(ratios, nbs, strict=True)], dev), last_t, ratio
    )
    not_kept = pos < kept_from
    if inputs.num_replaying() != 0:
        not_kept |= pos < step.token_field("cached")
    buf_slot = torch.where(not_kept, _scalar(trash, dev), step.token_field("slot"))
    buf_rows = torch.addcmul(pos % span, buf_slot, span)
    # a query sees the entries of the windows closed at or before it: (pos + 1) // r (the
    # request's end in a decode step)
    counts = last_t if decode else (pos + 1) // ratio
    # prefix hits: the carry at a request's cached boundary comes back from the page snapshot
    # (an unpadded step knows on the host whether any request gets there)
    restore_rows = restore_page = None
    if inputs.num_resuming() != 0:
        slot, start, cached = step.field("slot"), step.field("start"), step.field("cached")
        restore = (start < cached) & (cached <= step.end)
        # the page of position cached - 1 (column -1, the last, where cached is 0: not restored)
        page_at = step.tables[_arange(n_req, dev), (cached - 1) // step.page_size]
        restore_page = torch.where(restore, page_at, _scalar(step.trash_page, dev))
        if all(nb == 1 for nb in nbs):  # carry row slot*nb + (cached//r - 1) % nb: the slot
            restore_rows = torch.where(restore, slot, _scalar(trash, dev)).expand(len(ratios), -1)
        else:
            nb = _col(nbs, dev)
            row = torch.addcmul((cached // ratio - 1) % nb, slot, nb)
            restore_rows = torch.where(restore, row, _col([trash * b for b in nbs], dev))
    # windows closed this step: exactly those of an unpadded step (counted on the host), all
    # live; a fixed-shape step's bound (at most one per r tokens of a request, plus one per
    # request), whose windows past the closed ones are padding
    closed = [inputs.windows_closed(r) for r in ratios]
    exact = closed[0] is not None
    bounds = closed if exact else [min(t, t // r + n_req) for r in ratios]
    groups: dict[int, list[int]] = {}  # ratios by bound (a fixed-shape step: all in one)
    for i, m in enumerate(bounds):
        if m:
            groups.setdefault(m if exact else 0, []).append(i)
    window_plans = {}
    for group in groups.values():
        window_plans |= _closed_windows(
            step,
            [ratios[i] for i in group],
            [bounds[i] for i in group],
            [nbs[i] for i in group],
            exact,
            last if len(group) == len(ratios) else None,
        )
    plans = {}
    none = pos.new_empty(0)
    for i, r in enumerate(ratios):
        entries = PagedIndex(
            block_table=step.tables,
            token_rows=step.tok_req,
            counts=counts[i],
            entries_per_page=step.page_size // r,
            max_count=inputs.max_end // r,
        )
        # no window closes: nothing to compress
        windows, prev, positions, dest, carry_rows, snap_page = window_plans.get(
            r, (none.view(0, r), none, none, none, none, None)
        )
        plans[r] = WindowPlan(
            ratio=r,
            windows=windows,
            prev=prev,
            positions=positions,
            dest=dest,
            carry_rows=carry_rows,
            buf_rows=buf_rows[i],
            entries=entries,
            restore_rows=None if restore_rows is None else restore_rows[i],
            restore_page=restore_page,
            snap_page=snap_page,
        )
    return plans


def _closed_windows(
    step: _Step, ratios: list[int], bounds: list[int], nbs: list[int], exact: bool, last: torch.Tensor | None
) -> dict[int, tuple]:
    """The compressor windows closed this step for ``ratios`` (``g`` of them, buffering ``nbs``
    windows each), computed together over ``m = max(bounds)`` windows (``[g, m]``; ratio
    ``i``'s plan is the first ``bounds[i]`` of row ``i``, the rest is padding it leaves out).
    ``exact``: the bounds are the windows the requests close (else fixed-shape bounds);
    ``last``: each request's ``end // r`` (``[g, R]``) when already computed.  Per ratio:
    ``(windows, prev, positions, dest, carry_rows, snap_page)`` of :class:`WindowPlan`."""
    inputs, dev = step.inputs, step.pos.device
    g, m, n_req = len(ratios), max(bounds), inputs.num_reqs
    start, cached = step.field("start"), step.field("cached")
    num_slots, page_size, trash_page = step.num_slots, step.page_size, step.trash_page
    ratio, nb = _col(ratios, dev), _col(nbs, dev)
    uniform = len(set(nbs)) == 1  # nb (hence the carry count) the same for every ratio
    epp = _col([page_size // r for r in ratios], dev)  # entries per page
    # per request ([g, R]): its first window to compute (cached is page- hence window-aligned),
    # how many it closes; gathered for each window below: the step's index of its request's
    # first (the exclusive sum), w0 - that, the inclusive sum, the staging row of position 0
    # of its chunk
    w0 = torch.maximum(start, cached) // ratio
    count = ((step.end // ratio if last is None else last) - w0).clamp_(min=0)
    per_req = torch.empty((4, g, n_req), dtype=torch.int64, device=dev)
    first, w_off, cum, stage = per_req.unbind(0)
    torch.cumsum(count, 1, out=cum)
    torch.sub(cum, count, out=first)
    torch.sub(w0, first, out=w_off)
    # staging rows [buffer rows of all slots (N*nb*r) ; this step's token rows]: position q of
    # this step is token row q + d
    d = step.d if step.d is not None else _arange(n_req, dev) - start
    torch.add(d, _col([(num_slots + 1) * b * r for r, b in zip(ratios, nbs, strict=True)], dev), out=stage)
    k = _arange(m, dev)
    # each window's request: the last boundary left out, later (padding) windows are the last
    # request's (as with all of them, clamped to R-1: cum is sorted)
    win_req = torch.empty((g, m), dtype=torch.int64, device=dev)
    for i in range(g):
        torch.searchsorted(cum[i, :-1], k, right=True, out=win_req[i])
    first_w, w_off_w, cum_w, stage_w = per_req.gather(2, win_req.expand(4, g, m)).unbind(0)
    fields_w = step.fields.index_select(1, win_req.view(-1)).view(-1, g, m)
    slot_w, start_w = fields_w[REQ_FIELDS.index("slot")], fields_w[REQ_FIELDS.index("start")]
    dead = None if exact else k >= cum[:, -1:]  # a fixed-shape step's padding windows
    w = k + w_off_w  # the window: w0 + (k - first)
    if dead is not None:
        w.masked_fill_(dead, 0)
    positions = w * ratio
    # its carry row slot*nb + w % nb (the slot's with one window buffered)
    carry = slot_w if nbs == [1] * g else torch.addcmul(w % nb, slot_w, nb)
    # the overlap series: window w reads w-1's first half, from this step's rows when it closes
    # both (k > first), else from w-1's carry (row slot*nb + (w-1) % nb), none for window 0
    carries = [(num_slots + 1) * b for b in nbs]
    prev_carry = slot_w if nbs == [1] * g else torch.addcmul((w - 1) % nb, slot_w, nb)
    empty = _col([c + b for c, b in zip(carries, bounds, strict=True)], dev, keep=not exact)
    own = (
        _arange(m + carries[0] - 1, dev)[carries[0] - 1 :]
        if uniform
        else k + _col([c - 1 for c in carries], dev)
    )
    prev = torch.where(k > first_w, own, torch.where(w > 0, prev_carry, empty))
    # a padding request's positions may pass max_model_len (a full step of padding): its row is
    # the trash slot's, every column the trash page, so the column is clamped to the table
    tables = step.tables
    page = tables[win_req, (positions // page_size).clamp_(max=tables.shape[1] - 1)]
    in_page = w % epp  # (w*r % page_size) // r
    dest = torch.addcmul(in_page, page, epp)
    if dead is not None:
        dest = torch.where(dead, _col([trash_page * (page_size // r) for r in ratios], dev), dest)
    # the last nb windows each request closes keep their carry (distinct rows): k + nb >= cum
    drop = (_arange(m + nbs[0], dev)[nbs[0] :] if uniform else k + nb) < cum_w
    if dead is not None:
        drop |= dead
    carry_rows = torch.where(drop, _col([num_slots * b for b in nbs], dev), carry)
    # the carry of each window that ends a page is snapshot (page_size is a multiple of r, so
    # an unpadded step closes as many such windows as it closes pages)
    snap_page = None
    if not exact or inputs.windows_closed(page_size):
        skip = in_page != _col([page_size // r - 1 for r in ratios], dev)
        if dead is not None:
            skip |= dead
        snap_page = torch.where(skip, _scalar(trash_page, dev), page)
    # per window [g, m, 1], against the [r] offsets in a window
    q0, carry_c, start_c, stage_c = (x.unsqueeze(2) for x in (positions, carry, start_w, stage_w))
    out = {}
    for i, r in enumerate(ratios):
        b = bounds[i]

        def row(x: torch.Tensor, i: int = i, b: int = b) -> torch.Tensor:
            return x[i] if b == m else x[i, :b]

        col = _arange(r, dev)
        q = row(q0) + col  # [b, r]
        # position q of an earlier step: buffer row slot*nb*r + q % (nb*r) = carry*r + q % r
        buffered = torch.add(col, row(carry_c), alpha=r)
        windows = torch.where(q < row(start_c), buffered, q + row(stage_c))
        if dead is not None:  # padding windows read row 0
            windows.masked_fill_(row(dead).unsqueeze(1), 0)
        snap = None if snap_page is None else row(snap_page)
        out[r] = (windows, row(prev), row(positions), row(dest), row(carry_rows), snap)
    return out


# ---- constants made once ----------------------------------------------------------------------
# Tensors that depend only on static ints (sizes, the cache geometry), made on first use and
# kept for the life of the process: a captured graph reads them by address, so none is ever
# dropped or written in place; a graph capture that misses one records its making instead.
_KEPT: dict[tuple, torch.Tensor] = {}


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a graph."""
    if device.type == "cpu":
        return False
    check = getattr(getattr(torch, device.type, None), "is_current_stream_capturing", None)
    return bool(check()) if check is not None else False


def _kept(key: tuple, device: torch.device, make) -> torch.Tensor:
    """The tensor ``make()`` makes for ``key`` on ``device``, kept after its first making
    (outside graph capture).  Not to be modified in place."""
    x = _KEPT.get((key, device))
    if x is None:
        x = make()
        if not _capturing(device):
            _KEPT[(key, device)] = x
    return x


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` (int64): a prefix of a kept one whose length is a power of two."""
    size = 1 << max(n - 1, 0).bit_length()
    return _kept(("arange", size), device, lambda: torch.arange(size, device=device))[:n]


def _scalar(value: int, device: torch.device) -> torch.Tensor:
    """``value`` as a kept 0-dim int64 tensor: ``torch.where`` with it is one op (with a
    Python number it also fills a tensor with the number first)."""
    return _kept(("scalar", value), device, lambda: torch.full((), value, dtype=torch.int64, device=device))


def _col(values: list[int], device: torch.device, keep: bool = True) -> torch.Tensor:
    """``values`` as an int64 column ``[n, 1]`` (one value per ratio), kept unless ``keep`` is
    false (values that change from step to step).  Made by fills only (no host copy), so that
    a graph capture may make one."""

    def make() -> torch.Tensor:
        x = torch.full((len(values), 1), values[0], dtype=torch.int64, device=device)
        for i, v in enumerate(values):
            if i and v != values[0]:
                x[i] = v
        return x

    return _kept(("col", *values), device, make) if keep else make()
