"""The mHC ops on torch_npu's mHC operators: ``hc_pre`` (``npu_mhc_pre`` then
``npu_mhc_sinkhorn``), ``hc_post`` (``npu_mhc_post``) and ``hc_head`` (``npu_mhc_pre`` with the
post group zeroed and no res group: its ``h_in`` is the head's collapse).

Argument mapping: the contract's ``fn`` rows are ordered pre, post, comb -- the operator's
``phi`` (W_pre, W_post, W_res); ``scale`` is ``alpha``, ``base`` is ``bias``; the unweighted
RMS norm is ``gamma=None``.  The contract mixes the streams as ``sum_j comb[j, n] x_j``, the
operator as ``H_res × x``, so ``hc_post`` passes ``comb`` transposed.
"""

from __future__ import annotations

import torch

from .attention_checks import (
    HALF_DTYPES,
    Verdict,
    dtype_in,
    first_problem,
    is_tensor,
    not_batch_invariant,
    plain_int,
    shape_is,
)
from .npu import torch_npu

MHC_STREAMS = (4, 6, 8)
"""Stream counts ``n`` the mHC operators take."""
MHC_MAX_DIM = 16384


def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """The contract's ``hc_pre``: ``(post, comb, collapsed)``."""
    npu = torch_npu()
    h_in, h_post, h_res, *_ = npu.npu_mhc_pre(streams, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps)
    comb = npu.npu_mhc_sinkhorn(h_res, eps=hc_eps, num_iters=sinkhorn_iters)[0]
    return h_post, comb, h_in


def hc_head(streams, fn, base, scale, norm_eps, hc_eps):
    """The contract's ``hc_head``: ``npu_mhc_pre``'s ``h_in`` with a zero post group."""
    npu = torch_npu()
    n = streams.shape[1]
    phi = torch.cat([fn.float(), fn.new_zeros(n, fn.shape[1], dtype=torch.float32)])
    alpha = torch.cat([scale.float().reshape(1), scale.new_zeros(1, dtype=torch.float32)])
    bias = torch.cat([base.float(), base.new_zeros(n, dtype=torch.float32)])
    return npu.npu_mhc_pre(streams, phi, alpha, bias, norm_eps=norm_eps, hc_eps=hc_eps)[0]


def hc_post(block_out, streams, post, comb):
    """The contract's ``hc_post`` (``comb`` transposed into the operator's ``H_res``).  The
    contract mixes in the streams' dtype, so ``comb`` and ``post`` are rounded to it before they
    go to the operator as float32."""
    dtype = streams.dtype
    h_res = comb.to(dtype).float().transpose(-1, -2)
    return torch_npu().npu_mhc_post(streams, h_res, block_out, post.to(dtype).float())


def _streams(streams) -> Verdict:
    ok = first_problem(is_tensor("streams", streams))
    if ok is not True:
        return ok
    ok = first_problem(
        dtype_in("streams", streams, HALF_DTYPES),
        (streams.dim() == 3, f"streams has {streams.dim()} dims, expected [T, N, D]"),
    )
    if ok is not True:
        return ok
    t, n, d = streams.shape
    return first_problem(
        (t >= 1, "no rows (the operators take no empty tensor)"),
        (n in MHC_STREAMS, f"{n} streams: the operators take {MHC_STREAMS}"),
        (
            d % 16 == 0 and 16 <= d <= MHC_MAX_DIM,
            f"D={d}: the operator takes multiples of 16 up to {MHC_MAX_DIM}",
        ),
    )


def _weights(fn, base, scale, rows: int, width: int, scales: int) -> Verdict:
    ok = first_problem(is_tensor("fn", fn), is_tensor("base", base), is_tensor("scale", scale))
    if ok is not True:
        return ok
    return first_problem(
        (fn.dtype == torch.float32, f"fn dtype {fn.dtype}: the operator's phi is float32"),
        shape_is("fn", fn, (rows, width)),
        (base.is_floating_point(), f"base dtype {base.dtype}"),
        shape_is("base", base, (rows,)),
        (scale.is_floating_point(), f"scale dtype {scale.dtype}"),
        shape_is("scale", scale, (scales,)),
    )


def hc_pre_supports(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) -> Verdict:
    ok = first_problem(not_batch_invariant())
    if ok is not True:
        return ok
    ok = _streams(streams)
    if ok is not True:
        return ok
    _, n, d = streams.shape
    ok = _weights(fn, base, scale, (2 + n) * n, n * d, 3)
    if ok is not True:
        return ok
    return first_problem(plain_int("sinkhorn_iters", sinkhorn_iters, 1, 100))


def hc_head_supports(streams, fn, base, scale, norm_eps, hc_eps) -> Verdict:
    ok = first_problem(not_batch_invariant())
    if ok is not True:
        return ok
    ok = _streams(streams)
    if ok is not True:
        return ok
    _, n, d = streams.shape
    return _weights(fn, base, scale, n, n * d, 1)


def hc_post_supports(block_out, streams, post, comb) -> Verdict:
    ok = _streams(streams)
    if ok is not True:
        return ok
    t, n, d = streams.shape
    ok = first_problem(is_tensor("block_out", block_out), is_tensor("post", post), is_tensor("comb", comb))
    if ok is not True:
        return ok
    return first_problem(
        (block_out.dtype == streams.dtype, f"block_out dtype {block_out.dtype} differs from streams'"),
        shape_is("block_out", block_out, (t, d)),
        (post.is_floating_point() and comb.is_floating_point(), "post / comb must be float tensors"),
        shape_is("post", post, (t, n)),
        shape_is("comb", comb, (t, n, n)),
    )
