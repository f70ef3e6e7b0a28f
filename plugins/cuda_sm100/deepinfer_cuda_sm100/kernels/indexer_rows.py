"""``indexer_topk``'s selection for rows of up to :data:`ROW_MAX_COLUMNS` candidates (prefill's
many short rows; long-context decode's rows of 16,384 and 32,768): a whole row in one program's
registers, its ``k``-th largest score found by a bitwise search of counts.

The radix select of :mod:`deepinfer_cuda_sm100.kernels.indexer` builds four 256-bin histograms
a row with ``tl.histogram``, which Triton lowers to warp ballots: about a hundred instructions
per element slot and pass, most of its time at 8,192 rows of 2,048 candidates.  Here one
program (:func:`row_warps` warps) loads the row once as the order-preserving unsigned image of
each fp32 score and fixes the threshold's bits from the top: a bit stays set where at least
``k`` candidates reach the candidate value (one compare and one sum over the row per bit).
The search stops early where exactly ``k`` reach it (then every candidate at or above it is a
pick and none ties), usually after 15-20 bits on random scores.  Then one pass in column order
keeps every candidate above the threshold and the earliest ones equal to it (the contract's tie
rule), and the picks are sorted best first by ``(score bits, ~column)`` keys (bitonic
``tl.sort``), or kept in column order (batch-invariant mode).

The picks and their order are the radix select's exactly (both exact on the same scores);
a paged row scans its own entries only and its picks past them are ``-1``, as there.
Graph-capturable: the grid and scratch size come from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import pow2
from .indexer import (
    _I64_MIN,
    _LOW32,
    _SIGN,
    _cand_rows,
    _candidate_args,
    _ordered,
    _row_extent,
    selection_buffers,
)
from .pdl import pdl_args, pdl_enter

ROW_MAX_COLUMNS = 32768
"""Longest row (candidates) this selection takes: its program holds the row in registers."""
WARPS_BY_COLUMNS = ((2048, 4), (4096, 8), (8192, 4), (16384, 16), (32768, 32))
"""A row's program width by row length (``(longest power of two, warps)``), measured on an
H100 with 1, 2, 4 and 8 warps at 8,192 x 2,048, 1,024 x 2,048, 4,096 x 4,096 and 1,024 x 8,192
candidates (at 8,192 four warps spill a few registers and still beat eight, whose 181 registers
a thread leave one program an SM); shorter rows take the first.  The decode rows of long
contexts (16,384 and 32,768 candidates, a program per row and about one row an SM) take 32
scores a thread, the widths whose search loop compiles for sm_90 without spills (at 16,384
candidates eight warps spill inside the row's other passes, sixteen less).  Timed there on an
H100 (``bench_attention.py --only indexer --tune``, 128 rows, k = 512): 0.0499 ms at 16,384
candidates and 0.1108 at 32,768 (16 warps: 0.1269, 8: 0.1340), behind the threshold path's
0.0491 and 0.0664, which the shipped table keeps there."""


PACKED_SCAN_COLUMNS = tl.constexpr(16384)
"""Rows up to this long (a power of two) count, in one scan, both the scores above the
threshold and the ties before each column (16-bit halves of one word); longer rows take two
scans.  Compiled for sm_90 by Triton 3.6 (paged rows, k = 512, :func:`row_warps`), the one
scan leaves 3,104 / 6,592 / 4,288 instructions at 2,048 / 8,192 / 16,384 columns against
3,552 / 8,704 / 6,648, the same registers (96 / 255 / 128; 8 bytes of stack at 8,192 where
there were none, none at 16,384 where there were 16); at 32,768 columns (32 warps, 64
registers) it left 800 bytes of stack against 264, so those rows keep the two scans."""


def row_warps(columns: int) -> int:
    """Warps of a row's program (:data:`WARPS_BY_COLUMNS`)."""
    block = pow2(columns)
    return next((warps for limit, warps in WARPS_BY_COLUMNS if block <= limit), WARPS_BY_COLUMNS[-1][1])


CAPPED_REGISTERS = 72
"""A register cap (``maxnreg``) for programs that hold at most :data:`CAPPED_COLUMNS` columns a
thread, offered by :func:`capped_registers` (off by default: ``bench_attention.py --only indexer
--tune`` times it against the compiler's choice).  Compiled for sm_90 by Triton 3.6 (paged rows
of 2,048 columns, four warps, k = 512): the same 3,104 instructions without spills at 72
registers as at the compiler's 96 (80: 3,112; 64 spills 16 bytes), so seven programs share an
SM instead of five."""

CAPPED_COLUMNS = 16
"""The most columns a thread at which :data:`CAPPED_REGISTERS` applies."""


def capped_registers(columns: int, warps: int | None = None, column_order: bool = False) -> int | None:
    """:data:`CAPPED_REGISTERS` for a row of ``columns`` at ``warps`` (default
    :func:`row_warps`) picked best first, where each thread holds at most
    :data:`CAPPED_COLUMNS` of them, else ``None`` (the compiler's choice; the column-order
    build takes 133 registers at 2,048 columns and would spill under the cap)."""
    per_thread = pow2(columns) // (32 * (warps or row_warps(columns)))
    return CAPPED_REGISTERS if per_thread <= CAPPED_COLUMNS and not column_order else None


def candidate_warps(columns: int) -> tuple[int, ...]:
    """The program widths worth timing for rows of ``columns`` candidates (``bench_attention.py
    --tune`` sweeps them): up to eight warps for prefill rows, eight to 32 for longer rows,
    whose narrower programs would hold hundreds of scores a thread."""
    return (1, 2, 4, 8) if pow2(columns) <= 8192 else (8, 16, 32)


def supports(columns: int) -> bool:
    """Whether rows of ``columns`` candidates fit this selection (any ``k``: it takes
    ``min(k, C)`` picks)."""
    return 0 < columns <= ROW_MAX_COLUMNS


@triton.jit
def _threshold_bits(o, kk):
    """The ``kk``-th largest of ``o`` (uint32, ``kk >= 1``), fixed bit by bit from the top; or,
    where exactly ``kk`` values reach a candidate value ``v`` on the way, ``v - 1`` (then the
    values above the result are exactly the top ``kk``)."""
    thr = tl.zeros((), tl.uint32)
    bit = tl.full((), 31, tl.int32)
    go = bit >= 0
    while go:
        cand = thr | (tl.full((), 1, tl.uint32) << bit.to(tl.uint32))
        n = tl.sum((o >= cand).to(tl.int32), 0)
        thr = tl.where(n >= kk, cand, thr)
        thr = tl.where(n == kk, cand - 1, thr)
        bit -= 1
        go = (bit >= 0) & (n != kk)
    return thr


@triton.jit
def _row_select_kernel(
    scores_ptr, ss_t, C, KK, out_ptr, so_t, tmp_ptr,
    cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow_ptr, trs, cnt_ptr, cs, max_count, epp,
    KIND: tl.constexpr, COLUMN_ORDER: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T,)``: row ``t``'s top ``KK`` (best first, or in column order) to ``out[t]``."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    trow, count, n, kk = _row_extent(KIND, t, C, KK, trow_ptr, trs, cnt_ptr, cs, max_count)
    out_row = out_ptr + t * so_t
    i = tl.arange(0, BLOCK_K)
    if kk > 0:
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        o = _ordered(tl.load(scores_ptr + t * ss_t + cols, mask=inside, other=0.0))
        # outside the row: 0, below every score's image (-inf's is 0x007FFFFF), never counted
        ou = tl.where(inside, o.to(tl.uint32, bitcast=True), 0)
        thr = _threshold_bits(ou, kk)
        gt = ou > thr
        eq = ou == thr
        need = kk - tl.sum(gt.to(tl.int32), 0)
        if BLOCK <= PACKED_SCAN_COLUMNS:
            # one scan for both counts before each column (16-bit halves): the ties kept are
            # the first ``need``, so a pick's place is the scores above the threshold before
            # it plus the kept ties before it
            both = gt.to(tl.uint32) | (eq.to(tl.uint32) << 16)
            before = tl.cumsum(both, 0) - both
            eq_before = (before >> 16).to(tl.int32)
            sel = gt | (eq & (eq_before < need))
            pos = (before & 0xFFFF).to(tl.int32) + tl.minimum(eq_before, need)
        else:
            eqi = eq.to(tl.int32)
            sel = gt | (eq & (tl.cumsum(eqi, 0) - eqi < need))
            seli = sel.to(tl.int32)
            pos = tl.cumsum(seli, 0) - seli
        if COLUMN_ORDER:
            rows = _cand_rows(
                KIND, cols, sel, t, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp
            )
            tl.store(out_row + pos, rows, mask=sel)
        else:
            tmp_row = tmp_ptr + t * BLOCK_K
            low = tl.full([BLOCK], _LOW32, tl.int64) - cols.to(tl.int64)  # earlier column: larger
            tl.store(tmp_row + pos, ((o ^ _SIGN).to(tl.int64) << 32) | low, mask=sel)
            tl.debug_barrier()  # the picks were written by other threads of this program
            packed = tl.sort(tl.load(tmp_row + i, mask=i < kk, other=_I64_MIN), descending=True)
            ok = i < kk
            picked = _LOW32 - (packed & _LOW32)
            rows = _cand_rows(
                KIND, picked, ok, t, cand_ptr, sc_t, sc_c, bt_ptr, bt0, bt1, npages, trow, count, epp
            )
            tl.store(out_row + i, rows, mask=ok)
    if KIND == 2:  # the picks past its entries: -inf ones, none (-1), as a full scan gives
        tl.store(out_row + i, tl.full([BLOCK_K], -1, tl.int64), mask=(i >= kk) & (i < KK))


def select_topk_rows(
    scores: torch.Tensor,
    k: int,
    candidates=None,
    *,
    column_order: bool = False,
    warps: int | None = None,
    registers: int | None = None,
) -> torch.Tensor:
    """Top-``k`` of each row of ``scores`` ``[T, C]`` fp32 (``C <= ROW_MAX_COLUMNS``), as
    :func:`deepinfer_cuda_sm100.kernels.indexer.select_topk`: ``[T, min(k, C)]`` int64 pool
    rows (``candidates``: ``None`` for the columns, explicit rows or a ``PagedIndex``), ``-1``
    for invalid candidates; best first, or in column order.  ``warps``: the program's warps
    (default :func:`row_warps`); ``registers``: a register cap a thread (``maxnreg``; default
    ``None``, the compiler's choice; :func:`capped_registers` offers one), the same picks."""
    if scores.shape[1] > ROW_MAX_COLUMNS:
        raise ValueError(
            f"select_topk_rows takes rows of at most {ROW_MAX_COLUMNS} candidates, got {scores.shape[1]}"
        )
    scores, kk, out = selection_buffers(scores, k)
    t, c = scores.shape
    if t == 0 or kk == 0:
        return out
    kind, _, args = _candidate_args(candidates, scores.device)
    block_k = pow2(kk)
    tmp = out if column_order else torch.empty((t, block_k), dtype=torch.int64, device=scores.device)
    cap = {} if registers is None else {"maxnreg": int(registers)}
    _row_select_kernel[(t,)](scores, scores.stride(0), c, kk, out, out.stride(0), tmp, *args,
                             KIND=kind, COLUMN_ORDER=column_order, BLOCK=pow2(c), BLOCK_K=block_k,
                             num_warps=warps or row_warps(c), **cap, **pdl_args())  # fmt: skip
    return out
