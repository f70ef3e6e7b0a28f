"""``compress_entries``: the compressor's entries in one kernel (contract: ``deepinfer_core.ops.compressor``).

One program per closed window ``m``: it reads the window's ``L`` rows of ``kv`` and of the
fp32 ``gate`` logits, takes the per-channel softmax over ``L`` in fp32, pools, RMS-norms the
pooled row with the weight, rotates the trailing ``R`` channels in interleaved pairs at
``positions[m]`` (cos / sin computed here from ``inv_freq`` in fp32: ``tl.cos`` / ``tl.sin``
lower to libdevice's ``cosf`` / ``sinf``, accurate at any position) and stores the entry
into ``pool[dest[m]]`` in the pool's dtype -- what ``compress_pool``, ``rms_norm``,
``rope_cos_sin``, ``apply_rope`` and ``cache_write`` do as five launches, with the same
roundings to ``kv``'s dtype between them (:func:`~._common.round_through`).

The program holds the whole row as two vectors, the even and the odd channels, so the rope
pairs ``(2i, 2i+1)`` sit at the same index of both.  The window's rows are read in tiles of
``BLOCK_L`` rows: a window of at most ``BLOCK_L`` rows (CSA's ``L = 2r = 8`` at ``D = 512``)
is loaded once; a longer one (HCA's ``L = r = 128``) is read three times, for the max, the
sum and the weighted sum, so no value is rescaled (the roundings are the reference's).  The
order of every reduction is fixed by the shapes: a window's entry does not depend on how
many windows the call has (batch invariance), and the launch grid is ``(M,)`` with no host
synchronisation (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast_to, cdiv, pow2, round_through
from .norm import rms_factor
from .pdl import pdl_args, pdl_enter

MAX_DIM = 4096
"""Widest entry (``D``): the row lives in registers."""

_TILE_ELEMS = 2048  # elements per tile of one channel parity: BLOCK_L rows x BLOCK_P pairs


@triton.jit
def _tile(ptr, row0, rows, stride_l, cols, col_ok, L, other):
    """Rows ``row0 + rows`` (``< L``) of one window at channels ``cols``, as fp32."""
    r = row0 + rows
    mask = (r < L)[:, None] & col_ok[None, :]
    return tl.load(ptr + r[:, None].to(tl.int64) * stride_l + cols[None, :], mask=mask, other=other).to(
        tl.float32
    )


@triton.jit
def _strided_rows(src, row0, rows, cols, col_ok, L, GATE: tl.constexpr):
    """Loader of :func:`pool` for windows stored as ``[M, L, D]`` rows: ``src`` is ``(kv row 0,
    gate row 0, kv row stride, gate row stride)`` of the window."""
    kv_w, gate_w, stride_kl, stride_gl = src
    if GATE:
        return _tile(gate_w, row0, rows, stride_gl, cols, col_ok, L, -float("inf"))
    return _tile(kv_w, row0, rows, stride_kl, cols, col_ok, L, 0.0)


@triton.jit
def _weighted(x, e, total, KV_DTYPE: tl.constexpr):
    """``sum_l round(x * round(e / total))`` over the tile's rows (fp32)."""
    p = round_through(tl.math.div_rn(e, tl.broadcast_to(total[None, :], e.shape)), KV_DTYPE)
    return tl.sum(round_through(x * p, KV_DTYPE), axis=0)


@triton.jit
def pool(
    src,
    cols,
    col_ok,
    L,
    LOAD: tl.constexpr,
    KV_DTYPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    NUM_L_TILES: tl.constexpr,
):
    """``compress_pool`` of one window at channels ``cols`` (fp32, rounded to ``KV_DTYPE``).

    ``LOAD(src, row0, rows, cols, col_ok, L, GATE)`` gives the window's rows ``row0 + rows``
    (``< L``) at ``cols`` in fp32: of the gate logits (``GATE``; ``-inf`` past ``L``) or of the
    values (0 past ``L``).  Channels past ``D`` take logits 0 and values 0, so they pool to 0
    (no NaN from an all-``-inf`` column reaches the norm's sum of squares).
    """
    rows = tl.arange(0, BLOCK_L)
    if NUM_L_TILES == 1:
        g = tl.where(col_ok[None, :], LOAD(src, 0, rows, cols, col_ok, L, True), 0.0)
        e = tl.exp(g - tl.max(g, axis=0)[None, :])
        x = LOAD(src, 0, rows, cols, col_ok, L, False)
        acc = _weighted(x, e, tl.sum(e, axis=0), KV_DTYPE)
    else:
        top = tl.zeros([BLOCK_P], dtype=tl.float32) - float("inf")
        for i in range(NUM_L_TILES):
            g = LOAD(src, i * BLOCK_L, rows, cols, col_ok, L, True)
            top = tl.maximum(top, tl.max(tl.where(col_ok[None, :], g, 0.0), axis=0))
        total = tl.zeros([BLOCK_P], dtype=tl.float32)
        for i in range(NUM_L_TILES):
            g = LOAD(src, i * BLOCK_L, rows, cols, col_ok, L, True)
            total += tl.sum(tl.exp(tl.where(col_ok[None, :], g, 0.0) - top[None, :]), axis=0)
        acc = tl.zeros([BLOCK_P], dtype=tl.float32)
        for i in range(NUM_L_TILES):
            g = LOAD(src, i * BLOCK_L, rows, cols, col_ok, L, True)
            e = tl.exp(tl.where(col_ok[None, :], g, 0.0) - top[None, :])
            x = LOAD(src, i * BLOCK_L, rows, cols, col_ok, L, False)
            acc += _weighted(x, e, total, KV_DTYPE)
    return round_through(acc, KV_DTYPE)


@triton.jit(do_not_specialize=["live_n"])
def _compress_entries_kernel(
    kv_ptr,
    gate_ptr,
    w_ptr,
    pos_ptr,
    inv_ptr,
    pool_ptr,
    dest_ptr,
    live_ptr,
    live_n,
    L,
    D,
    HALF,
    stride_km,
    stride_kl,
    stride_gm,
    stride_gl,
    stride_pool,
    eps,
    rope_scale,
    KV_DTYPE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    NUM_L_TILES: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    m = tl.program_id(0).to(tl.int64)
    # the bound is a run-time value either way, so the entry's code (and its fp32 rounding) is the
    # same with and without a device count
    live = tl.load(live_ptr).to(tl.int64) if HAS_LIVE else live_n
    if m < live:  # a fixed-shape step's padding windows (m >= live) write nothing
        src = (kv_ptr + m * stride_km, gate_ptr + m * stride_gm, stride_kl, stride_gl)
        row = pool_ptr + tl.load(dest_ptr + m).to(tl.int64) * stride_pool
        entry(src, _strided_rows, w_ptr, pos_ptr + m, inv_ptr, row, L, D, HALF, eps, rope_scale,
              KV_DTYPE, BLOCK_L, BLOCK_P, NUM_L_TILES)  # fmt: skip


@triton.jit
def entry(
    src, LOAD: tl.constexpr, w_ptr, pos_ptr, inv_ptr, row, L, D, HALF, eps, rope_scale,
    KV_DTYPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, NUM_L_TILES: tl.constexpr,
):  # fmt: skip
    """One window's entry, rotated to the position at ``pos_ptr`` and stored at ``row`` (a pool
    row's first element) in its dtype; the window's rows come from ``LOAD(src, ...)`` (see
    :func:`pool`, and the module docstring)."""
    j = tl.arange(0, BLOCK_P)  # pair index: channels 2j (even) and 2j + 1 (odd)
    ev, od = 2 * j, 2 * j + 1
    ev_ok, od_ok = ev < D, od < D
    a = pool(src, ev, ev_ok, L, LOAD, KV_DTYPE, BLOCK_L, BLOCK_P, NUM_L_TILES)
    b = pool(src, od, od_ok, L, LOAD, KV_DTYPE, BLOCK_L, BLOCK_P, NUM_L_TILES)

    # rms_norm (weighted): fp32, one rounding to kv's dtype
    factor = rms_factor(tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0), D, eps, KV_DTYPE, False)
    a = round_through(a * factor * tl.load(w_ptr + ev, mask=ev_ok, other=0.0).to(tl.float32), KV_DTYPE)
    b = round_through(b * factor * tl.load(w_ptr + od, mask=od_ok, other=0.0).to(tl.float32), KV_DTYPE)

    # rope: pair j rotates by angle i = j - (D/2 - HALF) when it is one of the trailing HALF pairs
    i = j - (D // 2 - HALF)
    rot = (i >= 0) & od_ok
    freq = tl.load(pos_ptr).to(tl.float32) * tl.load(inv_ptr + i, mask=rot, other=0.0).to(tl.float32)
    c = round_through(tl.cos(freq) * rope_scale, KV_DTYPE)
    s = round_through(tl.sin(freq) * rope_scale, KV_DTYPE)
    a2 = tl.where(rot, round_through(a * c - b * s, KV_DTYPE), a)
    b2 = tl.where(rot, round_through(a * s + b * c, KV_DTYPE), b)

    # cache_write: the entry in the pool's dtype
    dtype = row.dtype.element_ty
    tl.store(row + ev, cast_to(a2, dtype), mask=ev_ok)
    tl.store(row + od, cast_to(b2, dtype), mask=od_ok)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def block_sizes(length: int, dim: int) -> tuple[int, int, int]:
    """``(BLOCK_L, BLOCK_P, NUM_L_TILES)`` for windows of ``length`` rows of ``dim`` channels
    (shapes only: the same for every call of those widths)."""
    block_p = pow2(cdiv(dim, 2))
    block_l = max(1, min(pow2(length), _TILE_ELEMS // block_p))
    return block_l, block_p, cdiv(length, block_l)


def compress_entries(
    kv: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    pool: torch.Tensor,
    dest: torch.Tensor,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``compress_entries``: same signature, shapes and numerics as the reference.

    ``kv`` ``[M, L, D]`` (fp32, bf16 or fp16) and ``gate`` ``[M, L, D]`` fp32 (any row
    strides; a non-unit channel stride is copied first), ``norm_weight`` ``[D]``,
    ``positions`` / ``dest`` ``[M]`` integer, ``inv_freq`` ``[R/2]``, ``pool`` ``[N, D]``
    (fp32, bf16 or fp16, unit channel stride).  Writes ``pool[dest]`` in place; returns ``pool``.
    ``live`` (``[1]`` int, on the device): windows ``m >= live[0]`` are padding, their
    programs return at once (nothing written: their rows are the trash page's).
    """
    m, length, d = kv.shape
    if m == 0:
        return pool
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    block_l, block_p, tiles = block_sizes(length, d)
    _compress_entries_kernel[(m,)](
        kv,
        gate,
        norm_weight.contiguous(),
        positions.contiguous(),
        inv_freq.contiguous(),
        pool,
        dest.contiguous(),
        dest if live is None else live,  # (not read without live)
        m,  # the bound without live: every window
        length,
        d,
        inv_freq.shape[0],
        kv.stride(0),
        kv.stride(1),
        gate.stride(0),
        gate.stride(1),
        pool.stride(0),
        float(eps),
        float(rope_scale),
        KV_DTYPE=_TL_DTYPES[kv.dtype],
        BLOCK_L=block_l,
        BLOCK_P=block_p,
        NUM_L_TILES=tiles,
        HAS_LIVE=live is not None,
        num_warps=4 if block_p <= 512 else 8,
        **pdl_args(),
    )
    return pool
