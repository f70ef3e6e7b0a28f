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

from deepinfer_core.contract.step_inputs import StepInputs
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
    """
    t, r_ = inputs.num_tokens, inputs.num_reqs
    req = inputs.req
    dev = inputs.input_ids.device
    slot, start, length = req["slot"], req["start"], req["len"]
    end = start + length
    tok = torch.arange(t, device=dev)
    if inputs.one_token_each():  # token i is request i's only one: no gathers
        offset = tok_req = tok
        pos = start

        def per_token(x: torch.Tensor) -> torch.Tensor:
            return x

    else:
        cum = torch.cumsum(length, 0)
        offset = cum - length
        tok_req = torch.searchsorted(cum, tok, right=True).clamp_(max=max(r_ - 1, 0))

        def per_token(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, tok_req)

        pos = per_token(start) + tok - per_token(offset)
    ids = inputs.input_ids
    if inputs.prev_tokens is not None and inputs.prev_tokens.shape[0]:  # async: tokens on the device
        prev_row = req["prev_row"]
        src = cast(inputs.prev_tokens.index_select(0, prev_row.clamp(min=0)), ids.dtype)
        # requests without a pending token write to a scratch row t (distinct real targets)
        first = torch.where(prev_row >= 0, offset, t)
        ids = torch.cat([ids, ids.new_zeros(1)]).index_put_((first,), src)[:t]

    # sliding window: keys at positions pos-W+1 .. pos
    slot_t, start_t, end_t = per_token(slot), per_token(start), per_token(end)
    kpos = pos.unsqueeze(1) + torch.arange(1 - window, 1, device=dev)
    valid = kpos >= per_token(req["window_from"]).unsqueeze(1)
    in_chunk = kpos >= start_t.unsqueeze(1)
    none = torch.full_like(kpos, -1)
    window_chunk = torch.where(valid & in_chunk, kpos + (per_token(offset) - start_t).unsqueeze(1), none)
    rows = window + num_spec_tokens  # ring rows per slot: W + S
    # valid > in_chunk: a valid key not in the chunk
    window_ring = torch.where(valid > in_chunk, slot_t.unsqueeze(1) * rows + kpos % rows, none)
    # a chunk's last W+S positions leave their key in the ring (distinct rows); others, the trash slot's
    ring_rows = slot_t.masked_fill(pos < end_t - rows, num_slots) * rows + pos % rows

    tables = inputs.block_tables.index_select(0, slot)  # [R, P]
    token = _PerToken(tok_req, pos, slot_t, end_t, per_token(req["cached"]))
    plans = {
        r: _window_plan(
            r,
            buffer_windows(r, num_spec_tokens),
            inputs,
            tables,
            token,
            offset,
            end,
            num_slots,
            page_size,
            trash_page,
        )
        for r in sorted(set(ratios))
    }
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
class _PerToken:
    """The per-token values a window plan reads: each token's request row, position, and its
    request's slot, end and cached boundary."""

    req: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor
    end: torch.Tensor
    cached: torch.Tensor


def _window_plan(
    r: int,
    nb: int,
    inputs: StepInputs,
    tables: torch.Tensor,
    token: _PerToken,
    offset: torch.Tensor,
    end: torch.Tensor,
    num_slots: int,
    page_size: int,
    trash_page: int,
) -> WindowPlan:
    req = inputs.req
    slot, start, cached = req["slot"], req["start"], req["cached"]
    pos = token.pos
    dev = pos.device
    n_req, t = inputs.num_reqs, inputs.num_tokens
    epp = page_size // r  # entries per page
    trash = num_slots
    span = nb * r  # buffer rows per slot
    # tokens of the last nb windows the chunk touches wait in the buffer (distinct rows), not
    # those below a prefix hit's cached boundary (an unpadded step knows whether there are any)
    not_kept = pos < (token.end // r - nb + 1) * r
    if inputs.num_replaying() != 0:
        not_kept |= pos < token.cached
    buf_rows = token.slot.masked_fill(not_kept, trash) * span + pos % span
    entries = PagedIndex(
        block_table=tables,
        token_rows=token.req,
        counts=(pos + 1) // r,
        entries_per_page=epp,
        max_count=inputs.max_end // r,
    )
    # prefix hits: the carry at a request's cached boundary comes back from the page snapshot
    # (an unpadded step knows on the host whether any request gets there)
    restore_rows = restore_page = None
    if inputs.num_resuming() != 0:
        restore = (start < cached) & (cached <= end)
        page_at = tables.gather(1, ((cached - 1).clamp(min=0) // page_size).unsqueeze(1)).squeeze(1)
        restore_rows = torch.where(restore, slot * nb + (cached // r - 1) % nb, trash * nb)
        restore_page = torch.where(restore, page_at, trash_page)
    # windows closed this step: exactly those of an unpadded step (counted on the host), all
    # live; a fixed-shape step's bound (at most one per r tokens of a request, plus one per
    # request), whose windows past the closed ones are padding (``live`` false)
    closed = inputs.windows_closed(r)
    m_max = min(t, t // r + n_req) if closed is None else closed
    if m_max == 0:  # no window closes: nothing to compress
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return WindowPlan(
            r, none.view(0, r), none, none, none, none, buf_rows, entries, restore_rows, restore_page, None
        )
    w0 = torch.maximum(start, cached) // r  # cached is page- hence window-aligned
    m = (end // r - w0).clamp(min=0)
    cum = torch.cumsum(m, 0)
    k = torch.arange(m_max, device=dev)
    win_req = torch.searchsorted(cum, k, right=True).clamp_(max=max(n_req - 1, 0))

    def per_window(x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, win_req)

    live = None if closed is not None else k < cum[-1] if n_req else torch.zeros_like(k, dtype=torch.bool)
    j = k - per_window(cum - m)
    w = _where(live, per_window(w0) + j, 0)
    q = (w * r).unsqueeze(1) + torch.arange(r, device=dev)
    win_slot, win_start = per_window(slot).unsqueeze(1), per_window(start).unsqueeze(1)
    windows = torch.where(
        q < win_start,
        win_slot * span + q % span,
        (num_slots + 1) * span + per_window(offset).unsqueeze(1) + q - win_start,
    )
    windows = _where(None if live is None else live.unsqueeze(1), windows, 0)
    carries = (num_slots + 1) * nb
    empty = carries + m_max
    win_slot = win_slot.squeeze(1)
    prev_carry = win_slot * nb + (w - 1) % nb
    prev = torch.where(j > 0, carries + k - 1, torch.where(w > 0, prev_carry, empty))
    # a padding request's positions may pass max_model_len (a full step of padding): its row is
    # the trash slot's, every column the trash page, so the column is clamped to the table
    page = tables[win_req, ((w * r) // page_size).clamp(max=tables.shape[1] - 1)]
    dest = _where(live, page * epp + (w * r % page_size) // r, trash_page * epp)
    # the last nb windows each request closes keep their carry (distinct rows w % nb)
    saved = _and(live, j >= per_window(m) - nb)
    carry_rows = torch.where(saved, win_slot * nb + w % nb, trash * nb)
    # the carry of each window that ends a page is snapshot (page_size is a multiple of r, so
    # an unpadded step closes as many such windows as it closes pages)
    snap_page = None
    if closed is None or inputs.windows_closed(page_size):
        snap_page = torch.where(_and(live, (w + 1) * r % page_size == 0), page, trash_page)
    return WindowPlan(
        ratio=r,
        windows=windows,
        prev=prev,
        positions=w * r,
        dest=dest,
        carry_rows=carry_rows,
        buf_rows=buf_rows,
        entries=entries,
        restore_rows=restore_rows,
        restore_page=restore_page,
        snap_page=snap_page,
    )


def _where(mask: torch.Tensor | None, x: torch.Tensor, other: int) -> torch.Tensor:
    """``x`` where ``mask`` (``None``: everywhere), else ``other``."""
    return x if mask is None else torch.where(mask, x, other)


def _and(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``mask & x`` (``None``: ``x``)."""
    return x if mask is None else mask & x
