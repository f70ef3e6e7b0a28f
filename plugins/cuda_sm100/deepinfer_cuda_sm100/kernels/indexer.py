"""``indexer_topk``: Lightning-indexer scores and top-k selection (contract: ``ops/attention.py``).

Two kernels, no full sort:

1. **Scores** (grid ``(T, candidate groups)``): a program loads one token's ``[H, Di]``
   indexer query once and, for each block of ``BLOCK_C`` candidates (explicit rows, or the
   entries of a :class:`PagedIndex` located through its block table), gathers the key rows and
   computes ``sum_h w[t,h] * relu(q[t,h] . key) * scale`` with ``tl.dot`` over
   ``[H, Di] x [Di, BLOCK_C]``, in fp32.  Invalid candidates score ``-inf``; ``-0.0`` becomes
   ``+0.0`` so that equal scores compare equal as bits.  The scores go to a ``[T, C]`` fp32
   scratch.
2. **Select** (grid ``(T,)``): a radix select of the ``k``-th largest score on an
   order-preserving integer image of the fp32 bits, four 256-bin histogram passes (8 bits
   each) over the row; then one pass in column order keeps every candidate above the
   threshold and the earliest ones equal to it (the reference's tie rule: stable descending
   sort).  Default mode sorts only the ``k`` picks (bitonic ``tl.sort`` of
   ``(score bits, ~column)`` keys: best first, ties to the earlier column); batch-invariant
   mode keeps them in column order, as the contract asks.  Few long rows (decode at long
   contexts) take a threshold path instead, several programs per row: the ``k``-th largest
   of the maxima of ``G >= 2k`` strided column groups bounds the ``k``-th best from below, and
   only the few candidates at or above it are sorted (:func:`select_topk`; the static rule
   :func:`plan_select`; the backend's dispatcher, :mod:`deepinfer_cuda_sm100.indexer_select`,
   takes it only where the measured table found it faster).

A candidate's score is computed the same way whatever the batch (fixed ``BLOCK_C`` tiles,
one token per program) and the selection is exact on those scores, so a row's picks never
depend on the other rows or on trailing ``-1`` padding.  Graph-capturable: grids and
scratch sizes from shapes only, no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.modes import batch_invariant_enabled

from ._common import INTERPRETED, cdiv, paged_row, pow2
from .fp8_gemm import sm_count
from .pdl import pdl_args, pdl_enter

CAND_IDENTITY, CAND_ROWS, CAND_PAGED = 0, 1, 2
"""Candidate forms: column = pool row (scores given directly), explicit rows, paged entries."""

MAX_HEADS = 128
MAX_INDEX_DIM = 512
MAX_TOPK = 4096
"""Largest ``min(k, C)``: the picks are sorted in one program (bitonic sort in registers)."""

_SIGN = tl.constexpr(-(2**31))  # int32 sign bit
_I64_MIN = tl.constexpr(-(2**63))
_LOW32 = tl.constexpr(2**32 - 1)


@dataclass(frozen=True)
class IndexerConfig:
    """Tiles of the score kernel and the select kernel (static per ``(H, Di)``)."""

    block_c: int
    blocks_per_prog: int
    score_warps: int
    sel_block: int
    sel_warps: int


def default_config(h: int, di: int) -> IndexerConfig:
    """Tiles from static shapes only (never ``T`` or ``C``: a score's tile is fixed)."""
    if INTERPRETED:
        return IndexerConfig(block_c=32, blocks_per_prog=2, score_warps=4, sel_block=32, sel_warps=4)
    # measured on an H200 (scripts/bench_attention.py --tune): 128 x 4 candidates per program
    return IndexerConfig(block_c=128, blocks_per_prog=4, score_warps=4, sel_block=2048, sel_warps=8)


# ---------------------------------------------------------------------------------------------
# candidates -> pool rows


@triton.jit
def _cand_rows(
    KIND: tl.constexpr, cols, ok, t, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp
):
    """Pool rows of candidate columns ``cols`` (``-1`` where invalid or not ``ok``; a paged
    entry whose page the block table does not hold, a negative id, is invalid too, as the
    reference's negative row)."""
    if KIND == 0:
        r = tl.where(ok, cols.to(tl.int64), -1)
    elif KIND == 1:
        r = tl.load(cand_ptr + t * sc_t + cols * sc_c, mask=ok, other=-1).to(tl.int64)
    else:
        v = ok & (cols < count)
        e = tl.where(v, cols, 0).to(tl.int32)
        r = paged_row(e, epp, bt_ptr + trow * bt0, bt1, npages, v)
        r = tl.where(v & (r >= 0), r, -1)
    return r


@triton.jit
def _paged_scalars(KIND: tl.constexpr, t, trow_ptr, trs, cnt_ptr, cs, max_count):
    if KIND == 2:
        trow = tl.load(trow_ptr + t * trs)
        count = tl.minimum(tl.maximum(tl.load(cnt_ptr + t * cs), 0), max_count)
    else:
        trow = 0
        count = 0
    return trow, count


@triton.jit
def _row_extent(KIND: tl.constexpr, t, C, KK, trow_ptr, trs, cnt_ptr, cs, max_count):
    """Row ``t``'s block-table row and entry count (paged candidates), the columns a selection
    scans ``n`` and its picks ``kk``: a paged row's columns past its count score ``-inf``, so
    it scans its entries only and picks at most that many."""
    trow, count = _paged_scalars(KIND, t, trow_ptr, trs, cnt_ptr, cs, max_count)
    n, kk = C, KK
    if KIND == 2:
        n = tl.minimum(count, C).to(tl.int32)
        kk = tl.minimum(n, KK)
    return trow, count, n, kk


# ---------------------------------------------------------------------------------------------
# scores


@triton.jit
def _score_kernel(
    q_ptr,
    sq_t,
    sq_h,
    w_ptr,
    sw_t,
    sw_h,
    key_ptr,
    sk,
    cand_ptr,
    sc_t,
    sc_c,
    bt_ptr,
    bt0,
    bt1,
    npages,
    trow_ptr,
    trs,
    cnt_ptr,
    cs,
    max_count,
    epp,
    scores_ptr,
    ss_t,
    C,
    H,
    DI,
    scale,
    KIND: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    dmask = d < DI
    q = tl.load(
        q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    qt = tl.trans(q)  # [BLOCK_D, BLOCK_H]
    w = tl.load(w_ptr + t * sw_t + heads * sw_h, mask=hmask, other=0.0).to(tl.float32)
    trow, count = _paged_scalars(KIND, t, trow_ptr, trs, cnt_ptr, cs, max_count)
    for i in range(BLOCKS):
        cols = (g * BLOCKS + i) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = cols < C
        rows = _cand_rows(
            KIND, cols, inside, t, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp
        )
        valid = rows >= 0
        k = tl.load(
            key_ptr + tl.where(valid, rows, 0)[:, None] * sk + d[None, :],
            mask=valid[:, None] & dmask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
        # [BLOCK_C, BLOCK_H]: candidates as the MMA's rows, heads as its columns, so that the
        # weighted sum over heads stays within a few threads of each row
        if IEEE:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
            s = tl.dot(k, qt, input_precision="ieee")
        else:
            s = tl.dot(k, qt)
        s = tl.maximum(s, 0.0) * scale
        score = tl.sum(s * w[None, :], 1)
        score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: equal scores, equal bits
        score = tl.where(valid, score, float("-inf"))
        tl.store(scores_ptr + t * ss_t + cols, score, mask=inside)


# ---------------------------------------------------------------------------------------------
# selection


@triton.jit
def _ordered(s):
    """fp32 -> int32 bit pattern whose *unsigned* order is the float order (``-0 < +0``)."""
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b ^ _SIGN, ~b)


@triton.jit
def _hist_block(
    row_ptr, C, c0, prefix, PMASK: tl.constexpr, SHIFT: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr
):
    cols = c0 + tl.arange(0, BLOCK)
    inside = cols < C
    o = _ordered(tl.load(row_ptr + cols, mask=inside, other=0.0))
    m = inside & ((o & PMASK) == prefix)
    digit = (o >> SHIFT) & (NB - 1)
    return tl.histogram(digit, NB, mask=m)


@triton.jit
def _radix_pass(
    row_ptr,
    C,
    prefix,
    remaining,
    PMASK: tl.constexpr,
    SHIFT: tl.constexpr,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Fix the next digit of the threshold: the largest digit ``d`` such that at least
    ``remaining`` candidates (matching ``prefix``) have a digit ``>= d``."""
    hist = tl.zeros([NB], tl.int32)
    if INTERP:
        c0 = 0
        while c0 < C:
            hist += _hist_block(row_ptr, C, c0, prefix, PMASK, SHIFT, NB, BLOCK)
            c0 += BLOCK
    else:
        for c0 in range(0, C, BLOCK):
            hist += _hist_block(row_ptr, C, c0, prefix, PMASK, SHIFT, NB, BLOCK)
    bins = tl.arange(0, NB)
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # candidates with digit >= bin
    digit = tl.max(tl.where(at_least >= remaining, bins, -1), 0)
    above = tl.sum(tl.where(bins > digit, hist, 0), 0)
    return prefix | (digit << SHIFT), remaining - above


@triton.jit
def _gather_block(
    row_ptr,
    C,
    c0,
    thr,
    need_eq,
    eq_seen,
    npicked,
    t,
    out_row,
    tmp_row,
    KIND: tl.constexpr,
    cand_ptr,
    sc_t,
    sc_c,
    bt_ptr,
    bt0,
    bt1,
    npages,
    trow,
    count,
    epp,
    COLUMN_ORDER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = c0 + tl.arange(0, BLOCK)
    inside = cols < C
    o = _ordered(tl.load(row_ptr + cols, mask=inside, other=0.0))
    key = o ^ _SIGN  # signed order = float order
    gt = inside & (key > (thr ^ _SIGN))
    eq = inside & (o == thr)
    eqi = eq.to(tl.int32)
    eq_rank = eq_seen + tl.cumsum(eqi, 0) - eqi
    sel = gt | (eq & (eq_rank < need_eq))
    seli = sel.to(tl.int32)
    pos = npicked + tl.cumsum(seli, 0) - seli
    if COLUMN_ORDER:
        rows = _cand_rows(
            KIND, cols, sel, t, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp
        )
        tl.store(out_row + pos, rows, mask=sel)
    else:
        low = tl.full([BLOCK], _LOW32, tl.int64) - cols.to(tl.int64)  # earlier column: larger
        packed = (key.to(tl.int64) << 32) | low
        tl.store(tmp_row + pos, packed, mask=sel)
    return eq_seen + tl.sum(eqi, 0), npicked + tl.sum(seli, 0)


@triton.jit
def _select_row(
    row_ptr,
    C,
    KK,
    t,
    out_row,
    tmp_row,
    KIND: tl.constexpr,
    cand_ptr,
    sc_t,
    sc_c,
    bt_ptr,
    bt0,
    bt1,
    npages,
    trow,
    count,
    epp,
    COLUMN_ORDER: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One program's radix select of a whole row: its top ``KK`` to ``out_row``."""
    prefix = tl.zeros((), tl.int32)
    remaining = tl.zeros((), tl.int32) + KK
    # four 8-bit digits, most significant first (PMASK: the bits fixed by earlier passes)
    prefix, remaining = _radix_pass(row_ptr, C, prefix, remaining, 0, 24, 256, BLOCK, INTERP)
    prefix, remaining = _radix_pass(row_ptr, C, prefix, remaining, -16777216, 16, 256, BLOCK, INTERP)
    prefix, remaining = _radix_pass(row_ptr, C, prefix, remaining, -65536, 8, 256, BLOCK, INTERP)
    prefix, remaining = _radix_pass(row_ptr, C, prefix, remaining, -256, 0, 256, BLOCK, INTERP)
    # prefix: the k-th largest score's bits; remaining: how many equal to it are kept
    eq_seen = tl.zeros((), tl.int32)
    npicked = tl.zeros((), tl.int32)
    if INTERP:
        c0 = 0
        while c0 < C:
            eq_seen, npicked = _gather_block(
                row_ptr, C, c0, prefix, remaining, eq_seen, npicked, t, out_row, tmp_row,
                KIND, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp, COLUMN_ORDER, BLOCK,
            )  # fmt: skip
            c0 += BLOCK
    else:
        for c0 in range(0, C, BLOCK):
            eq_seen, npicked = _gather_block(
                row_ptr, C, c0, prefix, remaining, eq_seen, npicked, t, out_row, tmp_row,
                KIND, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp, COLUMN_ORDER, BLOCK,
            )  # fmt: skip
    if not COLUMN_ORDER:
        tl.debug_barrier()  # the picks were written by other threads of this program
        i = tl.arange(0, BLOCK_K)
        packed = tl.load(tmp_row + i, mask=i < KK, other=_I64_MIN)
        packed = tl.sort(packed, descending=True)
        low32 = tl.full([BLOCK_K], _LOW32, tl.int64)
        cols = low32 - (packed & low32)
        ok = i < KK
        rows = _cand_rows(KIND, cols, ok, t, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp)
        tl.store(out_row + i, rows, mask=ok)


@triton.jit
def _select_kernel(
    scores_ptr,
    ss_t,
    C,
    KK,
    out_ptr,
    so_t,
    tmp_ptr,
    cand_ptr,
    sc_t,
    sc_c,
    bt_ptr,
    bt0,
    bt1,
    npages,
    trow_ptr,
    trs,
    cnt_ptr,
    cs,
    max_count,
    epp,
    KIND: tl.constexpr,
    COLUMN_ORDER: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    trow, count, n, kk = _row_extent(KIND, t, C, KK, trow_ptr, trs, cnt_ptr, cs, max_count)
    _select_row(
        scores_ptr + t * ss_t, n, kk, t, out_ptr + t * so_t, tmp_ptr + t * BLOCK_K,
        KIND, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp,
        COLUMN_ORDER, BLOCK, BLOCK_K, INTERP,
    )  # fmt: skip
    if KIND == 2:  # the picks past its entries: -inf ones, none (-1), as a full scan gives
        i = tl.arange(0, BLOCK_K)
        tl.store(out_ptr + t * so_t + i, tl.full([BLOCK_K], -1, tl.int64), mask=(i >= kk) & (i < KK))


# ---------------------------------------------------------------------------------------------
# selection of few long rows: a threshold from strided group maxima, then the few above it


@triton.jit
def _keys64(row_ptr, cols, inside, BLOCK: tl.constexpr):
    """Unique int64 keys of columns ``cols``: the score's order-preserving image in the high
    32 bits, ``2**32 - 1 - column`` in the low 32 (descending = best first, ties to the
    earlier column); ``I64_MIN`` outside."""
    s = tl.load(row_ptr + cols, mask=inside, other=0.0)
    key = _ordered(s) ^ _SIGN
    low = tl.full([BLOCK], _LOW32, tl.int64) - cols.to(tl.int64)
    return tl.where(inside, (key.to(tl.int64) << 32) | low, _I64_MIN)


@triton.jit
def _group_max_kernel(
    scores_ptr,
    ss_t,
    C,
    SEG,
    part_ptr,
    NSEG,
    G: tl.constexpr,
    INTERP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Grid ``(T, NSEG)``: the key maxima of segment ``program_id(1)``'s columns by group
    ``column % G`` (``SEG`` a multiple of ``G``), to ``part[t, segment, :]``."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row_ptr = scores_ptr + t * ss_t
    c_begin = s * SEG
    c_end = tl.minimum(C, c_begin + SEG)
    acc = tl.full([G], _I64_MIN, tl.int64)
    if INTERP:
        c0 = c_begin
        while c0 < c_end:
            cols = c0 + tl.arange(0, G)
            acc = tl.maximum(acc, _keys64(row_ptr, cols, cols < c_end, G))
            c0 += G
    else:
        for c0 in range(c_begin, c_end, G):
            cols = c0 + tl.arange(0, G)
            acc = tl.maximum(acc, _keys64(row_ptr, cols, cols < c_end, G))
    tl.store(part_ptr + (t * NSEG + s) * G + tl.arange(0, G), acc)


@triton.jit
def _threshold_kernel(part_ptr, NSEG, KK, thr_ptr, hits_ptr, G: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Grid ``(T,)``: the ``KK``-th largest of the row's ``G`` group maxima (at least ``KK``
    keys are >= it, among them the row's top ``KK``); zeroes the row's hit counter."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, G)
    acc = tl.full([G], _I64_MIN, tl.int64)
    s = 0
    while s < NSEG:
        acc = tl.maximum(acc, tl.load(part_ptr + (t * NSEG + s) * G + i))
        s += 1
    acc = tl.sort(acc, descending=True)
    tl.store(thr_ptr + t, tl.max(tl.where(i == KK - 1, acc, _I64_MIN), 0))
    tl.store(hits_ptr + t, 0)


@triton.jit
def _filter_block(
    row_ptr, c0, c_end, thr, count_ptr, buf_row, CAP, BLOCK: tl.constexpr, PER_HIT: tl.constexpr
):
    """Appends the keys >= ``thr`` of columns ``[c0, c0 + BLOCK)`` to ``buf_row`` (slots from
    the row's counter at ``count_ptr``; their order is arbitrary: the keys are unique and the
    finish sorts them).  ``PER_HIT``: each hit takes its slot by its own atomic (no reduction
    over the block; for sparse hits); else the block counts its hits, takes them in one atomic
    and places them by a prefix sum (for dense hits)."""
    cols = c0 + tl.arange(0, BLOCK)
    keys = _keys64(row_ptr, cols, cols < c_end, BLOCK)
    hit = keys >= thr
    if PER_HIT:
        pos = tl.atomic_add(count_ptr + tl.zeros([BLOCK], tl.int32), 1, mask=hit, sem="relaxed")
        tl.store(buf_row + pos, keys, mask=hit & (pos < CAP))
    else:
        hi = hit.to(tl.int32)
        nhit = tl.sum(hi, 0)
        if nhit > 0:
            pos = tl.atomic_add(count_ptr, nhit) + tl.cumsum(hi, 0) - hi
            tl.store(buf_row + pos, keys, mask=hit & (pos < CAP))


@triton.jit
def _filter_kernel(
    scores_ptr, ss_t, C, SEG, thr_ptr, hits_ptr, buf_ptr, CAP,
    BLOCK: tl.constexpr, PER_HIT: tl.constexpr, INTERP: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T, NSEG)``: the keys >= the row's threshold, appended to ``buf[t, :CAP]``
    (the row's counter counts them all, also past ``CAP``)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row_ptr = scores_ptr + t * ss_t
    thr = tl.load(thr_ptr + t)
    buf_row = buf_ptr + t * CAP
    c_begin = s * SEG
    c_end = tl.minimum(C, c_begin + SEG)
    if INTERP:
        c0 = c_begin
        while c0 < c_end:
            _filter_block(row_ptr, c0, c_end, thr, hits_ptr + t, buf_row, CAP, BLOCK, PER_HIT)
            c0 += BLOCK
    else:  # a counted loop: software-pipelined loads
        for c0 in range(c_begin, c_end, BLOCK):
            _filter_block(row_ptr, c0, c_end, thr, hits_ptr + t, buf_row, CAP, BLOCK, PER_HIT)


@triton.jit
def _finish_sorted(
    buf_row, n, KK, out_row, tmp_row, t,
    KIND: tl.constexpr, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp,
    COLUMN_ORDER: tl.constexpr, SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The top ``KK`` of the ``n <= SIZE`` keys in ``buf_row`` (sorted in registers: unique
    keys, so the order is the contract's) as pool rows, best first or by column."""
    i = tl.arange(0, SIZE)
    keys = tl.sort(tl.load(buf_row + i, mask=i < n, other=_I64_MIN), descending=True)
    if COLUMN_ORDER:  # the top KK again, by column
        tl.store(tmp_row + i, keys)
        tl.debug_barrier()
        j = tl.arange(0, BLOCK_K)
        ok = j < KK
        low = tl.where(ok, tl.load(tmp_row + j, mask=ok, other=0) & _LOW32, -1)
        cols = _LOW32 - tl.sort(low, descending=True)
        rows = _cand_rows(KIND, cols, ok, t, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp)
        tl.store(out_row + j, rows, mask=ok)
    else:
        ok = i < KK
        cols = _LOW32 - (keys & _LOW32)
        rows = _cand_rows(KIND, cols, ok, t, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp)
        tl.store(out_row + i, rows, mask=ok)


@triton.jit
def _finish_kernel(
    scores_ptr,
    ss_t,
    C,
    KK,
    hits_ptr,
    buf_ptr,
    out_ptr,
    so_t,
    tmp_ptr,
    cand_ptr,
    sc_t,
    sc_c,
    bt_ptr,
    bt0,
    bt1,
    npages,
    trow_ptr,
    trs,
    cnt_ptr,
    cs,
    max_count,
    epp,
    KIND: tl.constexpr,
    COLUMN_ORDER: tl.constexpr,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Grid ``(T,)``: the top ``KK`` of the row's filtered keys (sorted: unique keys, so the
    order is the contract's; rows of at most ``SMALL <= CAP`` keys sort only that many), or,
    where more than ``CAP`` passed the threshold, the one-program radix select of the whole
    row."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    trow, count = _paged_scalars(KIND, t, trow_ptr, trs, cnt_ptr, cs, max_count)
    out_row = out_ptr + t * so_t
    tmp_row = tmp_ptr + t * CAP
    n = tl.load(hits_ptr + t)
    if n <= SMALL:  # the usual case (about 1.2 KK hits): a sort of SMALL = CAP / 2 keys
        _finish_sorted(
            buf_ptr + t * CAP, n, KK, out_row, tmp_row, t,
            KIND, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp,
            COLUMN_ORDER, SMALL, BLOCK_K,
        )  # fmt: skip
    elif n <= CAP:
        _finish_sorted(
            buf_ptr + t * CAP, n, KK, out_row, tmp_row, t,
            KIND, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp,
            COLUMN_ORDER, CAP, BLOCK_K,
        )  # fmt: skip
    else:
        _select_row(
            scores_ptr + t * ss_t, C, KK, t, out_row, tmp_row,
            KIND, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp,
            COLUMN_ORDER, BLOCK, BLOCK_K, INTERP,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# host side


def _candidate_args(
    candidates: torch.Tensor | PagedIndex | None, device: torch.device
) -> tuple[int, int, list]:
    """``(kind, C, kernel args)`` for the candidate form."""
    ph = torch.empty(1, dtype=torch.int64, device=device)  # a pointer the kernels' kind never reads
    if isinstance(candidates, PagedIndex):
        bt = candidates.block_table
        args = [ph, 0, 0, bt, bt.stride(0), bt.stride(1), max(bt.shape[1], 1)]
        args += [candidates.token_rows, candidates.token_rows.stride(0), candidates.counts]
        args += [candidates.counts.stride(0), int(candidates.max_count), int(candidates.entries_per_page)]
        return CAND_PAGED, int(candidates.max_count), args
    tail = [ph, 0, 0, 1, ph, 0, ph, 0, 0, 1]
    if candidates is None:
        return CAND_IDENTITY, 0, [ph, 0, 0, *tail]
    return CAND_ROWS, candidates.shape[1], [candidates, candidates.stride(0), candidates.stride(1), *tail]


FILTER_MIN_COLUMNS = 8192
"""Rows of at least this many candidates take the threshold path of :func:`select_topk`
(shorter rows: one program's radix select each).  Measured on an H200 with
``scripts/bench_attention.py --only indexer``; to be retuned on other GPUs."""
FILTER_MAX_K = 1024
"""Largest ``min(k, C)`` of the threshold path (its buffers are sorted in registers)."""
FILTER_PROGRAMS_PER_SM = 8
"""The threshold path's streaming kernels aim at about this many programs per SM (segments
per row ``~ FILTER_PROGRAMS_PER_SM * SMs / T``).  Measured on an H200, like
:data:`FILTER_MIN_COLUMNS`."""

SORT_WARPS = (16, 32)
"""Program widths ``(threshold, finish)`` of the threshold path's two sorting kernels (one
program a row each: a sort of the ``G = 2 kk`` group maxima, and of the hits).  Each sort is
a chain of dependent compare-exchange steps in one program an SM, so wider programs shorten
it: compiled for sm_90 at k = 512, a thread of the threshold kernel runs 4,168 / 2,368 /
1,408 / 936 instructions at 4 / 8 / 16 / 32 warps, one of the finish kernel 19,296 / 11,288 /
6,672 / 4,600 (static counts, both of its sorts).  Any widths give the same picks.  Timed on
an H100 at 128 x 16,384 (``bench_attention.py --only indexer --tune``, ``sort_warps`` of
:func:`select_topk`): the selection 0.0384 ms at 16 / 32 warps against 0.0530 at 4 / 8, 0.0484
at 8 / 8 and 0.0388-0.0389 at the other wide pairs."""

FILTER_PER_HIT_RATIO = 128
"""Rows of at least this many candidates per pick (hits are sparse: about ``1.2 kk`` in ``C``)
place each hit by its own atomic in the threshold path's filter; denser rows count a block's
hits first.  Measured on an H200 at k = 512: per-hit 60 us against 155 at 262,144 candidates,
block-counted 11.7 us against 20.7 at 16,384 (``bench_attention.py --only indexer --tune``)."""


def filter_groups(kk: int) -> tuple[int, int]:
    """``(G, CAP)`` of the threshold path for ``kk`` picks: ``G >= 2 kk`` column groups (the
    threshold is the ``kk``-th largest group maximum) and room for ``CAP >= 4 kk`` keys above
    it per row (about ``1.2 kk`` on random scores; a row with more takes the radix select)."""
    return pow2(2 * kk), pow2(4 * kk)


def plan_select(t: int, c: int, kk: int, sms: int) -> int:
    """Segments per row of the threshold path of :func:`select_topk`, or 0 for one program's
    radix select per row, from static shapes only (rows ``t``, candidates ``c``, picks
    ``kk``, SM count): the threshold path for rows of at least :data:`FILTER_MIN_COLUMNS`
    (and ``4 G``) candidates and ``kk <= FILTER_MAX_K``, with about
    :data:`FILTER_PROGRAMS_PER_SM` programs per SM, each segment at least ``4 G`` columns."""
    g, _ = filter_groups(kk)
    if kk > FILTER_MAX_K or c < max(FILTER_MIN_COLUMNS, 4 * g):
        return 0
    return max(1, min(cdiv(FILTER_PROGRAMS_PER_SM * sms, t), c // (4 * g)))


def selection_buffers(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A selection's ``scores`` with unit column stride, its picks a row ``min(k, C)`` and its
    ``[T, min(k, C)]`` int64 output."""
    t, c = scores.shape
    kk = min(int(k), c)
    out = torch.empty((t, kk), dtype=torch.int64, device=scores.device)
    return (scores if scores.stride(1) == 1 else scores.contiguous()), kk, out


def select_topk(
    scores: torch.Tensor,
    k: int,
    candidates: torch.Tensor | PagedIndex | None = None,
    *,
    column_order: bool | None = None,
    config: IndexerConfig | None = None,
    segments: int | None = None,
    capacity: int | None = None,
    sort_warps: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Top-``k`` of each row of ``scores`` ``[T, C]`` fp32 (ties to the earlier column).

    Returns ``[T, min(k, C)]`` int64: the candidates' pool rows (``candidates=None``: the
    columns), ``-1`` for invalid candidates; best first, or in column order.  ``-0.0`` ranks
    below ``+0.0`` here (the score kernel never produces it).

    Two exact paths, the same picks in the same order; ``segments`` (``None``:
    :func:`plan_select`) picks one:

    - ``0``: one program per row, a four-pass radix select (short rows, many rows); a paged
      row scans its own entries only (a causal prefill chunk's early tokens see few), the
      picks past them ``-1`` as a full scan's ``-inf`` ones;
    - ``S >= 1``: the threshold path for long rows, ``S`` programs per row in its streaming
      kernels.  Every candidate gets a unique 64-bit key (score image, then earlier column);
      the row's columns fall in ``G`` strided groups (``column % G``), and the ``kk``-th
      largest group maximum is a threshold that at least ``kk`` keys reach, the top ``kk``
      among them (ties and ``-inf`` included: keys are unique).  The keys at or above it
      (about ``1.2 kk`` on random scores) are collected and sorted; a row where more than
      ``capacity`` (default ``CAP`` of :func:`filter_groups`) pass takes the radix select.
      Four launches: group maxima, threshold, filter, sort; ``sort_warps``: the widths of
      the threshold and sort programs (default :data:`SORT_WARPS`; the same picks at any).
    """
    scores, kk, out = selection_buffers(scores, k)
    t, c = scores.shape
    if t == 0 or kk == 0:
        return out
    cfg = config or default_config(16, 16)
    if config is None and not INTERPRETED and c >= 65536:  # long rows: wider steps (exact either way)
        cfg = IndexerConfig(cfg.block_c, cfg.blocks_per_prog, cfg.score_warps, 4096, 8)
    kind, _, args = _candidate_args(candidates, scores.device)
    column_order = batch_invariant_enabled() if column_order is None else column_order
    block_k = pow2(kk)
    if segments is None:
        segments = plan_select(t, c, kk, sm_count(scores.device))
    dev, ss = scores.device, scores.stride(0)
    if segments <= 0:
        tmp = torch.empty((t, block_k), dtype=torch.int64, device=dev) if not column_order else out
        _select_kernel[(t,)](scores, ss, c, kk, out, out.stride(0), tmp, *args,
                             KIND=kind, COLUMN_ORDER=column_order, BLOCK=cfg.sel_block, BLOCK_K=block_k,
                             INTERP=INTERPRETED, num_warps=cfg.sel_warps, **pdl_args())  # fmt: skip
        return out
    g, cap = filter_groups(kk)
    cap = max(pow2(capacity), block_k) if capacity is not None else cap
    seg = cdiv(cdiv(c, segments), g) * g  # a multiple of G: a column's group is column % G
    nseg = cdiv(c, seg)
    part = torch.empty((t, nseg, g), dtype=torch.int64, device=dev)
    thr = torch.empty((t,), dtype=torch.int64, device=dev)
    hits = torch.empty((t,), dtype=torch.int32, device=dev)
    buf = torch.empty((t, cap), dtype=torch.int64, device=dev)
    tmp = torch.empty((t, cap), dtype=torch.int64, device=dev)
    _group_max_kernel[(t, nseg)](
        scores, ss, c, seg, part, nseg, G=g, INTERP=INTERPRETED, num_warps=4, **pdl_args()
    )
    threshold_warps, finish_warps = sort_warps or SORT_WARPS
    _threshold_kernel[(t,)](part, nseg, kk, thr, hits, G=g, num_warps=threshold_warps, **pdl_args())
    per_hit = c >= FILTER_PER_HIT_RATIO * kk
    _filter_kernel[(t, nseg)](
        scores,
        ss,
        c,
        seg,
        thr,
        hits,
        buf,
        cap,
        BLOCK=g,
        PER_HIT=per_hit,
        INTERP=INTERPRETED,
        num_warps=4,
        **pdl_args(),
    )
    small = cap // 2 if cap // 2 >= block_k else cap
    _finish_kernel[(t,)](scores, ss, c, kk, hits, buf, out, out.stride(0), tmp, *args,
                         KIND=kind, COLUMN_ORDER=column_order, CAP=cap, SMALL=small,
                         BLOCK=cfg.sel_block, BLOCK_K=block_k,
                         INTERP=INTERPRETED, num_warps=finish_warps, **pdl_args())  # fmt: skip
    return out


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: torch.Tensor,
    candidates: torch.Tensor | PagedIndex,
    scale: float,
    *,
    config: IndexerConfig | None = None,
) -> torch.Tensor:
    """The ``[T, C]`` fp32 scores (``-inf`` for invalid candidates) of :func:`indexer_topk`."""
    t, h, di = q.shape
    kind, c, args = _candidate_args(candidates, q.device)
    scores = torch.empty((t, c), dtype=torch.float32, device=q.device)
    if t == 0 or c == 0:
        return scores
    if q.stride(2) != 1:
        q = q.contiguous()
    if key_pool.stride(1) != 1:
        key_pool = key_pool.contiguous()
    cfg = config or default_config(h, di)
    per_prog = cfg.block_c * cfg.blocks_per_prog
    fp32 = q.dtype == torch.float32
    _score_kernel[(t, cdiv(c, per_prog))](
        q,
        q.stride(0),
        q.stride(1),
        weights,
        weights.stride(0),
        weights.stride(1),
        key_pool,
        key_pool.stride(0),
        *args,
        scores,
        scores.stride(0),
        c,
        h,
        di,
        float(scale),
        KIND=kind,
        BLOCK_H=max(16, pow2(h)),
        BLOCK_D=max(16, pow2(di)),
        BLOCK_C=cfg.block_c,
        BLOCKS=cfg.blocks_per_prog,
        DOT_FP32=INTERPRETED or fp32,
        IEEE=fp32 and not INTERPRETED,
        num_warps=cfg.score_warps,
        **pdl_args(),
    )
    return scores


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: torch.Tensor,
    candidates: torch.Tensor | PagedIndex,
    k: int,
    scale: float,
) -> torch.Tensor:
    """Triton ``indexer_topk``: the reference's signature, shapes and semantics.

    ``q`` ``[T, H, Di]``, ``weights`` ``[T, H]`` fp32, ``key_pool`` ``[N, Di]`` of q's dtype,
    ``candidates`` ``[T, C]`` rows or a :class:`PagedIndex`.  Returns ``[T, min(k, C)]`` int64
    pool rows, best first (batch-invariant mode: in column order), ``-1`` past the valid ones.
    """
    scores = indexer_scores(q, weights, key_pool, candidates, scale)
    return select_topk(scores, k, candidates)


__all__ = [
    "MAX_HEADS",
    "MAX_INDEX_DIM",
    "MAX_TOPK",
    "IndexerConfig",
    "default_config",
    "indexer_scores",
    "indexer_topk",
    "select_topk",
]
