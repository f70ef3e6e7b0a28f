"""``hc_post_pre`` and ``hc_head_norm`` in two launches each (contract: ``deepinfer_core.ops.mhc``).

Between two blocks the reference runs ``hc_post`` (one kernel), ``hc_pre`` (two) and the next
block's ``rms_norm`` (one).  Here:

1. :func:`_hc_post_mix_kernel` is :func:`~.mhc._hc_mix_kernel` whose streams are
   ``hc_post``'s output, computed for the program's ``[BLOCK_T, BLOCK_K]`` slice of one stream
   ``n`` as :func:`~.mhc._hc_post_kernel` computes it (the same operations per element, so the
   same values), stored, and projected on ``fn`` from registers.  A slice reads the ``N`` input
   streams at its channels (the other streams' programs read them too, from L2).  Its splits
   never straddle two streams (``N * ceil(D / BLOCK_K)`` of them: the same as ``hc_pre``'s when
   ``BLOCK_K`` divides ``D``, as at V4's widths).  Without a block output (the first block) it is
   ``hc_pre``'s own projection kernel.
2. :func:`~.mhc._hc_finish_kernel` with ``NORM``: one program per token and whole row sums the
   partials, computes ``pre`` and the collapsed row, then norms it with ``rms_norm``'s
   arithmetic (the row rounded to the streams' dtype first, as ``hc_pre`` returns it); a second
   program per token sums the same partials and computes ``post`` and ``comb``.

``hc_head_norm`` (the final collapse and the model's last norm) is ``hc_head``'s two kernels with
that norm in the finishing one, where the sequence takes three launches.

Splits and block sizes depend on ``N`` and ``D`` only: a token's results do not depend on the
batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast_to, cdiv, round_through
from .mhc import (
    BLOCK_K,
    BLOCK_T,
    MIX_WARPS,
    empty_outputs,
    finish,
    fn_slice,
    mix_and_finish,
    mix_width,
    project_slice,
    unit_last,
)
from .pdl import pdl_args, pdl_enter


@triton.jit
def _hc_post_mix_kernel(
    bo_ptr,
    s_ptr,
    post_ptr,
    comb_ptr,
    new_ptr,
    fn_ptr,
    part_ptr,
    T,
    M,
    D,
    stride_bt,
    stride_st,
    stride_sn,
    stride_pt,
    stride_pn,
    stride_ct,
    stride_cj,
    stride_cn,
    stride_fm,
    N: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PER_STREAM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    # splits vary fastest in launch order: a token block's programs run together, so the N
    # programs reading the same input channels (one per output stream) find them in L2
    rows = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    split = tl.program_id(0)  # stream n's channel block: splits never straddle two streams
    n = split // SPLITS_PER_STREAM
    d = (split % SPLITS_PER_STREAM) * BLOCK_K + tl.arange(0, BLOCK_K)
    d_mask = d < D
    k = n * D + d  # the flattened columns
    td_mask = row_mask[:, None] & d_mask[None, :]
    dtype = new_ptr.dtype.element_ty
    w = fn_slice(fn_ptr, k, d_mask, M, stride_fm, BLOCK_M)  # a weight: its load overlaps hc_post's

    # hc_post: new[n, d] = round(sum_j comb[j, n] * streams_j[d]) + post_n * block_out[d], with
    # comb and post rounded to the streams' dtype first (the reference mixes in that dtype)
    post = tl.load(post_ptr + rows * stride_pt + n * stride_pn, mask=row_mask, other=0.0)
    post = round_through(post.to(tl.float32), dtype)
    block_out = tl.load(bo_ptr + rows[:, None] * stride_bt + d[None, :], mask=td_mask, other=0.0)
    mixed = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(N):
        c = tl.load(comb_ptr + rows * stride_ct + j * stride_cj + n * stride_cn, mask=row_mask, other=0.0)
        c = round_through(c.to(tl.float32), dtype)
        s_ptrs = s_ptr + rows[:, None] * stride_st + j * stride_sn + d[None, :]
        mixed += c[:, None] * tl.load(s_ptrs, mask=td_mask, other=0.0).to(tl.float32)
    new = cast_to(round_through(mixed, dtype) + post[:, None] * block_out.to(tl.float32), dtype)
    new_ptrs = new_ptr + rows[:, None] * (N * D) + k[None, :]
    tl.store(new_ptrs, new, mask=td_mask)

    # hc_pre's projection of the new streams (as _hc_mix_kernel), read back after a block barrier
    # (the CTA's own writes, from L1 / L2): a fresh load in the dot's operand layout, so the
    # hc_post registers are dead here (projecting them in place spills at 255 registers a thread)
    tl.debug_barrier()
    x = tl.load(new_ptrs, mask=td_mask, other=0.0).to(tl.float32)
    project_slice(x, w, part_ptr, rows, row_mask, split, M, SPLITS, BLOCK_M)


def _post_mix(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hc_post``'s streams ``[T, N, D]`` and their projection partials (:func:`mix`'s)."""
    t, n, d = streams.shape
    m = fn.shape[0]
    new = torch.empty(t, n, d, dtype=streams.dtype, device=streams.device)
    streams, block_out, fn = unit_last(streams), unit_last(block_out), unit_last(fn)
    per_stream = cdiv(d, BLOCK_K)
    splits = n * per_stream
    block_m = mix_width(m)
    part = torch.empty(t, splits, block_m, dtype=torch.float32, device=streams.device)
    _hc_post_mix_kernel[(splits, cdiv(t, BLOCK_T))](
        block_out,
        streams,
        post,
        comb,
        new,
        fn,
        part,
        t,
        m,
        d,
        block_out.stride(0),
        streams.stride(0),
        streams.stride(1),
        post.stride(0),
        post.stride(1),
        comb.stride(0),
        comb.stride(1),
        comb.stride(2),
        fn.stride(0),
        N=n,
        SPLITS=splits,
        SPLITS_PER_STREAM=per_stream,
        BLOCK_T=BLOCK_T,
        BLOCK_K=BLOCK_K,
        BLOCK_M=block_m,
        num_warps=MIX_WARPS,  # hc_pre's projection's warps: the same dot
        **pdl_args(),
    )
    return new, part


def hc_post_pre(
    block_out: torch.Tensor | None,
    streams: torch.Tensor,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton ``hc_post_pre``: same signature, shapes and numerics as the reference (see the
    module docstring); ``D`` at most :data:`~.mhc.MAX_NORM_D`.  Returns contiguous new
    streams (``streams`` itself without ``block_out``), ``post``, ``comb`` and normed input."""
    if block_out is None:  # the first block: hc_pre's kernels, the norm in the finishing one
        mixed = mix_and_finish(
            streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, True, True, norm_weight
        )
        return streams, *mixed
    t, n, d = streams.shape
    out_post, out_comb, x = empty_outputs(streams)
    if t == 0 or d == 0:
        return torch.empty_like(streams), out_post, out_comb, x
    new, part = _post_mix(block_out, streams, post, comb, fn)
    flat = new.view(t, n * d)
    finish(
        part,
        flat,
        base,
        scale,
        out_post,
        out_comb,
        x,
        norm_eps,
        hc_eps,
        sinkhorn_iters,
        full=True,
        norm=True,
        norm_weight=norm_weight,
    )
    return new, out_post, out_comb, x


def hc_head_norm(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    norm_weight: torch.Tensor | None,
) -> torch.Tensor:
    """Triton ``hc_head_norm``: ``hc_head``'s two kernels with the final norm in the finishing
    one (one program per token and whole row, as for ``hc_post_pre``); the same numerics as
    ``hc_head`` then ``rms_norm``.  Returns a contiguous ``[T, D]`` tensor in ``streams.dtype``."""
    return mix_and_finish(streams, fn, base, scale, norm_eps, hc_eps, 1, False, True, norm_weight)[2]
