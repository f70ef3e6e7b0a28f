"""Per-step index plans of a flat varlen batch, derived on the device.

From the host's O(batch) scalars (:class:`~deepinfer_core.engine.step_inputs.StepInputs`)
this builds, with torch ops only, every per-token plan the layers share: positions, the
sliding-window key rows, and per compress ratio the compressor's window plan and each
query's paged entry list.  All shapes depend only on static ints (tokens, requests, the
bound on positions), never on tensor values, and nothing reads a value back to the host, so
a decode step can be captured in a CUDA graph.  Rows that a plan does not need (tokens that
leave no ring row, windows beyond those closed this step, requests without a carry to
restore) point at the cache's *trash* slot / page instead of being filtered out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_core.engine.step_inputs import StepInputs
from deepinfer_core.ops.attention import PagedIndex


@dataclass
class WindowPlan:
    """The compressor work of one step for one compress ratio ``r`` (``M`` window rows).

    Staging rows are ``[buffer rows of all slots ((S+1)*r) ; this step's token rows]``.
    ``windows`` ``[M, r]`` are the staging rows of each window closed this step (padding
    windows read row 0 and write to the trash page); ``prev`` ``[M]`` indexes
    ``[carry of all slots (S+1) ; windows' own first-half rows (M) ; empty]`` for the overlap
    series; ``positions`` ``[M]`` the first position of each window; ``dest`` ``[M]`` the pool
    row of each new entry; per request ``[R]``, ``carry_slot``/``carry_window`` save the last
    closed window's first half; per token ``[T]``, ``buf_rows`` is where its projections go
    in the partial-window buffer (the trash slot for tokens of closed windows); ``entries``
    each query's visible entries (those of windows closed at or before it).  Prefix caching:
    windows closing at or before a request's ``cached`` boundary are skipped (their entries
    are cached); ``restore_slot``/``restore_page`` load the overlap carry at that boundary
    from the page snapshot; ``snap_page`` saves the carry of each window that ends a page.
    """

    ratio: int
    windows: torch.Tensor
    prev: torch.Tensor
    positions: torch.Tensor
    dest: torch.Tensor
    carry_slot: torch.Tensor
    carry_window: torch.Tensor
    buf_rows: torch.Tensor
    entries: PagedIndex
    restore_slot: torch.Tensor
    restore_page: torch.Tensor
    snap_page: torch.Tensor


@dataclass
class StepMetadata:
    """Everything the layers need to run one step of a flat batch (``T`` token rows)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    window_ring: torch.Tensor  # [T, W] ring rows (-1 none)
    window_chunk: torch.Tensor  # [T, W] token rows of this step (-1 none)
    ring_rows: torch.Tensor  # [T] ring row each token's key is written to (trash if none)
    plans: dict[int, WindowPlan]
    sample_rows: torch.Tensor  # [S] token rows whose logits are wanted
    num_slots: int  # real slots; slot num_slots is the trash slot


def build_metadata(
    inputs: StepInputs, window: int, ratios: list[int], page_size: int, num_slots: int, trash_page: int
) -> StepMetadata:
    """Derive the step's plans on the inputs' device (see the module docstring)."""
    t, r_ = inputs.num_tokens, inputs.num_reqs
    req = inputs.req
    dev = inputs.input_ids.device
    slot, start, length = req["slot"], req["start"], req["len"]
    end = start + length
    cum = torch.cumsum(length, 0)
    offset = cum - length
    tok = torch.arange(t, device=dev)
    tok_req = torch.searchsorted(cum, tok, right=True).clamp_(max=max(r_ - 1, 0))
    pos = start[tok_req] + tok - offset[tok_req]
    ids = inputs.input_ids
    if inputs.prev_tokens is not None and inputs.prev_tokens.shape[0]:  # async: tokens on the device
        prev_row = req["prev_row"]
        src = inputs.prev_tokens.index_select(0, prev_row.clamp(min=0)).to(ids.dtype)
        # requests without a pending token write to a scratch row t (distinct real targets)
        first = torch.where(prev_row >= 0, offset, t)
        ids = torch.cat([ids, ids.new_zeros(1)]).index_put_((first,), src)[:t]

    # sliding window: keys at positions pos-W+1 .. pos
    slot_t, start_t, offset_t = slot[tok_req], start[tok_req], offset[tok_req]
    kpos = pos[:, None] - (window - 1) + torch.arange(window, device=dev)
    valid = kpos >= req["window_from"][tok_req][:, None]
    in_chunk = kpos >= start_t[:, None]
    none = torch.full_like(kpos, -1)
    window_chunk = torch.where(valid & in_chunk, offset_t[:, None] + kpos - start_t[:, None], none)
    window_ring = torch.where(valid & ~in_chunk, slot_t[:, None] * window + kpos % window, none)
    keep = pos >= end[tok_req] - window
    ring_rows = torch.where(keep, slot_t, num_slots) * window + pos % window

    tables = inputs.block_tables.index_select(0, slot)  # [R, P]
    plans = {
        r: _window_plan(r, inputs, tables, pos, tok_req, offset, end, num_slots, page_size, trash_page)
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
    )


def _window_plan(
    r: int,
    inputs: StepInputs,
    tables: torch.Tensor,
    pos: torch.Tensor,
    tok_req: torch.Tensor,
    offset: torch.Tensor,
    end: torch.Tensor,
    num_slots: int,
    page_size: int,
    trash_page: int,
) -> WindowPlan:
    req = inputs.req
    slot, start, cached = req["slot"], req["start"], req["cached"]
    dev = pos.device
    n_req, t = inputs.num_reqs, inputs.num_tokens
    epp = page_size // r  # entries per page
    trash = num_slots
    # windows closed this step: at most one per r tokens of a request, plus one per request
    m_max = min(t, t // r + n_req)
    w0 = torch.maximum(start, cached) // r  # cached is page- hence window-aligned
    m = (end // r - w0).clamp(min=0)
    cum = torch.cumsum(m, 0)
    first = cum - m
    k = torch.arange(m_max, device=dev)
    win_req = torch.searchsorted(cum, k, right=True).clamp_(max=max(n_req - 1, 0))
    live = k < cum[-1] if n_req else torch.zeros_like(k, dtype=torch.bool)
    j = k - first[win_req]
    w = torch.where(live, w0[win_req] + j, 0)
    q = w[:, None] * r + torch.arange(r, device=dev)
    win_slot, win_start = slot[win_req][:, None], start[win_req][:, None]
    from_buf = q < win_start
    windows = torch.where(
        from_buf, win_slot * r + q % r, (num_slots + 1) * r + offset[win_req][:, None] + q - win_start
    )
    windows = torch.where(live[:, None], windows, 0)
    empty = num_slots + 1 + m_max
    prev = torch.where(j > 0, num_slots + 1 + k - 1, torch.where(w > 0, slot[win_req], empty))
    page = tables[win_req, (w * r) // page_size]
    dest = torch.where(live, page * epp + (w * r % page_size) // r, trash_page * epp)
    has = m > 0
    carry_slot = torch.where(has, slot, trash)
    carry_window = (first + m - 1).clamp(min=0)
    tail = (pos >= (end[tok_req] // r) * r) & (pos >= cached[tok_req])
    buf_rows = torch.where(tail, slot[tok_req], trash) * r + pos % r
    restore = (start < cached) & (cached <= end)
    restore_page = tables.gather(1, ((cached - 1).clamp(min=0) // page_size)[:, None]).squeeze(1)
    snap = live & ((w + 1) * r % page_size == 0)
    snap_page = torch.where(snap, page, trash_page)
    entries = PagedIndex(
        block_table=tables,
        token_rows=tok_req,
        counts=(pos + 1) // r,
        entries_per_page=epp,
        max_count=inputs.max_end // r,
    )
    return WindowPlan(
        ratio=r,
        windows=windows,
        prev=prev,
        positions=w * r,
        dest=dest,
        carry_slot=carry_slot,
        carry_window=carry_window,
        buf_rows=buf_rows,
        entries=entries,
        restore_slot=torch.where(restore, slot, trash),
        restore_page=torch.where(restore, restore_page, trash_page),
        snap_page=snap_page,
    )
