"""The KV compressor's entry op: pool each closed window, norm it, rotate it, store it.

One op for what the compressor does with every window that closes in a step, so a backend
can fuse it into one kernel: softmax-gated pooling of the window's rows, RMS norm, the rope
rotation at the window's first position and the store into the entry pool.  The reference
is exactly the sequence of the separate ops (:func:`~deepinfer_core.ops.attention.compress_pool`,
:func:`~deepinfer_core.ops.norm.rms_norm`, :func:`~deepinfer_core.ops.rope.rope_cos_sin`,
:func:`~deepinfer_core.ops.rope.apply_rope`, :func:`~deepinfer_core.ops.cache.cache_write`),
so the model's outputs are bitwise those of the unfused sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from ._cases import randn
from .attention import compress_pool
from .cache import cache_write
from .kv_format import Fp8KVPool
from .norm import rms_norm
from .registry import define_op
from .rope import apply_rope, rope_cos_sin


def _inv_freq(rope_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def _entries_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    def case(m: int, r: int, d: int, rope_dim: int, n: int, scale: float, first_empty: bool) -> tuple:
        gate = randn(g, m, r, d)
        if first_empty and m:  # CSA's first window: the previous window's half is empty
            gate[0, : r // 2] = float("-inf")
        positions = torch.randint(0, 4096, (m,), generator=g) * r
        dest = torch.randperm(n, generator=g)[:m]
        return (
            randn(g, m, r, d, dtype=dtype),
            gate,
            1 + randn(g, d, scale=0.1),
            1e-6,
            positions,
            _inv_freq(rope_dim),
            scale,
            randn(g, n, d, dtype=dtype),
            dest,
        )

    return [
        (case(3, 8, 32, 8, 10, 1.0, True), {}),  # CSA-like: overlapping windows, L = 2r
        (case(2, 4, 16, 16, 5, 1.25, False), {}),  # every channel rotates; a YaRN scale
        (case(0, 4, 16, 8, 4, 1.0, False), {}),  # no window closes this step
    ]


@define_op("compress_entries", "compressor", batch_invariant=True, sample_cases=_entries_cases)
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
    """Compress ``M`` closed windows into entries and store them in the entry pool.

    Per window ``m`` (all arithmetic in fp32; ``round`` = a cast to ``kv.dtype``, round to
    nearest even; nothing is rounded for fp32 ``kv``):

    1. pooling (``compress_pool``): ``p[l] = round(softmax_l(gate[m])[l])`` per channel,
       ``pooled = round(sum_l round(kv[m, l] * p[l]))`` (the sum in fp32);
    2. RMS norm (``rms_norm``, weighted): ``e = round(pooled * rsqrt(mean(pooled²) + eps) * norm_weight)``;
    3. rope (``rope_cos_sin`` then ``apply_rope``) at ``positions[m]``: with
       ``f_i = float(positions[m]) * inv_freq[i]``, ``c_i = round(cos(f_i) * rope_scale)`` and
       ``s_i = round(sin(f_i) * rope_scale)``, the trailing ``R = 2 * len(inv_freq)``
       channels of ``e`` rotate in interleaved pairs:
       ``(e[2i], e[2i+1]) -> (round(e[2i] c_i - e[2i+1] s_i), round(e[2i] s_i + e[2i+1] c_i))``
       (offsets from the start of the rope slice); the leading ``D - R`` channels pass through;
    4. store (``cache_write``): ``pool[dest[m]] = entry``, in the pool's format.

    Args:
        kv: ``[M, L, D]`` the ``L`` source rows of each window (model dtype).
        gate: ``[M, L, D]`` float32 gate logits, position bias included; ``-inf`` marks an
            empty slot (each channel needs a finite logit, else the entry is NaN).
        norm_weight: ``[D]`` float32 RMS-norm weight; eps: the norm's eps.
        positions: ``[M]`` int64 position each entry is rotated to (its window's first).
        inv_freq: ``[R/2]`` float32 inverse frequencies; rope_scale: cos/sin multiplier.
        pool: ``[N, D]`` the entry pool: any cache :func:`~deepinfer_core.ops.cache.cache_write`
            takes (a tensor, whose dtype the entries are cast to, or a packed FP8 pool).
        dest: ``[M]`` int64 pool rows, distinct except the trash page's rows (as ``cache_write``).
        live: optional ``[1]`` int64 count of real windows, on the device: windows
            ``m >= live[0]`` are a fixed-shape step's padding, whose ``dest`` rows are the
            trash page's (nothing reads them), so an implementation may skip them; the
            reference computes them like the others.  ``None``: every window is real.

    Returns:
        ``pool``, written in place (rows not in ``dest`` untouched; with ``live``, the rows of
        padding windows may be left as they were).

    Batch invariance: window ``m``'s entry depends only on row ``m`` of ``kv``, ``gate``,
    ``positions`` and ``dest``, never on ``M`` (each step's ops are batch invariant).
    """
    entries = rms_norm(compress_pool(kv, gate), norm_weight, eps)
    cos, sin = rope_cos_sin(positions, inv_freq, rope_scale, entries.dtype)
    return cache_write(pool, dest, apply_rope(entries, cos, sin))


def window_case(
    g: torch.Generator,
    dtype: torch.dtype,
    tokens: int,
    windows: int,
    ratio: int,
    dim: int,
    overlap: bool,
    *,
    rope_dim: int,
    snap: bool = True,
    strided: bool = True,
    fp8_pool: bool = False,
) -> tuple[tuple, dict]:
    """One ``compress_windows`` call (a sample case): ``windows`` windows of ``ratio`` rows over
    slot buffers of ``tokens + 1`` slots and the step's ``tokens`` rows; the state rows written
    are distinct and many are also read (the buffer rows the windows read, the carries ``prev``
    picks).  ``strided``: ``kv`` and ``gate`` are views of one fused projection, as the attention
    block makes them; ``fp8_pool``: a packed pool (``dim - rope_dim`` a multiple of 64)."""
    c = (2 if overlap else 1) * dim
    slots = max(tokens, windows) + 1  # (a carry row per window at least)
    nbuf, n = slots * ratio, windows + 5
    if strided:
        fused = randn(g, tokens, 2 * c + 16, dtype=dtype)
        kv, gate = fused[:, 16 : 16 + c], fused[:, 16 + c :]
    else:
        kv, gate = randn(g, tokens, c, dtype=dtype), randn(g, tokens, c, dtype=dtype, scale=2.0)
    pool = randn(g, n, dim, dtype=dtype)
    args = (
        kv,
        gate,
        randn(g, nbuf, c, dtype=dtype),
        randn(g, nbuf, c, dtype=dtype, scale=2.0),
        randn(g, ratio, c, scale=0.5),
        torch.randint(0, nbuf + tokens, (windows, ratio), generator=g),
        torch.randperm(nbuf, generator=g)[:tokens],
        1 + randn(g, dim, scale=0.1),
        1e-6,
        torch.randint(0, 65536 // ratio, (windows,), generator=g) * ratio,
        _inv_freq(rope_dim),
        1.0,
        Fp8KVPool.from_values(pool, rope_dim) if fp8_pool else pool,
        torch.randperm(n, generator=g)[:windows],
    )
    kwargs: dict = {}
    if overlap:
        carries = slots
        # previous halves: a carry, an earlier window of the step, or none (the empty row)
        prev = torch.randint(0, carries + windows + 1, (windows,), generator=g)
        prev[:1] = carries + windows  # the first window of a sequence: no previous half
        kwargs = dict(
            carry_kv=randn(g, carries, ratio, dim, dtype=dtype),
            carry_gate=randn(g, carries, ratio, dim, scale=2.0),
            prev=prev,
            carry_rows=torch.randperm(carries, generator=g)[:windows],
        )
        if snap:
            pages = windows + 3
            kwargs |= dict(
                page_kv=randn(g, pages, ratio, dim, dtype=dtype),
                page_gate=randn(g, pages, ratio, dim),
                snap_page=torch.randperm(pages, generator=g)[:windows],
            )
    return args, kwargs


def _windows_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    case = lambda *a, **k: window_case(g, dtype, *a, rope_dim=8, **k)  # noqa: E731
    live = case(3, 2, 4, 16, True, snap=False, strided=False)
    live[1]["live"] = torch.tensor([2])  # every window live
    return [
        case(5, 3, 4, 16, True),  # CSA: overlapping windows, carries and page snapshots
        live,
        case(4, 2, 8, 16, False),  # HCA: windows of r rows
        case(2, 0, 4, 16, True),  # no window closes: the buffer writes alone
    ]


def _windows_via(ops: Any, *args: Any, **kwargs: Any) -> tuple:
    """``compress_windows``'s decomposition: the reference's staging, then the entries stored by
    the table ``ops``'s ``compress_entries`` (for a backend that fuses the entries but not the
    staging)."""
    return _windows_step(ops.compress_entries, *args, **kwargs)


@define_op("compress_windows", "compressor", sample_cases=_windows_cases, decomposition=_windows_via)
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
    pool: torch.Tensor,
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
    """A compressor's whole step: stage the ``M`` windows that close, store their entries
    (:func:`compress_entries`), save the overlap carries, buffer the step's rows.

    A backend can do in a few launches what the staging takes a dozen ops for, reading each
    window's rows where they are instead of gathering copies of them.

    *Staging rows* are ``[buf rows (B) ; step rows (T)]``: row ``i < B`` is ``buf_*[i]``, row
    ``i >= B`` is ``kv`` / ``gate[i - B]``.  Window ``m``'s ``r`` staged rows are the staging rows
    ``windows[m]``, its staged gate their gate (widened to fp32) plus ``bias`` (fp32 add).
    Without overlap (``carry_kv`` ``None``, ``C = D``) the staged rows are the window
    (``L = r``).  With overlap (CSA, ``C = 2D``) the window is ``L = 2r`` rows: first the
    previous window's first half, then the second-half series (channels ``D:``) of its own
    staged rows; ``prev[m]`` picks that first half from ``[carries (NC) ; first halves
    (channels ``:D``) of this call's staged windows (M) ; an empty one]`` (the empty half:
    zero values, ``-inf`` gates).  Then, in this order:

    1. entries: :func:`compress_entries` of the windows (``live`` as there);
    2. carries (overlap): ``carry_*[carry_rows[m]]`` = window ``m``'s staged first half, and
       ``page_*[snap_page[m]]`` the same when ``snap_page`` is given;
    3. buffer: ``buf_kv[buf_rows[t]] = kv[t]``, ``buf_gate[buf_rows[t]] = gate[t]``.

    Every read of state (buffers and carries) sees it as it was before the call.

    Args:
        kv, gate: ``[T, C]`` the step's projections (model dtype; ``gate`` without the bias).
        buf_kv, buf_gate: ``[B, C]`` the slots' partial-window buffers (all slots' rows).
        bias: ``[r, C]`` float32 per-row position bias of the gate.
        windows: ``[M, r]`` int64 staging rows of each window; buf_rows: ``[T]`` int64.
        norm_weight, eps, positions, inv_freq, rope_scale, pool, dest, live: as
            :func:`compress_entries` (``pool`` ``[N, D]``, ``dest`` / ``positions`` ``[M]``).
        carry_kv, carry_gate: ``[NC, r, D]`` the overlap carries (``carry_gate`` float32), or
            ``None`` without overlap; prev, carry_rows: ``[M]`` int64.
        page_kv, page_gate, snap_page: the page snapshots ``[P, r, D]`` and ``[M]`` pages, or
            ``None`` (no snapshot this step).

    Write targets are distinct except the trash slot's / page's rows (as ``cache_write``);
    with ``live``, the padding windows' writes (all to trash rows, which nothing reads) may be
    skipped or hold other values.

    Returns:
        ``(pool, buf_kv, buf_gate, carry_kv, carry_gate, page_kv, page_gate)``, written in place
        (``None`` where not given).
    """
    return _windows_step(
        compress_entries, kv, gate, buf_kv, buf_gate, bias, windows, buf_rows, norm_weight, eps,
        positions, inv_freq, rope_scale, pool, dest, carry_kv, carry_gate, prev, carry_rows, page_kv,
        page_gate, snap_page, live,
    )  # fmt: skip


def _windows_step(
    entries, kv, gate, buf_kv, buf_gate, bias, windows, buf_rows, norm_weight, eps, positions,
    inv_freq, rope_scale, pool, dest, carry_kv=None, carry_gate=None, prev=None, carry_rows=None,
    page_kv=None, page_gate=None, snap_page=None, live=None,
) -> tuple:  # fmt: skip
    """The reference's sequence (see :func:`compress_windows`), the entries by ``entries``."""
    overlap = carry_kv is not None
    if windows.shape[0]:  # zero: no window closes (an unpadded step), or no tokens
        stage_kv = torch.nn.functional.embedding(windows, torch.cat([buf_kv, kv]))  # [M, r, C]
        stage_gate = torch.nn.functional.embedding(windows, torch.cat([buf_gate, gate]))
        stage_gate = torch.add(stage_gate, bias)  # promoted to the fp32 bias: one launch
        if overlap:
            assert carry_gate is not None and prev is not None and carry_rows is not None
            d = carry_kv.shape[-1]
            empty = (1, *carry_kv.shape[1:])
            empty_kv = torch.zeros(empty, dtype=stage_kv.dtype, device=kv.device)
            empty_gate = torch.full(empty, float("-inf"), dtype=torch.float32, device=kv.device)
            prev_kv = torch.cat([carry_kv, stage_kv[..., :d], empty_kv]).index_select(0, prev)
            prev_gate = torch.cat([carry_gate, stage_gate[..., :d], empty_gate]).index_select(0, prev)
            win_kv = torch.cat([prev_kv, stage_kv[..., d:]], dim=1)
            win_gate = torch.cat([prev_gate, stage_gate[..., d:]], dim=1)
        else:
            win_kv, win_gate = stage_kv, stage_gate
        args = (win_kv, win_gate, norm_weight, eps, positions, inv_freq, rope_scale, pool, dest, live)
        entries(*args)
        if overlap:
            for state, page, staged in ((carry_kv, page_kv, stage_kv), (carry_gate, page_gate, stage_gate)):
                cache_write(state, carry_rows, staged[..., :d])
                if snap_page is not None:  # the carry at each page end, for prefix hits
                    cache_write(page, snap_page, staged[..., :d])
    cache_write(buf_kv, buf_rows, kv)
    cache_write(buf_gate, buf_rows, gate)
    return pool, buf_kv, buf_gate, carry_kv, carry_gate, page_kv, page_gate
