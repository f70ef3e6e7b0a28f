"""``qk_norm_rope`` in one launch (contract: ``deepinfer_core.ops.rope``).

The attention block's queries and shared key-value row go through four ops in sequence: the
queries' per-head unweighted ``rms_norm`` (V4; V4.1 leaves the queries unnormed), the row's
weighted ``rms_norm``, and ``apply_rope`` on each.  Here one launch does all of it:
:func:`_qk_norm_rope_kernel` takes ``BLOCK_R`` rows of ``D`` channels a program -- the query
heads' rows first, then the key rows, never both in one program -- norms them with
``rms_norm``'s arithmetic and tile (the same ``BLOCK_R x BLOCK_D`` tile and warps as
:mod:`~.norm`'s kernel, so the same sums), stores them, and after a block barrier reads the
rope channels' pairs back and rotates them with ``apply_rope``'s arithmetic (:mod:`~.rope`):
every output bitwise the four kernels'.  The key's norm weight and the rows' rope tables are
loaded with the rows, before the sum of squares, so their latency overlaps the rows'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast_to, cdiv, pow2, round_through
from .norm import rms_factor, row_tile
from .pdl import pdl_args, pdl_enter


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    kv_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    kv_out_ptr,
    T,
    H: tl.constexpr,
    D,
    HALF,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_ct,
    stride_st,
    eps,
    Q_PROGRAMS,
    NORM_Q: tl.constexpr,
    KV_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    is_q = pid < Q_PROGRAMS  # a program takes query rows or key rows, never both
    r = tl.where(is_q, pid, pid - Q_PROGRAMS).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    n_rows = tl.where(is_q, T * H, T)
    row_mask = r < n_rows
    t = tl.where(is_q, r // H, r)  # each row's token (H a constant: no division subroutine)
    x_rows = tl.where(is_q, q_ptr + t * stride_qt + (r % H) * stride_qh, kv_ptr + t * stride_kt)
    o_rows = tl.where(is_q, q_out_ptr + r * D, kv_out_ptr + r * D)
    dtype = q_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)
    m = row_mask[:, None] & (cols < D)[None, :]

    # rms_norm: unweighted for the queries (the factor rounded to the dtype), weighted for the key
    x = tl.load(x_rows[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    # what does not depend on x is loaded before the sum's block barrier (its latency overlaps
    # x's): the key's norm weight and the rows' rope tables
    if KV_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    i = tl.arange(0, BLOCK_HALF)
    pm = row_mask[:, None] & (i < HALF)[None, :]
    cos = tl.load(cos_ptr + t[:, None] * stride_ct + i[None, :], mask=pm, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t[:, None] * stride_st + i[None, :], mask=pm, other=0.0).to(tl.float32)
    factor = rms_factor(tl.sum(x * x, axis=1), D, eps, tl.float32, False)
    q_factor = round_through(factor, dtype)
    if NORM_Q:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        y_q = x * q_factor[:, None]
    else:
        y_q = x
    if KV_WEIGHT:  # noqa: SIM108  (a constexpr branch in a Triton kernel)
        y_kv = x * factor[:, None] * w[None, :]
    else:  # unweighted, as the queries
        y_kv = x * q_factor[:, None]
    y = tl.where(is_q, y_q, y_kv)
    tl.store(o_rows[:, None] + cols[None, :], cast_to(y, dtype), mask=m)

    # apply_rope on the stored rows: the trailing 2 * HALF channels in interleaved pairs
    tl.debug_barrier()
    even = o_rows[:, None] + (D - 2 * HALF) + 2 * i[None, :]
    a = tl.load(even, mask=pm, other=0.0).to(tl.float32)
    b = tl.load(even + 1, mask=pm, other=0.0).to(tl.float32)
    tl.store(even, cast_to(a * cos - b * sin, dtype), mask=pm)
    tl.store(even + 1, cast_to(a * sin + b * cos, dtype), mask=pm)


def qk_norm_rope(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_q: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``qk_norm_rope``: same signature, shapes and numerics as the reference (see the
    module docstring); ``D`` at most :data:`~.norm.MAX_BLOCK_D`, a unit channel stride on ``q``
    and ``kv`` (rows of any stride).  Returns contiguous ``(q, kv)``."""
    t, h, d = q.shape
    half = cos.shape[-1]
    q_out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    kv_out = torch.empty(t, d, dtype=kv.dtype, device=kv.device)
    if t == 0 or d == 0:
        return q_out, kv_out
    cos, sin = (
        cos if cos.stride(-1) == 1 else cos.contiguous(),
        sin if sin.stride(-1) == 1 else sin.contiguous(),
    )
    block_r, block_d, warps = row_tile(d)
    q_programs = cdiv(t * h, block_r)
    weight = kv_weight.contiguous() if kv_weight is not None else None
    _qk_norm_rope_kernel[(q_programs + cdiv(t, block_r),)](
        q,
        kv,
        weight if weight is not None else cos,
        cos,
        sin,
        q_out,
        kv_out,
        t,
        h,
        d,
        half,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        cos.stride(0),
        sin.stride(0),
        float(eps),
        q_programs,
        NORM_Q=bool(norm_q),
        KV_WEIGHT=weight is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        BLOCK_HALF=pow2(half),
        num_warps=warps,
        **pdl_args(),
    )
    return q_out, kv_out
