"""Per-step index plans for a flat varlen batch over the paged hybrid cache.

Built once per step on the host from the scheduled chunks and shared by every layer:
the sliding-window key lists, and per compress ratio the compressor's window plan (which
rows form each closed window, where the overlap carry comes from, where entries are
written) and each query's causal candidate entries.  All index tensors are int64 with
``-1`` for "none"; they are computed with numpy (cheaper than torch for small host-side
integer work) and handed over as tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_core.engine.batch import SeqChunk


@dataclass
class WindowPlan:
    """The compressor work of one step for one compress ratio ``r``.

    Staging rows are ``[buffer rows of all slots (num_slots*r) ; this step's token rows]``.
    ``windows`` ``[M, r]`` are the staging rows of each closed window; ``prev`` ``[M]``
    indexes ``[carry of all slots (num_slots) ; windows' own first-half rows (M) ; empty]``
    for the overlap series; ``positions`` ``[M]`` the first position of each window;
    ``dest`` ``[M]`` the pool row of each new entry; ``carry_slot``/``carry_window`` save the
    last closed window of each request; ``buf_rows``/``buf_tokens`` copy the unfinished
    window's tokens into the buffer; ``candidates`` ``[T, C]`` the pool rows each query
    may see (entries of windows closed at or before it).  Prefix caching: windows closing
    at or before a chunk's ``cached_until`` are skipped (their entries are cached);
    ``restore_slot``/``restore_page`` load the overlap carry at that boundary from the page
    snapshot; ``snap_window``/``snap_page`` save the carry of each window that ends a page.
    """

    ratio: int
    windows: torch.Tensor
    prev: torch.Tensor
    positions: torch.Tensor
    dest: torch.Tensor
    carry_slot: torch.Tensor
    carry_window: torch.Tensor
    buf_rows: torch.Tensor
    buf_tokens: torch.Tensor
    candidates: torch.Tensor
    restore_slot: torch.Tensor
    restore_page: torch.Tensor
    snap_window: torch.Tensor
    snap_page: torch.Tensor


@dataclass
class StepMetadata:
    """Everything the layers need to run one step of a flat batch."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    window_ring: torch.Tensor  # [T, W] ring rows (-1 none)
    window_chunk: torch.Tensor  # [T, W] token rows of this step (-1 none)
    ring_rows: torch.Tensor  # [U] ring rows to write after attention
    ring_tokens: torch.Tensor  # [U] the token rows written there
    plans: dict[int, WindowPlan]
    sample_rows: torch.Tensor  # [S] token rows whose logits are wanted
    num_slots: int


def build_metadata(
    chunks: list[SeqChunk],
    window: int,
    ratios: list[int],
    page_size: int,
    num_slots: int,
    device: torch.device | str = "cpu",
) -> StepMetadata:
    """Build the index plans of one step (see module docs)."""
    lens = np.fromiter((c.num_tokens for c in chunks), np.int64, len(chunks))
    start = np.fromiter((c.start_pos for c in chunks), np.int64, len(chunks))
    slot = np.fromiter((c.seq_slot for c in chunks), np.int64, len(chunks))
    window_from = np.fromiter((c.window_from for c in chunks), np.int64, len(chunks))
    cached = np.fromiter((c.cached_until for c in chunks), np.int64, len(chunks))
    tok_req = np.repeat(np.arange(len(chunks)), lens)
    offset = np.cumsum(lens) - lens
    t = int(lens.sum())
    tok_idx = np.arange(t)
    pos = start[tok_req] + tok_idx - offset[tok_req]
    end = start + lens
    ids = np.fromiter((x for c in chunks for x in c.token_ids), np.int64, t)

    # sliding window: keys at positions pos-W+1 .. pos
    kpos = pos[:, None] - (window - 1) + np.arange(window)
    valid = kpos >= window_from[tok_req][:, None]
    tok_start = start[tok_req][:, None]
    in_chunk = kpos >= tok_start
    window_chunk = np.where(valid & in_chunk, offset[tok_req][:, None] + kpos - tok_start, -1)
    window_ring = np.where(valid & ~in_chunk, slot[tok_req][:, None] * window + kpos % window, -1)
    keep = pos >= (end[tok_req] - window)
    ring_tokens = tok_idx[keep]
    ring_rows = slot[tok_req][keep] * window + pos[keep] % window

    max_pages = max((len(c.block_table) for c in chunks), default=0)
    table = np.full((len(chunks), max(max_pages, 1)), -1, dtype=np.int64)
    for i, c in enumerate(chunks):
        table[i, : len(c.block_table)] = c.block_table

    plans = {}
    for r in sorted(set(ratios)):
        plans[r] = _window_plan(
            r, pos, tok_req, start, end, cached, slot, offset, table, page_size, num_slots
        )
    sample: list[int] = []
    for i, c in enumerate(chunks):
        if c.all_logits:
            sample.extend(range(int(offset[i]), int(offset[i] + lens[i])))
        elif c.sample:
            sample.append(int(offset[i] + lens[i] - 1))
    t_ = _tensor
    md = StepMetadata(
        input_ids=t_(ids),
        positions=t_(pos),
        window_ring=t_(window_ring),
        window_chunk=t_(window_chunk),
        ring_rows=t_(ring_rows),
        ring_tokens=t_(ring_tokens),
        plans=plans,
        sample_rows=torch.tensor(sample, dtype=torch.long),
        num_slots=num_slots,
    )
    return md if str(device) == "cpu" else _to(md, device)


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _entry_rows(req: np.ndarray, entry: np.ndarray, r: int, table: np.ndarray, page_size: int) -> np.ndarray:
    tok0 = entry * r
    page = table[req, tok0 // page_size]
    return page * (page_size // r) + (tok0 % page_size) // r


def _window_plan(
    r: int,
    pos: np.ndarray,
    tok_req: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    cached: np.ndarray,
    slot: np.ndarray,
    offset: np.ndarray,
    table: np.ndarray,
    page_size: int,
    num_slots: int,
) -> WindowPlan:
    w0 = np.maximum(start, cached) // r  # cached_until is page- hence window-aligned
    m = np.maximum(end // r - w0, 0)  # windows closed this step per request
    win_req = np.repeat(np.arange(len(start)), m)
    first = np.cumsum(m) - m
    j = np.arange(int(m.sum())) - first[win_req]
    w = w0[win_req] + j
    q = w[:, None] * r + np.arange(r)
    from_buf = q < start[win_req][:, None]
    windows = np.where(
        from_buf,
        slot[win_req][:, None] * r + q % r,
        num_slots * r + offset[win_req][:, None] + q - start[win_req][:, None],
    ).reshape(-1, r)
    n_win = windows.shape[0]
    win_idx = np.arange(n_win)
    prev = np.where(j > 0, num_slots + win_idx - 1, np.where(w > 0, slot[win_req], num_slots + n_win))
    dest = _entry_rows(win_req, w, r, table, page_size)
    has = m > 0
    tail = (pos >= (end[tok_req] // r) * r) & (pos >= cached[tok_req])
    restore = (start < cached) & (cached <= end)
    snap = (w + 1) * r % page_size == 0
    # causal candidates: entry e visible to the query at pos p iff e < (p+1)//r
    count = (pos + 1) // r
    cmax = int(count.max()) if count.size else 0
    e = np.arange(cmax)
    rows = _entry_rows(tok_req[:, None], e[None, :], r, table, page_size)
    t_ = _tensor
    return WindowPlan(
        ratio=r,
        windows=t_(windows),
        prev=t_(prev),
        positions=t_(w * r),
        dest=t_(dest),
        carry_slot=t_(slot[has]),
        carry_window=t_((first + m - 1)[has]),
        buf_rows=t_(slot[tok_req][tail] * r + pos[tail] % r),
        buf_tokens=t_(np.nonzero(tail)[0]),
        candidates=t_(np.where(e[None, :] < count[:, None], rows, -1)),
        restore_slot=t_(slot[restore]),
        restore_page=t_(table[restore, np.maximum(cached[restore] - 1, 0) // page_size]),
        snap_window=t_(np.nonzero(snap)[0]),
        snap_page=t_(table[win_req[snap], (w[snap] * r) // page_size]),
    )


def _to(md: StepMetadata, device: torch.device | str) -> StepMetadata:
    for k, v in vars(md).items():
        if isinstance(v, torch.Tensor):
            setattr(md, k, v.to(device, non_blocking=True))
    for p in md.plans.values():
        for k, v in vars(p).items():
            if isinstance(v, torch.Tensor):
                setattr(p, k, v.to(device, non_blocking=True))
    return md
