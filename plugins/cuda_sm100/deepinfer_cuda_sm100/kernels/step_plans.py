"""A fixed-shape step's plans (``deepseek_v4.fixed_step_plans``): a launch for the tokens and one
per compress ratio.

The reference (:func:`deepinfer_core.models.deepseek_v4.metadata.build_metadata`) derives a
step's per-token and per-window plans in about ninety PyTorch ops on a handful of integers,
each a launch of its own in a captured decode graph.  Here:

- :func:`_token_kernel`, a program per block of tokens: each token's request (the
  reference's ``searchsorted`` over the cumulative chunk lengths, as a count over the
  requests), its position and id (an async pending token taken from the previous step's
  samples), its sliding-window ring and chunk rows, ring row and realness, and per compress
  ratio its partial-window buffer row and visible-entry count; program 0 also writes the
  prefix hits' carry restores of a step that is not ``decoding``;
- :func:`_window_kernel`, a launch per compress ratio, a program per block of windows: each
  window's request, staging rows, overlap-series row, first position, pool row, carry row and
  page snapshot, padding windows to the trash slot / page, and the count of live windows.

Every request's fields are read by every program (a step has at most :data:`MAX_REQS`), and the
sums over requests the reference takes with ``cumsum`` + gathers are masked reductions over
them.  The arithmetic is int32 with the ratios, buffer depths, ring rows and page size as
compile-time constants (no division left in the code); the outputs are int64 as in the
reference, compared bit for bit by the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.contract.step_inputs import REQ_FIELDS
from deepinfer_core.models.deepseek_v4.metadata import StepMetadata, WindowPlan, buffer_windows
from deepinfer_core.ops.attention import PagedIndex

from ._common import pow2
from .pdl import pdl_args, pdl_enter

MAX_REQS = 4096
"""Most requests (padding included) a step may have: each program holds all their fields."""
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
def _field(fields_ptr, f: tl.constexpr, R, at, mask):
    """Field ``f`` of the requests ``at`` (int32; 0 where masked)."""
    return tl.load(fields_ptr + f * R + at, mask=mask, other=0).to(tl.int32)


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
def _ratio_rows(
    pos,
    end_t,
    cached_t,
    slot_t,
    t,
    tm,
    buf_out,
    count_out,
    T,
    num_slots,
    k: tl.constexpr,
    RATIO: tl.constexpr,
    NB: tl.constexpr,
    DECODING: tl.constexpr,
):
    """Ratio ``k``'s partial-window buffer row and visible-entry count of each token."""
    # tokens of the last NB windows the chunk touches wait in the buffer, not those below a
    # prefix hit's cached boundary
    not_kept = pos < (1 - NB) * RATIO + (end_t // RATIO) * RATIO
    if not DECODING:
        not_kept = not_kept | (pos < cached_t)
    buf_slot = tl.where(not_kept, num_slots, slot_t)
    span: tl.constexpr = NB * RATIO
    tl.store(buf_out + k * T + t, (_fmod(pos, span) + buf_slot * span).to(tl.int64), mask=tm)
    tl.store(count_out + k * T + t, ((pos + 1) // RATIO).to(tl.int64), mask=tm)


@triton.jit
def _restores(
    fields_ptr,
    tables_ptr,
    restore_rows_out,
    restore_page_out,
    R,
    P,
    table_stride,
    num_slots,
    trash_page,
    k: tl.constexpr,
    RATIO: tl.constexpr,
    NB: tl.constexpr,
    PAGE: tl.constexpr,
    RB: tl.constexpr,
):
    """The prefix hits' carry restores of ratio ``k``, per request (and the pages, with ``k`` 0)."""
    req = tl.arange(0, RB)
    rm = req < R
    slot = _field(fields_ptr, F_SLOT, R, req, rm)
    start = _field(fields_ptr, F_START, R, req, rm)
    cached = _field(fields_ptr, F_CACHED, R, req, rm)
    end = start + _field(fields_ptr, F_LEN, R, req, rm)
    restore = (start < cached) & (cached <= end)
    if k == 0:
        col = _fdiv(cached - 1, PAGE)
        col = tl.where(col < 0, col + P, col)  # a negative column counts from the end
        page_at = tl.load(tables_ptr + slot.to(tl.int64) * table_stride + col, mask=rm, other=0)
        tl.store(restore_page_out + req, tl.where(restore, page_at, trash_page), mask=rm)
    row = _fmod(cached // RATIO - 1, NB) + slot * NB
    tl.store(restore_rows_out + k * R + req, tl.where(restore, row, num_slots * NB).to(tl.int64), mask=rm)


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
    W: tl.constexpr,
    WB: tl.constexpr,
    ROWS: tl.constexpr,
    PAGE: tl.constexpr,
    NR: tl.constexpr,
    RATIOS: tl.constexpr,
    NBS: tl.constexpr,
    HAS_PREV: tl.constexpr,
    DECODING: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RB: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    req = tl.arange(0, RB)
    length = _field(fields_ptr, F_LEN, R, req, req < R)
    tok_req = _owner(tl.cumsum(length, 0), req, R, t)
    cum_t = _upto(length, req, tok_req)
    slot_t = _field(fields_ptr, F_SLOT, R, tok_req, tm)
    start_t = _field(fields_ptr, F_START, R, tok_req, tm)
    cached_t = _field(fields_ptr, F_CACHED, R, tok_req, tm)
    from_t = _field(fields_ptr, F_FROM, R, tok_req, tm)
    end_t = start_t + _field(fields_ptr, F_LEN, R, tok_req, tm)
    pos = t - (cum_t - end_t)  # token row minus (its request's first row - start)
    ids = tl.load(ids_ptr + t, mask=tm, other=0)
    if HAS_PREV:
        prev_row = tl.load(fields_ptr + F_PREV * R + tok_req, mask=tm, other=-1)
        pending = (prev_row >= 0) & (pos == start_t)
        src = tl.load(prev_ptr + tl.maximum(prev_row, 0), mask=tm & pending, other=0).to(tl.int64)
        ids = tl.where(pending, src, ids)
    tl.store(ids_out + t, ids, mask=tm)
    tl.store(pos_out + t, pos.to(tl.int64), mask=tm)
    tl.store(tok_req_out + t, tok_req.to(tl.int64), mask=tm)
    tl.store(real_out + t, slot_t < num_slots, mask=tm)
    # a chunk's last W+S positions leave their key in the ring, others the trash slot's
    ring_slot = tl.where(cum_t > t + ROWS, num_slots, slot_t)
    tl.store(ring_rows_out + t, (_fmod(pos, ROWS) + ring_slot * ROWS).to(tl.int64), mask=tm)
    if W > 0:
        j = tl.arange(0, WB)
        ahead = j - (W - 1)
        kpos = pos[:, None] + ahead[None, :]
        before = kpos < from_t[:, None]
        earlier = kpos < start_t[:, None]
        chunk = tl.where(before | earlier, -1, t[:, None] + ahead[None, :])
        # kpos % ROWS without a division per key: W <= ROWS, so one wrap at most
        ring = _fmod(pos - (W - 1), ROWS)[:, None] + j[None, :]
        ring = tl.where(ring >= ROWS, ring - ROWS, ring) + slot_t[:, None] * ROWS
        ring = tl.where(before | (earlier == 0), -1, ring)
        at = t.to(tl.int64)[:, None] * W + j[None, :]
        wm = tm[:, None] & (j[None, :] < W)
        tl.store(wchunk_out + at, chunk.to(tl.int64), mask=wm)
        tl.store(wring_out + at, ring.to(tl.int64), mask=wm)
    for k in tl.static_range(NR):
        _ratio_rows(
            pos,
            end_t,
            cached_t,
            slot_t,
            t,
            tm,
            buf_out,
            count_out,
            T,
            num_slots,
            k,
            RATIOS[k],
            NBS[k],
            DECODING,
        )
        if not DECODING and pid == 0:
            restore_args = (restore_rows_out, restore_page_out, R, P, table_stride, num_slots, trash_page)
            _restores(fields_ptr, tables_ptr, *restore_args, k, RATIOS[k], NBS[k], PAGE, RB)


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
    num_slots,
    trash_page,
    M,
    RATIO: tl.constexpr,
    NB: tl.constexpr,
    PAGE: tl.constexpr,
    RC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    RB: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    kk = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    wm = kk < M
    req = tl.arange(0, RB)
    rm = req < R
    start = _field(fields_ptr, F_START, R, req, rm)
    length = _field(fields_ptr, F_LEN, R, req, rm)
    cached = _field(fields_ptr, F_CACHED, R, req, rm)
    # per request: the windows it closes from its first uncached one (cached is page- hence
    # window-aligned), and their inclusive sum over the requests
    count = tl.maximum((start + length) // RATIO - tl.maximum(start, cached) // RATIO, 0)
    total = tl.sum(count, 0)
    own = _owner(tl.cumsum(count, 0), req, R, kk)  # each window's request
    cum_at = _upto(count, req, own)
    len_at = _upto(length, req, own)
    slot_w = _field(fields_ptr, F_SLOT, R, own, wm)
    start_w = _field(fields_ptr, F_START, R, own, wm)
    end_w = start_w + _field(fields_ptr, F_LEN, R, own, wm)
    w0_w = tl.maximum(start_w, _field(fields_ptr, F_CACHED, R, own, wm)) // RATIO
    first_w = cum_at - tl.maximum(end_w // RATIO - w0_w, 0)  # the step's index of its first
    stage = len_at - end_w + (num_slots + 1) * NB * RATIO  # staging row of its position 0
    dead = kk >= total  # padding windows
    w = tl.where(dead, 0, kk + w0_w - first_w)
    positions = w * RATIO
    carry = w % NB + slot_w * NB
    carries = (num_slots + 1) * NB
    prev_carry = _fmod(w - 1, NB) + slot_w * NB
    prev = tl.where(kk > first_w, kk + carries - 1, tl.where(w > 0, prev_carry, carries + M))
    col = tl.minimum(positions // PAGE, P - 1)
    page = tl.load(tables_ptr + slot_w.to(tl.int64) * table_stride + col, mask=wm, other=0).to(tl.int32)
    epp: tl.constexpr = PAGE // RATIO
    in_page = w % epp
    dest = tl.where(dead, trash_page * epp, in_page + page * epp)
    drop = (kk + NB < cum_at) | dead
    carry_rows = tl.where(drop, num_slots * NB, carry)
    snap = tl.where((in_page != epp - 1) | dead, trash_page, page)
    tl.store(vec_out + kk, prev.to(tl.int64), mask=wm)
    tl.store(vec_out + M + kk, positions.to(tl.int64), mask=wm)
    tl.store(vec_out + 2 * M + kk, dest.to(tl.int64), mask=wm)
    tl.store(vec_out + 3 * M + kk, carry_rows.to(tl.int64), mask=wm)
    tl.store(vec_out + 4 * M + kk, snap.to(tl.int64), mask=wm)
    c = tl.arange(0, RC)
    q = positions[:, None] + c[None, :]
    # position q of an earlier step: buffer row slot*NB*RATIO + q % (NB*RATIO) = carry*RATIO + q % RATIO
    rows = tl.where(q < start_w[:, None], c[None, :] + carry[:, None] * RATIO, q + stage[:, None])
    rows = tl.where(dead[:, None], 0, rows)
    cm = wm[:, None] & (c[None, :] < RATIO)
    tl.store(windows_out + kk.to(tl.int64)[:, None] * RATIO + c[None, :], rows.to(tl.int64), mask=cm)
    if pid == 0:
        tl.store(live_out, total.to(tl.int64))


def _block(n: int, rb: int, width: int) -> int:
    """Rows a program takes: ``n`` rounded up to a power of two, at most what keeps its
    row-by-request tile within :data:`CELLS` and its row-by-``width`` tile within 2048."""
    return max(2, min(pow2(n), CELLS // rb, 2048 // width))


def fixed_step_plans(
    inputs,
    window: int,
    ratios: tuple[int, ...],
    page_size: int,
    num_slots: int,
    trash_page: int,
    num_spec_tokens=0,
) -> StepMetadata:
    """``deepseek_v4.fixed_step_plans``: one launch for the per-token plans, one per compress
    ratio for its windows, and the block-table rows of the step's requests (one gather); see
    the module docstring; the contract is the op's reference."""
    ratios = sorted(set(ratios))
    bad = [r for r in ratios if page_size % r]
    if bad:
        raise ValueError(f"page_size {page_size} is not a multiple of the compress ratios {bad}")
    t, n_req = inputs.num_tokens, inputs.num_reqs
    dev = inputs.input_ids.device
    fields = inputs.fields().contiguous()
    block_tables = inputs.block_tables
    p = block_tables.shape[1]
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
    block_t = _block(t, rb, pow2(window))
    geometry = (n_req, p, block_tables.stride(0), num_slots, trash_page)  # R, P, table_stride, ...
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
        *geometry,
        W=window,
        WB=pow2(window),
        ROWS=window + num_spec_tokens,
        PAGE=page_size,
        NR=nr,
        RATIOS=tuple(ratios),
        NBS=tuple(nbs),
        HAS_PREV=has_prev,
        DECODING=decoding,
        BLOCK_T=block_t,
        RB=rb,
        **pdl_args(),
    )
    tables = block_tables.index_select(0, inputs.req["slot"])
    plans = {}
    for i, r in enumerate(ratios):
        m = min(t, t // r + n_req)  # a fixed-shape step's bound on the windows it closes
        windows = torch.empty((m, r), **i64)
        vec = torch.empty((5, m), **i64)
        live = torch.empty(1, **i64)
        block_m = _block(m, rb, pow2(r))
        _window_kernel[(triton.cdiv(m, block_m),)](
            fields,
            block_tables,
            windows,
            vec,
            live,
            *geometry,
            m,
            RATIO=r,
            NB=nbs[i],
            PAGE=page_size,
            RC=pow2(r),
            BLOCK_M=block_m,
            RB=rb,
            **pdl_args(),
        )
        prev_w, positions, dest, carry_rows, snap = vec.unbind(0)
        plans[r] = WindowPlan(
            ratio=r,
            windows=windows,
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
            live=live,
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
