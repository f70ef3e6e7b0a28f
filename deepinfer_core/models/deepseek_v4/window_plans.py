"""The compressor's window plans of a step, one per compress ratio (:class:`WindowPlan`), and
the slot-state geometry they index (:func:`buffer_windows`); the layout and its reasons are in
:mod:`.metadata`'s docstring, which builds them (:func:`window_plans`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.contract.step_inputs import REQ_FIELDS, StepInputs
from deepinfer_core.ops.attention import PagedIndex

from .plan_tensors import kept_arange, kept_column, kept_scalar


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
    carry of each window that ends a page.  ``live`` ``[1]``: how many of the ``M`` windows
    are real in a fixed-shape step (the rest are padding, after them), ``None`` in an unpadded
    step (all are).  An unpadded step leaves out what the host knows
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
    live: torch.Tensor | None


def buffer_windows(ratio: int, num_spec_tokens: int) -> int:
    """Windows of ratio ``ratio`` each slot buffers (and CSA carries it keeps): ``1 +
    ceil(S/r)``, enough that the windows a verify step's rejected tokens close never
    displace one the accepted tokens still need (see the module docstring)."""
    return 1 + -(-num_spec_tokens // ratio)


@dataclass
class StepView:
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


def window_plans(step: StepView, ratios: list[int], num_spec_tokens: int) -> dict[int, WindowPlan]:
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
    ratio = kept_column(ratios, dev)
    span = kept_column([nb * r for r, nb in zip(ratios, nbs, strict=True)], dev)  # buffer rows per slot
    last = step.end // ratio  # [n, R]: each request's end // r
    last_t = last if decode else last.index_select(1, step.tok_req)  # [n, T]
    # tokens of the last nb windows the chunk touches wait in the buffer (distinct rows), those
    # from (end // r - nb + 1) * r, not those below a prefix hit's cached boundary (an unpadded
    # step knows whether there are any)
    kept_from = torch.addcmul(
        kept_column([(1 - nb) * r for r, nb in zip(ratios, nbs, strict=True)], dev), last_t, ratio
    )
    not_kept = pos < kept_from
    if inputs.num_replaying() != 0:
        not_kept |= pos < step.token_field("cached")
    buf_slot = torch.where(not_kept, kept_scalar(trash, dev), step.token_field("slot"))
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
        page_at = step.tables[kept_arange(n_req, dev), (cached - 1) // step.page_size]
        restore_page = torch.where(restore, page_at, kept_scalar(step.trash_page, dev))
        if all(nb == 1 for nb in nbs):  # carry row slot*nb + (cached//r - 1) % nb: the slot
            restore_rows = torch.where(restore, slot, kept_scalar(trash, dev)).expand(len(ratios), -1)
        else:
            nb = kept_column(nbs, dev)
            row = torch.addcmul((cached // ratio - 1) % nb, slot, nb)
            restore_rows = torch.where(restore, row, kept_column([trash * b for b in nbs], dev))
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
    closed_by_ratio = {}
    for group in groups.values():
        closed_by_ratio |= _closed_windows(
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
        windows, prev, positions, dest, carry_rows, snap_page, live = closed_by_ratio.get(
            r, (none.view(0, r), none, none, none, none, None, None)
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
            live=live,
        )
    return plans


def _closed_windows(
    step: StepView,
    ratios: list[int],
    bounds: list[int],
    nbs: list[int],
    exact: bool,
    last: torch.Tensor | None,
) -> dict[int, tuple]:
    """The compressor windows closed this step for ``ratios`` (``g`` of them, buffering ``nbs``
    windows each), computed together over ``m = max(bounds)`` windows (``[g, m]``; ratio
    ``i``'s plan is the first ``bounds[i]`` of row ``i``, the rest is padding it leaves out).
    ``exact``: the bounds are the windows the requests close (else fixed-shape bounds);
    ``last``: each request's ``end // r`` (``[g, R]``) when already computed.  Per ratio:
    ``(windows, prev, positions, dest, carry_rows, snap_page, live)`` of :class:`WindowPlan`."""
    inputs, dev = step.inputs, step.pos.device
    g, m, n_req = len(ratios), max(bounds), inputs.num_reqs
    start, cached = step.field("start"), step.field("cached")
    num_slots, page_size, trash_page = step.num_slots, step.page_size, step.trash_page
    ratio, nb = kept_column(ratios, dev), kept_column(nbs, dev)
    uniform = len(set(nbs)) == 1  # nb (hence the carry count) the same for every ratio
    epp = kept_column([page_size // r for r in ratios], dev)  # entries per page
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
    d = step.d if step.d is not None else kept_arange(n_req, dev) - start
    torch.add(
        d, kept_column([(num_slots + 1) * b * r for r, b in zip(ratios, nbs, strict=True)], dev), out=stage
    )
    k = kept_arange(m, dev)
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
    empty = kept_column([c + b for c, b in zip(carries, bounds, strict=True)], dev, keep=not exact)
    own = (
        kept_arange(m + carries[0] - 1, dev)[carries[0] - 1 :]
        if uniform
        else k + kept_column([c - 1 for c in carries], dev)
    )
    prev = torch.where(k > first_w, own, torch.where(w > 0, prev_carry, empty))
    # a padding request's positions may pass max_model_len (a full step of padding): its row is
    # the trash slot's, every column the trash page, so the column is clamped to the table
    tables = step.tables
    page = tables[win_req, (positions // page_size).clamp_(max=tables.shape[1] - 1)]
    in_page = w % epp  # (w*r % page_size) // r
    dest = torch.addcmul(in_page, page, epp)
    if dead is not None:
        dest = torch.where(dead, kept_column([trash_page * (page_size // r) for r in ratios], dev), dest)
    # the last nb windows each request closes keep their carry (distinct rows): k + nb >= cum
    drop = (kept_arange(m + nbs[0], dev)[nbs[0] :] if uniform else k + nb) < cum_w
    if dead is not None:
        drop |= dead
    carry_rows = torch.where(drop, kept_column([num_slots * b for b in nbs], dev), carry)
    # the carry of each window that ends a page is snapshot (page_size is a multiple of r, so
    # an unpadded step closes as many such windows as it closes pages)
    snap_page = None
    if not exact or inputs.windows_closed(page_size):
        skip = in_page != kept_column([page_size // r - 1 for r in ratios], dev)
        if dead is not None:
            skip |= dead
        snap_page = torch.where(skip, kept_scalar(trash_page, dev), page)
    # per window [g, m, 1], against the [r] offsets in a window
    q0, carry_c, start_c, stage_c = (x.unsqueeze(2) for x in (positions, carry, start_w, stage_w))
    out = {}
    for i, r in enumerate(ratios):
        b = bounds[i]

        def row(x: torch.Tensor, i: int = i, b: int = b) -> torch.Tensor:
            return x[i] if b == m else x[i, :b]

        col = kept_arange(r, dev)
        q = row(q0) + col  # [b, r]
        # position q of an earlier step: buffer row slot*nb*r + q % (nb*r) = carry*r + q % r
        buffered = torch.add(col, row(carry_c), alpha=r)
        windows = torch.where(q < row(start_c), buffered, q + row(stage_c))
        if dead is not None:  # padding windows read row 0
            windows.masked_fill_(row(dead).unsqueeze(1), 0)
        snap = None if snap_page is None else row(snap_page)
        live = None if exact else cum[i, -1:]  # the windows before the padding ones
        out[r] = (windows, row(prev), row(positions), row(dest), row(carry_rows), snap, live)
    return out
