"""A fixed-shape step's plans in two Triton launches (``deepseek_v4.fixed_step_plans``).

The reference (:func:`deepinfer_core.models.deepseek_v4.metadata.build_metadata`) derives a
step's per-token and per-window plans in about ninety PyTorch ops on a handful of integers,
each a launch of its own in a captured decode graph.  Here:

- :func:`_token_kernel`, a program per block of tokens: each token's request (the
  reference's ``searchsorted`` over the cumulative chunk lengths, as a count over the
  requests), its position and id (an async pending token taken from the previous step's
  samples), its sliding-window ring and chunk rows, ring row and realness, and per compress
  ratio its partial-window buffer row and visible-entry count; program 0 also writes the
  prefix hits' carry restores of a step that is not ``decoding``;
- :func:`_window_kernel`, a program per block of windows and ratio: each window's request,
  staging rows, overlap-series row, first position, pool row, carry row and page snapshot,
  padding windows to the trash slot / page, and the count of live windows.

Every request's fields are read by every program (a step has at most :data:`MAX_REQS`), and the
sums over requests the reference takes with ``cumsum`` + gathers are masked reductions over
them.  All values are int64 as in the reference, compared bit for bit by the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.contract.step_inputs import REQ_FIELDS
from deepinfer_core.models.deepseek_v4.metadata import StepMetadata, WindowPlan, buffer_windows
from deepinfer_core.ops.attention import PagedIndex

from ._common import pow2

MAX_REQS = 4096
"""Most requests (padding included) a step may have: each program holds all their fields."""
MAX_RATIOS = 4
"""Most distinct compress ratios a step's plans cover."""
CELLS = 8192
"""Target size of a program's token-by-request (window-by-request) comparison tile."""

F_SLOT, F_START, F_LEN, F_CACHED, F_FROM, F_PREV = (tl.constexpr(REQ_FIELDS.index(n)) for n in REQ_FIELDS)


@triton.jit
def _fmod(a, b):
    """Floor modulo (Python's and torch's ``%``) of int ``a`` by positive ``b``."""
    m = a % b
    return tl.where(m < 0, m + b, m)


@triton.jit
def _fdiv(a, b):
    """Floor division (Python's and torch's ``//``) of int ``a`` by positive ``b``."""
    return (a - _fmod(a, b)) // b


@triton.jit
def _pick(k: tl.constexpr, a, b, c, d):
    """The ``k``-th of four scalars (``k`` a compile-time index)."""
    if k == 0:
        v = a
    elif k == 1:
        v = b
    elif k == 2:
        v = c
    else:
        v = d
    return v


@triton.jit
def _upto(vals, req, at):
    """``sum(vals[i] for i <= at[j])`` per row ``j`` (``vals``, ``req``: ``[RB]``; ``at``: ``[B]``)."""
    return tl.sum(tl.where(req[None, :] <= at[:, None], vals[None, :], 0), 1)


@triton.jit
def _owner(cum, req, R, idx):
    """Per row ``idx[j]``: the request it belongs to, the count of requests ``i < R - 1`` whose
    inclusive sum ``cum[i]`` is at most ``idx[j]`` (``searchsorted(cum[:-1], idx, right=True)``)."""
    hit = (cum[None, :] <= idx[:, None]) & (req[None, :] < R - 1)
    return tl.sum(hit.to(tl.int32), 1)


@triton.jit
def _token_kernel(
    ids_ptr,
    fields_ptr,
    prev_ptr,
    tables_ptr,
    ids_out,
    pos_out,
    tok_req_out,
    ring_rows_out,
    real_out,
    wring_out,
    wchunk_out,
    buf_out,
    count_out,
    restore_rows_out,
    restore_page_out,
    T,
    R,
    P,
    table_stride,
    num_slots,
    trash_page,
    page_size,
    rows,
    r0,
    r1,
    r2,
    r3,
    nb0,
    nb1,
    nb2,
    nb3,
    W: tl.constexpr,
    WB: tl.constexpr,
    NR: tl.constexpr,
    HAS_PREV: tl.constexpr,
    DECODING: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RB: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    req = tl.arange(0, RB)
    rm = req < R
    length = tl.load(fields_ptr + F_LEN * R + req, mask=rm, other=0).to(tl.int32)
    cum = tl.cumsum(length, 0)
    tok_req = _owner(cum, req, R, t)
    cum_t = _upto(length, req, tok_req).to(tl.int64)
    slot_t = tl.load(fields_ptr + F_SLOT * R + tok_req, mask=tm, other=0)
    start_t = tl.load(fields_ptr + F_START * R + tok_req, mask=tm, other=0)
    len_t = tl.load(fields_ptr + F_LEN * R + tok_req, mask=tm, other=0)
    cached_t = tl.load(fields_ptr + F_CACHED * R + tok_req, mask=tm, other=0)
    from_t = tl.load(fields_ptr + F_FROM * R + tok_req, mask=tm, other=0)
    t64 = t.to(tl.int64)
    end_t = start_t + len_t
    pos = t64 - (cum_t - end_t)  # token row minus (its request's first row - start)
    ids = tl.load(ids_ptr + t, mask=tm, other=0)
    if HAS_PREV:
        prev_row = tl.load(fields_ptr + F_PREV * R + tok_req, mask=tm, other=-1)
        pending = (prev_row >= 0) & (pos == start_t)
        src = tl.load(prev_ptr + tl.maximum(prev_row, 0), mask=tm & pending, other=0).to(tl.int64)
        ids = tl.where(pending, src, ids)
    tl.store(ids_out + t, ids, mask=tm)
    tl.store(pos_out + t, pos, mask=tm)
    tl.store(tok_req_out + t, tok_req.to(tl.int64), mask=tm)
    tl.store(real_out + t, slot_t < num_slots, mask=tm)
    # a chunk's last W+S positions leave their key in the ring, others the trash slot's
    ring_slot = tl.where(cum_t > t64 + rows, num_slots, slot_t)
    tl.store(ring_rows_out + t, _fmod(pos, rows) + ring_slot * rows, mask=tm)
    if W > 0:
        j = tl.arange(0, WB)
        ahead = (j - (W - 1)).to(tl.int64)
        kpos = pos[:, None] + ahead[None, :]
        before = kpos < from_t[:, None]
        earlier = kpos < start_t[:, None]
        chunk = tl.where(before | earlier, -1, t64[:, None] + ahead[None, :])
        ring = tl.where(before | (earlier == 0), -1, _fmod(kpos, rows) + slot_t[:, None] * rows)
        at = t64[:, None] * W + j[None, :]
        wm = tm[:, None] & (j[None, :] < W)
        tl.store(wchunk_out + at, chunk, mask=wm)
        tl.store(wring_out + at, ring, mask=wm)
    for k in tl.static_range(NR):
        r = _pick(k, r0, r1, r2, r3)
        nb = _pick(k, nb0, nb1, nb2, nb3)
        span = nb * r
        # tokens of the last nb windows the chunk touches wait in the buffer, not those below
        # a prefix hit's cached boundary
        not_kept = pos < (1 - nb) * r + (end_t // r) * r
        if not DECODING:
            not_kept = not_kept | (pos < cached_t)
        buf_slot = tl.where(not_kept, num_slots, slot_t)
        tl.store(buf_out + k * T + t, _fmod(pos, span) + buf_slot * span, mask=tm)
        tl.store(count_out + k * T + t, (pos + 1) // r, mask=tm)
    if not DECODING and pid == 0:  # the prefix hits' carry restores, per request
        slot = tl.load(fields_ptr + F_SLOT * R + req, mask=rm, other=0)
        start = tl.load(fields_ptr + F_START * R + req, mask=rm, other=0)
        cached = tl.load(fields_ptr + F_CACHED * R + req, mask=rm, other=0)
        end = start + length.to(tl.int64)
        restore = (start < cached) & (cached <= end)
        col = _fdiv(cached - 1, page_size)
        col = tl.where(col < 0, col + P, col)  # a negative column counts from the end
        page_at = tl.load(tables_ptr + slot * table_stride + col, mask=rm, other=0)
        tl.store(restore_page_out + req, tl.where(restore, page_at, trash_page), mask=rm)
        for k in tl.static_range(NR):
            r = _pick(k, r0, r1, r2, r3)
            nb = _pick(k, nb0, nb1, nb2, nb3)
            row = _fmod(cached // r - 1, nb) + slot * nb
            tl.store(restore_rows_out + k * R + req, tl.where(restore, row, num_slots * nb), mask=rm)


@triton.jit
def _window_kernel(
    fields_ptr,
    tables_ptr,
    windows_out,
    vec_out,
    live_out,
    R,
    P,
    table_stride,
    M,
    num_slots,
    trash_page,
    page_size,
    r0,
    r1,
    r2,
    r3,
    nb0,
    nb1,
    nb2,
    nb3,
    m0,
    m1,
    m2,
    m3,
    o0,
    o1,
    o2,
    o3,
    NR: tl.constexpr,
    CB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    RB: tl.constexpr,
):
    pid = tl.program_id(0)
    k = tl.program_id(1)
    kk = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    req = tl.arange(0, RB)
    rm = req < R
    start = tl.load(fields_ptr + F_START * R + req, mask=rm, other=0)
    length = tl.load(fields_ptr + F_LEN * R + req, mask=rm, other=0)
    cached = tl.load(fields_ptr + F_CACHED * R + req, mask=rm, other=0)
    for g in tl.static_range(NR):
        if k == g:
            r = _pick(g, r0, r1, r2, r3)
            nb = _pick(g, nb0, nb1, nb2, nb3)
            bound = _pick(g, m0, m1, m2, m3)  # this ratio's windows (the rest of M: none)
            base = _pick(g, o0, o1, o2, o3)  # its windows' first element in windows_out
            end = start + length
            w0 = tl.maximum(start, cached) // r
            count = tl.maximum(end // r - w0, 0)
            count = tl.where(rm, count, 0).to(tl.int32)
            cumw = tl.cumsum(count, 0)
            total = tl.sum(count, 0)
            wm = kk < bound
            own = _owner(cumw, req, R, kk)  # each window's request
            cum_at = _upto(count, req, own).to(tl.int64)
            len_at = _upto(length.to(tl.int32), req, own).to(tl.int64)
            slot_w = tl.load(fields_ptr + F_SLOT * R + own, mask=wm, other=0)
            start_w = tl.load(fields_ptr + F_START * R + own, mask=wm, other=0)
            end_w = start_w + tl.load(fields_ptr + F_LEN * R + own, mask=wm, other=0)
            cached_w = tl.load(fields_ptr + F_CACHED * R + own, mask=wm, other=0)
            w0_w = tl.maximum(start_w, cached_w) // r
            first_w = cum_at - tl.maximum(end_w // r - w0_w, 0)  # the step's index of its first
            stage = len_at - end_w + (num_slots + 1) * nb * r  # staging row of position 0
            k64 = kk.to(tl.int64)
            dead = kk >= total  # padding windows
            w = tl.where(dead, 0, k64 + w0_w - first_w)
            positions = w * r
            carry = w % nb + slot_w * nb
            carries = (num_slots + 1) * nb
            prev_carry = _fmod(w - 1, nb) + slot_w * nb
            prev = tl.where(k64 > first_w, k64 + carries - 1, tl.where(w > 0, prev_carry, carries + bound))
            col = tl.minimum(positions // page_size, P - 1)
            page = tl.load(tables_ptr + slot_w * table_stride + col, mask=wm, other=0)
            epp = page_size // r
            in_page = w % epp
            dest = tl.where(dead, trash_page * epp, in_page + page * epp)
            drop = (k64 + nb < cum_at) | dead
            carry_rows = tl.where(drop, num_slots * nb, carry)
            snap = tl.where((in_page != epp - 1) | dead, trash_page, page)
            at = g * M + kk
            tl.store(vec_out + at, prev, mask=wm)
            tl.store(vec_out + NR * M + at, positions, mask=wm)
            tl.store(vec_out + 2 * NR * M + at, dest, mask=wm)
            tl.store(vec_out + 3 * NR * M + at, carry_rows, mask=wm)
            tl.store(vec_out + 4 * NR * M + at, snap, mask=wm)
            c = tl.arange(0, CB).to(tl.int64)
            q = positions[:, None] + c[None, :]
            buffered = c[None, :] + carry[:, None] * r
            rows = tl.where(q < start_w[:, None], buffered, q + stage[:, None])
            rows = tl.where(dead[:, None], 0, rows)
            cm = wm[:, None] & (c[None, :] < r)
            tl.store(windows_out + base + k64[:, None] * r + c[None, :], rows, mask=cm)
            if pid == 0:
                tl.store(live_out + g, total.to(tl.int64))


def _ratio_args(values: list[int], fill: int) -> list[int]:
    return values + [fill] * (MAX_RATIOS - len(values))


def fixed_step_plans(
    inputs,
    window: int,
    ratios: tuple[int, ...],
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens=0,
) -> StepMetadata:
    """``deepseek_v4.fixed_step_plans`` in two launches (and the block-table rows of the step's
    requests, one gather): see the module docstring; the contract is the op's reference."""
    ratios = sorted(set(ratios))
    bad = [r for r in ratios if page_size % r]
    if bad:
        raise ValueError(f"page_size {page_size} is not a multiple of the compress ratios {bad}")
    t, n_req = inputs.num_tokens, inputs.num_reqs
    dev = inputs.input_ids.device
    fields = inputs.fields().contiguous()
    block_tables = inputs.block_tables
    p = block_tables.shape[1]
    rows = window + num_spec_tokens
    nbs = [buffer_windows(r, num_spec_tokens) for r in ratios]
    nr = len(ratios)
    rb = pow2(n_req)
    prev = inputs.prev_tokens
    has_prev = prev is not None and prev.shape[0] > 0
    i64 = dict(dtype=torch.int64, device=dev)
    ids, pos, tok_req, ring_rows = (torch.empty(t, **i64) for _ in range(4))
    real = torch.empty(t, dtype=torch.bool, device=dev)
    wring = torch.empty((t, window), **i64)
    wchunk = torch.empty((t, window), **i64)
    buf = torch.empty((nr, t), **i64)
    counts = torch.empty((nr, t), **i64)
    decoding = inputs.decoding
    restore_rows = None if decoding else torch.empty((nr, n_req), **i64)
    restore_page = None if decoding else torch.empty(n_req, **i64)
    ratio_args = _ratio_args(ratios, 1) + _ratio_args(nbs, 1)
    block_t = max(1, min(64, CELLS // rb))
    _token_kernel[(triton.cdiv(t, block_t),)](
        inputs.input_ids,
        fields,
        prev if has_prev else ids,
        block_tables,
        ids,
        pos,
        tok_req,
        ring_rows,
        real,
        wring,
        wchunk,
        buf,
        counts,
        restore_rows if restore_rows is not None else buf,
        restore_page if restore_page is not None else buf,
        t,
        n_req,
        p,
        block_tables.stride(0),
        num_slots,
        trash_page,
        page_size,
        rows,
        *ratio_args,
        W=window,
        WB=pow2(window),
        NR=nr,
        HAS_PREV=has_prev,
        DECODING=decoding,
        BLOCK_T=block_t,
        RB=rb,
    )
    tables = block_tables.index_select(0, inputs.req["slot"])
    bounds = [min(t, t // r + n_req) for r in ratios]
    m = max(bounds, default=0)
    plans = {}
    if nr:
        offsets = [sum(b * r for b, r in zip(bounds[:i], ratios[:i], strict=True)) for i in range(nr)]
        windows = torch.empty(sum(b * r for b, r in zip(bounds, ratios, strict=True)), **i64)
        vec = torch.empty((5, nr, m), **i64)
        live = torch.empty(nr, **i64)
        block_m = max(1, min(64, CELLS // rb))
        _window_kernel[(triton.cdiv(m, block_m), nr)](
            fields,
            block_tables,
            windows,
            vec,
            live,
            n_req,
            p,
            block_tables.stride(0),
            m,
            num_slots,
            trash_page,
            page_size,
            *ratio_args,
            *_ratio_args(bounds, 0),
            *_ratio_args(offsets, 0),
            NR=nr,
            CB=pow2(max(ratios)),
            BLOCK_M=block_m,
            RB=rb,
        )
        for i, r in enumerate(ratios):
            b = bounds[i]
            prev_w, positions, dest, carry_rows, snap = (vec[j, i, :b] for j in range(5))
            plans[r] = WindowPlan(
                ratio=r,
                windows=windows[offsets[i] : offsets[i] + b * r].view(b, r),
                prev=prev_w,
                positions=positions,
                dest=dest,
                carry_rows=carry_rows,
                buf_rows=buf[i],
                entries=PagedIndex(
                    block_table=tables,
                    token_rows=tok_req,
                    counts=counts[i],
                    entries_per_page=page_size // r,
                    max_count=inputs.max_end // r,
                ),
                restore_rows=None if restore_rows is None else restore_rows[i],
                restore_page=restore_page,
                snap_page=snap,
                live=live[i : i + 1],
            )
    return StepMetadata(
        input_ids=ids,
        positions=pos,
        window_ring=wring,
        window_chunk=wchunk,
        ring_rows=ring_rows,
        plans=plans,
        sample_rows=inputs.sample_rows,
        num_slots=num_slots,
        real_tokens=real,
    )
