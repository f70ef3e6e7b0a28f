"""Per-step index plans for a flat varlen batch over the paged hybrid cache.

Built once per step on the host from the scheduled chunks and shared by every layer:
the sliding-window key lists, and per compress ratio the compressor's window plan (which
rows form each closed window, where the overlap carry comes from, where entries are
written) and each query's causal candidate entries.  All index tensors are int64 with
``-1`` for "none".
"""

from __future__ import annotations

from dataclasses import dataclass

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
    may see (entries of windows closed at or before it).
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
    lens = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
    start = torch.tensor([c.start_pos for c in chunks], dtype=torch.long)
    slot = torch.tensor([c.seq_slot for c in chunks], dtype=torch.long)
    r_ids = torch.arange(len(chunks))
    tok_req = torch.repeat_interleave(r_ids, lens)
    offset = torch.cumsum(lens, 0) - lens
    t = int(lens.sum())
    tok_idx = torch.arange(t)
    pos = start[tok_req] + tok_idx - offset[tok_req]
    end = start + lens
    ids = torch.tensor([x for c in chunks for x in c.token_ids], dtype=torch.long)

    # sliding window: keys at positions pos-W+1 .. pos
    kpos = pos[:, None] - (window - 1) + torch.arange(window)
    valid = kpos >= 0
    in_chunk = kpos >= start[tok_req][:, None]
    chunk_rows = offset[tok_req][:, None] + kpos - start[tok_req][:, None]
    ring_rows_q = slot[tok_req][:, None] * window + kpos.remainder(window)
    window_chunk = torch.where(valid & in_chunk, chunk_rows, -1)
    window_ring = torch.where(valid & ~in_chunk, ring_rows_q, -1)
    keep = pos >= (end[tok_req] - window)
    ring_tokens = tok_idx[keep]
    ring_rows = slot[tok_req][keep] * window + pos[keep].remainder(window)

    max_pages = max((len(c.block_table) for c in chunks), default=0)
    table = torch.full((len(chunks), max(max_pages, 1)), -1, dtype=torch.long)
    for i, c in enumerate(chunks):
        if c.block_table:
            table[i, : len(c.block_table)] = torch.tensor(c.block_table, dtype=torch.long)

    plans = {}
    for r in sorted(set(ratios)):
        plans[r] = _window_plan(r, pos, tok_req, start, end, slot, offset, table, page_size, num_slots)
    sample: list[int] = []
    for i, c in enumerate(chunks):
        if c.all_logits:
            sample.extend(range(int(offset[i]), int(offset[i] + lens[i])))
        elif c.sample:
            sample.append(int(offset[i] + lens[i] - 1))
    md = StepMetadata(
        input_ids=ids,
        positions=pos,
        window_ring=window_ring,
        window_chunk=window_chunk,
        ring_rows=ring_rows,
        ring_tokens=ring_tokens,
        plans=plans,
        sample_rows=torch.tensor(sample, dtype=torch.long),
        num_slots=num_slots,
    )
    return md if str(device) == "cpu" else _to(md, device)


def _entry_rows(
    req: torch.Tensor, entry: torch.Tensor, r: int, table: torch.Tensor, page_size: int
) -> torch.Tensor:
    tok0 = entry * r
    page = table[req, tok0 // page_size]
    return page * (page_size // r) + (tok0 % page_size) // r


def _window_plan(
    r: int,
    pos: torch.Tensor,
    tok_req: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    slot: torch.Tensor,
    offset: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    num_slots: int,
) -> WindowPlan:
    w0 = start // r
    m = end // r - w0  # windows closed this step per request
    win_req = torch.repeat_interleave(torch.arange(len(start)), m)
    first = torch.cumsum(m, 0) - m
    j = torch.arange(int(m.sum())) - first[win_req]
    w = w0[win_req] + j
    q = w[:, None] * r + torch.arange(r)
    from_buf = q < start[win_req][:, None]
    staging_tok0 = num_slots * r
    windows = torch.where(
        from_buf,
        slot[win_req][:, None] * r + q.remainder(r),
        staging_tok0 + offset[win_req][:, None] + q - start[win_req][:, None],
    )
    n_win = windows.shape[0]
    win_idx = torch.arange(n_win)
    prev = torch.where(j > 0, num_slots + win_idx - 1, torch.where(w > 0, slot[win_req], num_slots + n_win))
    dest = _entry_rows(win_req, w, r, table, page_size)
    has = m > 0
    carry_slot = slot[has]
    carry_window = (first + m - 1)[has]
    tail = pos >= (end[tok_req] // r) * r
    buf_tokens = torch.nonzero(tail).flatten()
    buf_rows = slot[tok_req][tail] * r + pos[tail].remainder(r)
    # causal candidates: entry e visible to the query at pos p iff e < (p+1)//r
    count = (pos + 1) // r
    cmax = int(count.max()) if count.numel() else 0
    e = torch.arange(cmax)
    ok = e[None, :] < count[:, None]
    rows = _entry_rows(
        tok_req[:, None].expand(-1, cmax), e[None, :].expand(len(pos), -1), r, table, page_size
    )
    candidates = torch.where(ok, rows, -1)
    return WindowPlan(
        r, windows, prev, w * r, dest, carry_slot, carry_window, buf_rows, buf_tokens, candidates
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
