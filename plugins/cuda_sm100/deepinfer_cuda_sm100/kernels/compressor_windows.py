"""``compress_windows``: a compressor's whole step in three launches (contract:
``deepinfer_core.ops.compressor``).

The reference stages the windows with a dozen PyTorch ops (the slot buffers concatenated with
the step's rows and gathered per window, the gate's bias, the previous halves gathered from
the carries, the carry and page-snapshot writes) before the entry op.  Here each kernel reads
the rows where they are:

1. :func:`_compress_windows_kernel`, a program per window: :func:`~.compressor.entry` (pooling, norm,
   rope, store: the code of ``compress_entries``, so the entries are its bits) with a loader
   (:func:`_window_rows`) that takes each of the window's rows from the buffer, the step's
   rows or the carries, adds the bias, and gives an empty previous half zero values and
   ``-inf`` gates;
2. :func:`_compress_carry_kernel` (CSA's overlap), a program per window: its first half (bias added)
   into its carry row and page snapshot;
3. :func:`_compress_buffer_kernel`, a program per token: its rows into the buffers.

The launches run in that order because each reads state the next one writes (a carry the
window reads may be the one it saves; a buffer row a window reads may be the one a later token
of the same request overwrites).  A fixed-shape step's padding windows (``m >= live[0]``)
return at once.  Packed (FP8) pools take the entries through a row per window and
``cache_write``, which quantises them as the reference does.  No host synchronisation: a call
is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_core.ops.cache import cache_write

from ._common import cast_to, pow2
from .compressor import _TL_DTYPES, block_sizes, entry
from .pdl import pdl_args, pdl_enter

_COPY_BLOCK = 1024  # channels a buffer or carry copy moves per step of its loop


@triton.jit
def _staged(src, i, c, mask, GATE: tl.constexpr):
    """Staging rows ``i`` ``[N]`` (``[buffer rows ; step rows]``) at channels ``c`` ``[N, K]`` of
    kv or of the gate, in fp32 (where ``mask`` is false: 0, or ``-inf`` for the gate)."""
    kv, gate, buf_kv, buf_gate = src[0], src[1], src[2], src[3]
    s_step, s_buf, nbuf = src[9], src[10], src[11]
    in_buf = (i < nbuf)[:, None]
    i64 = i.to(tl.int64)[:, None]
    other = -float("inf") if GATE else 0.0
    if GATE:
        step_ptr = gate + (i64 - nbuf) * s_step + c
        buf_ptr = buf_gate + i64 * s_buf + c
    else:
        step_ptr = kv + (i64 - nbuf) * s_step + c
        buf_ptr = buf_kv + i64 * s_buf + c
    from_step = tl.load(step_ptr, mask=mask & ~in_buf, other=other).to(tl.float32)
    from_buf = tl.load(buf_ptr, mask=mask & in_buf, other=other).to(tl.float32)
    return tl.where(in_buf, from_buf, from_step)


@triton.jit
def _window_rows(src, row0, rows, cols, col_ok, L, GATE: tl.constexpr):
    """Loader of :func:`~.compressor.pool` for a window of ``compress_windows``.

    ``src``: ``(kv, gate, buf_kv, buf_gate, carry_kv, carry_gate, bias, windows row of this
    window, windows row of the previous half's window, step row stride, buffer row stride,
    buffer rows, R, D, prev kind, carry row, overlap)``; prev kind 0: the previous half is the
    carry ``carry row``, 1: the first half of another window of the call, 2: empty.
    """
    carry_kv, carry_gate, bias, win, prev_win = src[4], src[5], src[6], src[7], src[8]
    r, d, kind, carry, overlap = src[12], src[13], src[14], src[15], src[16]
    l = row0 + rows
    inside = l < L
    first = inside & (l < r * overlap)  # the previous window's half
    j = tl.where(first, l, l - r * overlap)  # the row within its window
    staged = inside & ((~first) | (kind == 1))
    from_carry = first & (kind == 0)
    i_own = tl.load(win + j, mask=staged & ~first, other=0)
    i_prev = tl.load(prev_win + j, mask=staged & first, other=0)
    i = tl.where(first, i_prev, i_own)
    c = cols[None, :] + tl.where(first, 0, d * overlap)[:, None]  # the first or the second series
    mask = staged[:, None] & col_ok[None, :]
    x = _staged(src, i, c, mask, GATE)
    cmask = from_carry[:, None] & col_ok[None, :]
    crow = ((carry * r + j).to(tl.int64) * d)[:, None] + cols[None, :]
    if GATE:
        x = x + tl.load(bias + j[:, None] * (d * (1 + overlap)) + c, mask=mask, other=0.0)
        y = tl.load(carry_gate + crow, mask=cmask, other=-float("inf"))
    else:
        y = tl.load(carry_kv + crow, mask=cmask, other=0.0)
    return tl.where(from_carry[:, None], y.to(tl.float32), x)


@triton.jit(do_not_specialize=["live_n", "n_carries", "m_total"])
def _compress_windows_kernel(
    kv, gate, buf_kv, buf_gate, carry_kv, carry_gate, bias, windows, prev_ptr,
    w_ptr, pos_ptr, inv_ptr, pool_ptr, dest_ptr, live_ptr, live_n,
    s_step, s_buf, nbuf, n_carries, m_total, R, D, HALF, stride_pool, eps, rope_scale, overlap,
    ROW_IS_WINDOW: tl.constexpr, HAS_LIVE: tl.constexpr, KV_DTYPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, NUM_L_TILES: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)
    m = tl.program_id(0).to(tl.int64)
    live = tl.load(live_ptr).to(tl.int64) if HAS_LIVE else live_n
    if m < live:
        # without overlap prev_ptr is the windows and n_carries = m_total = 0: kind 2, unused
        p = tl.load(prev_ptr + m).to(tl.int64)
        kind = tl.where(p < n_carries, 0, tl.where(p < n_carries + m_total, 1, 2))
        carry = tl.where(kind == 0, p, 0)
        other = tl.where(kind == 1, p - n_carries, m)
        src = (kv, gate, buf_kv, buf_gate, carry_kv, carry_gate, bias, windows + m * R, windows + other * R,
               s_step, s_buf, nbuf, R, D, kind, carry, overlap)  # fmt: skip
        dest = m if ROW_IS_WINDOW else tl.load(dest_ptr + m).to(tl.int64)
        row = pool_ptr + dest * stride_pool
        entry(src, _window_rows, w_ptr, pos_ptr + m, inv_ptr, row, R * (1 + overlap), D, HALF, eps,
              rope_scale, KV_DTYPE, BLOCK_L, BLOCK_P, NUM_L_TILES)  # fmt: skip


@triton.jit(do_not_specialize=["live_n"])
def _compress_carry_kernel(
    kv, gate, buf_kv, buf_gate, bias, windows, carry_rows, carry_kv, carry_gate,
    snap_page, page_kv, page_gate, live_ptr, live_n, s_step, s_buf, nbuf,
    R: tl.constexpr, D: tl.constexpr, SNAP: tl.constexpr, HAS_LIVE: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """Window ``m``'s first half (channels ``:D``, the gate with its bias) into its carry row
    and, with ``SNAP``, its page snapshot."""
    pdl_enter(USE_PDL)
    m = tl.program_id(0).to(tl.int64)
    live = tl.load(live_ptr).to(tl.int64) if HAS_LIVE else live_n
    if m < live:
        src = (kv, gate, buf_kv, buf_gate, 0, 0, 0, 0, 0, s_step, s_buf, nbuf)
        dst = tl.load(carry_rows + m).to(tl.int64) * R * D
        page = tl.load(snap_page + m).to(tl.int64) * R * D  # (a carry row without SNAP: unused)
        cols = tl.arange(0, BLOCK)
        one = tl.arange(0, 1)
        for j in range(R):
            i = tl.load(windows + m * R + j + one)
            for c0 in range(0, D, BLOCK):
                c = c0 + cols
                ok = c < D
                x = tl.reshape(_staged(src, i, c[None, :], ok[None, :], False), [BLOCK])
                g = tl.reshape(_staged(src, i, c[None, :], ok[None, :], True), [BLOCK])
                g = g + tl.load(bias + j * 2 * D + c, mask=ok, other=0.0)
                at = j * D + c
                tl.store(carry_kv + dst + at, cast_to(x, carry_kv.dtype.element_ty), mask=ok)
                tl.store(carry_gate + dst + at, g, mask=ok)
                if SNAP:
                    tl.store(page_kv + page + at, cast_to(x, page_kv.dtype.element_ty), mask=ok)
                    tl.store(page_gate + page + at, g, mask=ok)


@triton.jit
def _compress_buffer_kernel(
    kv,
    gate,
    buf_kv,
    buf_gate,
    buf_rows,
    s_step,
    s_buf,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Token ``t``'s kv and gate rows into buffer row ``buf_rows[t]``."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    dst = tl.load(buf_rows + t).to(tl.int64) * s_buf
    cols = tl.arange(0, BLOCK)
    for c0 in range(0, C, BLOCK):
        c = c0 + cols
        ok = c < C
        x = tl.load(kv + t * s_step + c, mask=ok)
        g = tl.load(gate + t * s_step + c, mask=ok)
        tl.store(buf_kv + dst + c, x.to(buf_kv.dtype.element_ty), mask=ok)
        tl.store(buf_gate + dst + c, g.to(buf_gate.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit channel stride (a copy only where it has none)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def compress_windows(
    kv: torch.Tensor,
    gate: torch.Tensor,
    buf_kv: torch.Tensor,
    buf_gate: torch.Tensor,
    bias: torch.Tensor,
    windows: torch.Tensor,
    buf_rows: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    pool,
    dest: torch.Tensor,
    carry_kv: torch.Tensor | None = None,
    carry_gate: torch.Tensor | None = None,
    prev: torch.Tensor | None = None,
    carry_rows: torch.Tensor | None = None,
    page_kv: torch.Tensor | None = None,
    page_gate: torch.Tensor | None = None,
    snap_page: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
) -> tuple:
    """Triton ``compress_windows``: same signature and results as the reference (see the module
    docstring).  The buffers ``[B, C]``, carries and pages contiguous (as the slot state is);
    ``kv`` / ``gate`` ``[T, C]`` any row stride (views of a fused projection: no copy when they
    share it), index tensors and ``bias`` any layout (copied where not contiguous)."""
    kv, gate = _rows(kv), _rows(gate)
    if kv.stride(0) != gate.stride(0):  # the kernels take one row stride for both
        kv, gate = kv.contiguous(), gate.contiguous()
    bias, windows, buf_rows, dest = (x.contiguous() for x in (bias, windows, buf_rows, dest))
    prev, carry_rows, snap_page, live = (
        None if x is None else x.contiguous() for x in (prev, carry_rows, snap_page, live)
    )
    m, r = windows.shape
    t, c = kv.shape
    overlap = carry_kv is not None
    d = c // 2 if overlap else c
    has_live = live is not None
    live_arg = live if has_live else windows  # (not read without live)
    if m:
        packed = not isinstance(pool, torch.Tensor)
        out = torch.empty(m, d, dtype=kv.dtype, device=kv.device) if packed else pool
        block_l, block_p, tiles = block_sizes(2 * r if overlap else r, d)
        cg = carry_gate if overlap else bias  # (not read without overlap)
        _compress_windows_kernel[(m,)](
            kv,
            gate,
            buf_kv,
            buf_gate,
            carry_kv if overlap else kv,
            cg,
            bias,
            windows,
            prev if overlap else windows,
            norm_weight.contiguous(),
            positions.contiguous(),
            inv_freq.contiguous(),
            out,
            dest,
            live_arg,
            m,
            kv.stride(0),
            buf_kv.stride(0),
            buf_kv.shape[0],
            carry_kv.shape[0] if overlap else 0,
            m if overlap else 0,
            r,
            d,
            inv_freq.shape[0],
            out.stride(0),
            float(eps),
            float(rope_scale),
            int(overlap),
            ROW_IS_WINDOW=packed,
            HAS_LIVE=has_live,
            KV_DTYPE=_TL_DTYPES[kv.dtype],
            BLOCK_L=block_l,
            BLOCK_P=block_p,
            NUM_L_TILES=tiles,
            num_warps=4 if block_p <= 512 else 8,
            **pdl_args(),
        )
        if packed:
            cache_write(pool, dest, out)
        if overlap:
            snap = snap_page is not None
            _compress_carry_kernel[(m,)](
                kv, gate, buf_kv, buf_gate, bias, windows, carry_rows, carry_kv, carry_gate,
                snap_page if snap else carry_rows, page_kv if snap else carry_kv,
                page_gate if snap else carry_gate, live_arg, m, kv.stride(0), buf_kv.stride(0),
                buf_kv.shape[0], R=r, D=d, SNAP=snap, HAS_LIVE=has_live, BLOCK=min(_COPY_BLOCK, pow2(d)),
                **pdl_args(),
            )  # fmt: skip
    if t:
        block = min(_COPY_BLOCK, pow2(c))
        _compress_buffer_kernel[(t,)](
            kv, gate, buf_kv, buf_gate, buf_rows, kv.stride(0), buf_kv.stride(0), c, BLOCK=block, **pdl_args()
        )
    return pool, buf_kv, buf_gate, carry_kv, carry_gate, page_kv, page_gate
