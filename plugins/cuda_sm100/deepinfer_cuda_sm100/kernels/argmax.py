"""``argmax_rows``: greedy sampling's pick, the index of each row's maximum, in two launches
(contract: ``deepinfer_core.ops.sampling.argmax_rows``).

``torch.argmax`` over a ``[B, V]`` row of logits on the GPU reduces each row in one thread
block, which at decode (few rows, ``V`` ~ 129k) leaves most SMs idle.  Here each row is split
into chunks of ``CHUNK`` columns:

1. grid ``(B, n_chunks)``: a program reads its chunk (``CHUNK // BLOCK`` unrolled tiles of
   ``BLOCK`` columns, masked at the row's end), each lane keeping the best value it has seen
   and its column -- replaced only by a strictly larger value, or by a NaN while it holds none,
   so a lane keeps its first maximum (or first NaN) -- then reduces the lanes
   (:func:`_first_max`) and writes the chunk's (value as fp32, column);
2. grid ``(B,)``: a program reduces its row's chunk pairs the same way, in column order, and
   writes the int64 column.  A row of one chunk skips it: stage 1 writes the column itself.

The order is ``torch.argmax``'s (PyTorch's ``GreaterOrNan``): NaN above every number, the
first NaN among NaNs, the lowest column among equal values (``-0.0 == +0.0``), so the result is
exact -- the same index as ``torch.argmax`` for fp32, bf16 and fp16 (converted to fp32 exactly),
whatever the chunking, and a row's index does not depend on the other rows.  ``CHUNK``,
``BLOCK`` and the grids follow the shape alone; no host synchronisation (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, pow2
from .pdl import pdl_args, pdl_enter

CHUNK = 4096
"""Columns one stage-1 program reduces (fewer when the row is shorter): V-Flash's 129,280
columns make 32 programs per row, 16 KB of fp32 each."""
MAX_BLOCK = 1024
"""Widest tile of one load (a chunk is ``CHUNK // MAX_BLOCK`` unrolled tiles)."""
MAX_COLS = 1 << 24
"""Longest row the kernels take (column indices are int32; stage 2 holds a row's chunks in one
tile of at most ``MAX_COLS // CHUNK`` lanes)."""
_NO_COL = tl.constexpr(2**31 - 1)  # the column of a lane that saw no column (masked): larger than any


@triton.jit
def _first_max(vals, cols, NO_COL: tl.constexpr):
    """The first maximum of the lanes ``(vals, cols)`` (fp32, int32) in ``torch.argmax``'s
    order: any NaN wins over every number, then the lowest column among the winners.  Lanes
    that saw no column hold ``-inf`` and ``NO_COL``, so they never beat a real column."""
    is_nan = vals != vals
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), vals), axis=0)
    hit = tl.where(any_nan, is_nan, vals == top)
    col = tl.min(tl.where(hit, cols, NO_COL), axis=0)
    val = tl.where(any_nan, float("nan"), top)
    return val, col


@triton.jit
def _chunk_kernel(
    x_ptr,
    val_ptr,
    col_ptr,
    out_ptr,
    V,
    stride_b,
    stride_v,
    n_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    FINAL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Stage 1: chunk ``pid1`` of row ``pid0``; writes its (value, column), or with ``FINAL``
    (one chunk per row) the row's int64 column."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, V)
    lanes = tl.arange(0, BLOCK)
    base = x_ptr + row * stride_b
    cols = start + lanes
    mask = cols < end
    best = tl.load(base + cols.to(tl.int64) * stride_v, mask=mask, other=float("-inf")).to(tl.float32)
    best_col = tl.where(mask, cols, _NO_COL)
    for i in tl.static_range(1, CHUNK // BLOCK):  # unrolled: every tile's load issued up front
        cols = start + i * BLOCK + lanes
        mask = cols < end
        v = tl.load(base + cols.to(tl.int64) * stride_v, mask=mask, other=float("-inf")).to(tl.float32)
        take = (v > best) | ((v != v) & (best == best))  # strictly larger, or a lane's first NaN
        best = tl.where(take, v, best)
        best_col = tl.where(take, cols, best_col)
    val, col = _first_max(best, best_col, _NO_COL)
    if FINAL:
        tl.store(out_ptr + row, col.to(tl.int64))
    else:
        tl.store(val_ptr + row * n_chunks + chunk, val)
        tl.store(col_ptr + row * n_chunks + chunk, col)


@triton.jit
def _rows_kernel(val_ptr, col_ptr, out_ptr, n_chunks, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Stage 2: row ``pid0``'s chunk pairs, in column order, to its int64 column."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_C)
    mask = lanes < n_chunks
    vals = tl.load(val_ptr + row * n_chunks + lanes, mask=mask, other=float("-inf"))
    cols = tl.load(col_ptr + row * n_chunks + lanes, mask=mask, other=_NO_COL)
    _, col = _first_max(vals, cols, _NO_COL)
    tl.store(out_ptr + row, col.to(tl.int64))


def chunk_cols(width: int) -> int:
    """Columns per stage-1 program for rows of ``width`` (shapes only; at least a warp's 32)."""
    return min(CHUNK, max(pow2(width), 32))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Triton ``argmax_rows``: the same signature and result as the reference.

    ``x`` ``[B, V]`` fp32, bf16 or fp16, any strides, ``1 <= V <= MAX_COLS``.  Returns a new
    ``[B]`` int64 tensor on ``x``'s device.
    """
    rows, width = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    chunk = chunk_cols(width)
    n_chunks = cdiv(width, chunk)
    final = n_chunks == 1
    if final:  # no partials: stage 1 writes the columns (the pointers it is given go unused)
        vals, cols = out, out
    else:
        vals = torch.empty((rows, n_chunks), dtype=torch.float32, device=x.device)
        cols = torch.empty((rows, n_chunks), dtype=torch.int32, device=x.device)
    _chunk_kernel[(rows, n_chunks)](
        x,
        vals,
        cols,
        out,
        width,
        x.stride(0),
        x.stride(1),
        n_chunks,
        CHUNK=chunk,
        BLOCK=min(chunk, MAX_BLOCK),
        FINAL=final,
        num_warps=4,
        **pdl_args(),
    )
    if not final:
        _rows_kernel[(rows,)](vals, cols, out, n_chunks, BLOCK_C=pow2(n_chunks), num_warps=1, **pdl_args())
    return out
