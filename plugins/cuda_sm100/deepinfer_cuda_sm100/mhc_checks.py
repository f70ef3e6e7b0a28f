"""The ``supports`` predicates of the ``cuda_sm100`` mHC ops (``hc_pre``, ``hc_post``,
``hc_post_pre``, ``hc_head``, ``hc_head_norm``): shapes, dtypes and devices only (no values, so no device
synchronisation).  Importing this module does not import Triton."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_cuda_sm100.checks import (
    Verdict,
    activation,
    device_checks,
    first_problem,
    float_dtype,
    fused_norm,
    shape_is,
)

MAX_STREAMS = 8
"""Most mHC streams (``N``) the kernels take: a token's mixing weights live in registers."""


def _streams_n(streams) -> int:
    """``N`` of ``[T, N, D]`` streams, 0 for anything else (whose checks then say what is wrong)."""
    return streams.shape[1] if isinstance(streams, torch.Tensor) and streams.dim() == 3 else 0


def mhc_supports(interpreted: bool) -> dict[str, Callable[..., Verdict]]:
    """The predicates, for kernels that are ``interpreted`` (CPU) or compiled (CUDA)."""

    def streams_checks(streams) -> Verdict:
        return first_problem(
            activation("streams", streams),
            (streams.dim() == 3, f"streams has {streams.dim()} dims, expected [T, N, D]"),
            (streams.dim() != 3 or 1 <= streams.shape[1] <= MAX_STREAMS, f"N must be 1..{MAX_STREAMS}"),
        )

    def norm_checks(d: int, norm_weight) -> Verdict:
        """The norm a fused kernel applies to rows of ``d``: one program holds a row; the
        weight ``[D]`` float or ``None``."""
        dev = device_checks(interpreted, norm_weight=norm_weight)
        if dev is not True:
            return dev
        return first_problem(*fused_norm(d, "norm_weight", norm_weight))

    def on_device(mhc_streams, /, **tensors) -> Verdict:
        """The ``tensors`` (the streams among them, in the order their problems are named) on
        the kernels' device, then the checks of ``mhc_streams``."""
        dev = device_checks(interpreted, **tensors)
        return dev if dev is not True else streams_checks(mhc_streams)

    def mixing_checks(streams, fn, base, scale, rows: int, scales: int, *more) -> Verdict:
        """``streams`` and the mixing weights ``fn [rows, N*D]``, ``base [rows]``, ``scale
        [scales]`` of ``hc_pre`` / ``hc_head``, then the ``more`` checks."""
        ok = on_device(streams, streams=streams, fn=fn, base=base, scale=scale)
        if ok is not True:
            return ok
        _, n, d = streams.shape
        return first_problem(
            float_dtype("fn", fn),
            float_dtype("base", base),
            float_dtype("scale", scale),
            shape_is("fn", fn, (rows, n * d)),
            shape_is("base", base, (rows,)),
            shape_is("scale", scale, (scales,)),
            *more,
        )

    def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) -> Verdict:
        n = _streams_n(streams)
        iters = (
            isinstance(sinkhorn_iters, int) and not isinstance(sinkhorn_iters, bool),
            f"sinkhorn_iters is a {type(sinkhorn_iters).__name__}, not an int",
        )
        return mixing_checks(streams, fn, base, scale, (2 + n) * n, 3, iters)

    def hc_post_pre(
        block_out, streams, post, comb, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, norm_weight
    ) -> Verdict:
        checks = [hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)]
        if block_out is not None:
            if post is None or comb is None:
                return "block_out is given without the previous block's post and comb"
            checks.append(hc_post(block_out, streams, post, comb))
        elif post is not None or comb is not None:
            return "post and comb are given without block_out (the first block has neither)"
        for verdict in checks:
            if verdict is not True:
                return verdict
        return norm_checks(streams.shape[2], norm_weight)

    def hc_head(streams, fn, base, scale, norm_eps, hc_eps) -> Verdict:
        return mixing_checks(streams, fn, base, scale, _streams_n(streams), 1)

    def hc_post(block_out, streams, post, comb) -> Verdict:
        ok = on_device(streams, block_out=block_out, streams=streams, post=post, comb=comb)
        if ok is not True:
            return ok
        t, n, d = streams.shape
        return first_problem(
            (
                block_out.dtype == streams.dtype,
                f"block_out dtype {block_out.dtype} differs from streams dtype {streams.dtype}",
            ),
            shape_is("block_out", block_out, (t, d)),
            float_dtype("post", post),
            float_dtype("comb", comb),
            shape_is("post", post, (t, n)),
            shape_is("comb", comb, (t, n, n)),
        )

    def hc_head_norm(streams, fn, base, scale, norm_eps, hc_eps, norm_weight) -> Verdict:
        verdict = hc_head(streams, fn, base, scale, norm_eps, hc_eps)
        return verdict if verdict is not True else norm_checks(streams.shape[2], norm_weight)

    return {
        "hc_pre": hc_pre,
        "hc_post": hc_post,
        "hc_post_pre": hc_post_pre,
        "hc_head": hc_head,
        "hc_head_norm": hc_head_norm,
    }
