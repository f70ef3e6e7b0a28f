"""Manifold-constrained hyper-connections (mHC): V4's multi-stream residual."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from ._cases import randn
from .cast import cast
from .modes import batch_invariant_enabled, row_padded, tiled_linear
from .norm import rms_norm
from .registry import define_op


def _hc_pre_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    n, d = 4, 16
    return [
        (
            (
                randn(g, 5, n, d, dtype=dtype),
                randn(g, (2 + n) * n, n * d, scale=0.1),
                randn(g, (2 + n) * n),
                1 + randn(g, 3, scale=0.1),
                1e-6,
                1e-6,
                20,
            ),
            {},
        )
    ]


@define_op("hc_pre", "mhc", batch_invariant=True, sample_cases=_hc_pre_cases)
@row_padded({"streams": 0.0})
def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC mixing weights for one block and the collapsed block input.

    Args:
        streams: ``[T, N, D]`` residual streams (model dtype).
        fn: ``[(2+N)*N, N*D]`` float32 projection; base: ``[(2+N)*N]``; scale: ``[3]``.
        norm_eps: eps of the unweighted RMS norm over the flattened streams.
        hc_eps: floor added to ``pre`` / ``comb`` and to the Sinkhorn denominators.
        sinkhorn_iters: Sinkhorn-Knopp iterations making ``comb`` doubly stochastic.

    Returns:
        ``(post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, D] in streams.dtype)`` with
        ``pre = sigmoid(.)+eps`` (consumed: ``collapsed = sum_n pre_n * streams_n``),
        ``post = 2*sigmoid(.)`` and ``comb`` = Sinkhorn(softmax(.)+eps), columns first.
    """
    t, n, d = streams.shape
    # Dispatch dominates at decode sizes, and reductions over tiny inner dimensions are
    # slow, so the weights are computed token-last ([., T], T contiguous): fused norm, one
    # addcmul for the three groups (each row's scale gathered by a cached index), in-place
    # eps as a tensor, and the softmax written straight into Sinkhorn's bordered buffer.
    f32, dev = torch.float32, streams.device
    eps = _scalar(hc_eps, dev)
    flat = F.rms_norm(cast(streams.reshape(t, n * d), f32), (n * d,), None, norm_eps)
    linear = tiled_linear if batch_invariant_enabled() else F.linear
    mixes = linear(flat, cast(fn, f32)).t().contiguous()  # [(2+N)*N, T]
    row_scale = scale.index_select(0, _group_index(n, dev)).unsqueeze(-1)  # [(2+N)*N, 1]
    z = torch.addcmul(cast(base, f32).unsqueeze(-1), mixes, cast(row_scale, f32))
    gates = torch.sigmoid(z[: 2 * n])
    pre = gates[:n].add_(eps)  # [N, T]
    post = gates[n:]
    post.add_(post)  # 2*sigmoid, exactly
    bordered = z.new_full((n + 1, n + 1, t), hc_eps)
    torch.add(torch.softmax(z[2 * n :].view(n, n, t), dim=1), eps, out=bordered[:n, :n])
    comb = _sinkhorn(bordered, sinkhorn_iters)
    collapsed = cast((pre.t().unsqueeze(-1) * streams).sum(dim=1), streams.dtype)
    return post.t(), comb, collapsed


_SCALARS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A cached float32 0-dim tensor (creating one per call costs a dispatch)."""
    key = (value, device)
    if key not in _SCALARS:
        _SCALARS[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return _SCALARS[key]


_GROUPS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _group_index(n: int, device: torch.device) -> torch.Tensor:
    """``[(2+N)*N]`` int64: the ``scale`` entry of each mixing row (pre, post, comb)."""
    key = (n, device)
    if key not in _GROUPS:
        _GROUPS[key] = torch.tensor([0] * n + [1] * n + [2] * n * n, device=device)
    return _GROUPS[key]


def _sinkhorn(a: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn-Knopp on the ``N x N`` block of ``a`` ``[N+1, N+1, T]`` (token-last), in
    place: columns, then ``iters-1`` rounds of rows and columns, each ``x/(sum+eps)``.
    Returns ``[T, N, N]``.

    The matrices are tiny, so dispatch, not arithmetic, sets the cost; the layout keeps it
    at two ops per normalisation.  The extra row and column of ``a`` hold ``eps``: a row
    (column) sum over the bordered block *is* ``sum + eps``, and only the ``N x N`` block is
    divided.  Token-last, every broadcast is over a leading dimension with T contiguous,
    which vectorises.
    """
    n, t = a.shape[0] - 1, a.shape[2]
    block, with_eps_col, with_eps_row = a[:n, :n], a[:n], a[:, :n]
    rows, cols = a.new_empty(n, 1, t), a.new_empty(1, n, t)
    total, divide = torch.sum, block.div_  # bound once: the loop is all call overhead
    divide(total(with_eps_row, 0, True, out=cols))
    for _ in range(iters - 1):
        divide(total(with_eps_col, 1, True, out=rows))
        divide(total(with_eps_row, 0, True, out=cols))
    return block.permute(2, 0, 1).contiguous()


def _hc_post_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    n, d = 4, 16
    return [
        (
            (
                randn(g, 5, d, dtype=dtype),
                randn(g, 5, n, d, dtype=dtype),
                randn(g, 5, n).sigmoid(),
                randn(g, 5, n, n).softmax(-1),
            ),
            {},
        )
    ]


@define_op("hc_post", "mhc", batch_invariant=True, sample_cases=_hc_post_cases)
@row_padded({"block_out": 0.0, "streams": 0.0, "post": 0.0, "comb": 0.0})
def hc_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand a block's output back into the streams and mix the residual.

    Args:
        block_out: ``[T, D]`` attention or MoE output.
        streams: ``[T, N, D]`` the block's input streams.
        post: ``[T, N]``; comb: ``[T, N, N]`` from :func:`hc_pre`.

    Returns:
        ``[T, N, D]``: ``post_n * block_out + sum_j comb[j, n] * streams_j`` (in streams.dtype).
    """
    dtype = streams.dtype
    mixed = torch.bmm(cast(comb, dtype).transpose(-1, -2), streams)  # matmul's bmm, without its reshapes
    return torch.addcmul(mixed, cast(post, dtype).unsqueeze(-1), block_out.unsqueeze(-2))


def _hc_head_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    n, d = 4, 16
    return [
        (
            (
                randn(g, 5, n, d, dtype=dtype),
                randn(g, n, n * d, scale=0.1),
                randn(g, n),
                randn(g, 1).abs(),
                1e-6,
                1e-6,
            ),
            {},
        )
    ]


@define_op("hc_head", "mhc", batch_invariant=True, sample_cases=_hc_head_cases)
@row_padded({"streams": 0.0})
def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    """Final collapse of the streams before the last norm.

    Args:
        streams: ``[T, N, D]``; fn: ``[N, N*D]`` fp32; base: ``[N]``; scale: ``[1]``.
        norm_eps: eps of the unweighted RMS norm; hc_eps: floor added to the weights.

    Returns:
        ``[T, D]`` in streams.dtype: ``sum_n (sigmoid(mix_n*scale+base_n)+eps) * streams_n``.
    """
    t, n, d = streams.shape
    f32 = torch.float32
    flat = cast(streams.reshape(t, n * d), f32)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    linear = tiled_linear if batch_invariant_enabled() else F.linear
    pre = torch.sigmoid(linear(flat, cast(fn, f32)) * cast(scale, f32) + cast(base, f32)) + hc_eps
    return cast((pre.unsqueeze(-1) * streams).sum(dim=1), streams.dtype)


def _post_pre(
    ops: Any,
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
    """``hc_post_pre`` as its sequence over ``ops`` (a resolved table, or the references)."""
    if block_out is not None:
        streams = ops.hc_post(block_out, streams, post, comb)
    post, comb, x = ops.hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return streams, post, comb, ops.rms_norm(x, norm_weight, norm_eps)


_REFERENCES = SimpleNamespace(hc_post=hc_post, hc_pre=hc_pre, hc_head=hc_head, rms_norm=rms_norm)


def _hc_post_pre_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    n, d, t = 4, 16, 5
    pre_args = (
        randn(g, (2 + n) * n, n * d, scale=0.1),
        randn(g, (2 + n) * n),
        1 + randn(g, 3, scale=0.1),
        1e-6,
        1e-6,
        20,
        1 + randn(g, d, scale=0.1),
    )
    streams = randn(g, t, n, d, dtype=dtype)
    block_out = randn(g, t, d, dtype=dtype)
    post, comb = randn(g, t, n).sigmoid() * 2, randn(g, t, n, n).softmax(-1)
    return [
        ((block_out, streams, post, comb, *pre_args), {}),
        ((None, streams, None, None, *pre_args), {}),  # the first block: no block before it
    ]


@define_op(
    "hc_post_pre",
    "mhc",
    batch_invariant=True,
    sample_cases=_hc_post_pre_cases,
    decomposition=_post_pre,
)
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
    """One block's output into the streams, then the next block's mixing weights and normed input.

    Exactly :func:`hc_post` (skipped when ``block_out`` is ``None``: the first block), then
    :func:`hc_pre` on the streams that gives, then ``rms_norm`` of its collapsed input with
    ``norm_weight`` and ``norm_eps``; a backend may fuse the sequence (the op's decomposition
    runs it over a table's own ops where the backend does not).

    Args:
        block_out, streams, post, comb: :func:`hc_post`'s arguments (``post`` / ``comb`` the
            previous block's); ``streams`` alone when ``block_out`` is ``None``.
        fn, base, scale, norm_eps, hc_eps, sinkhorn_iters: :func:`hc_pre`'s (the next block's).
        norm_weight: ``[D]`` float32 weight of the next block's input norm, or ``None``.

    Returns:
        ``(streams [T, N, D], post [T, N] fp32, comb [T, N, N] fp32, x [T, D])``: the updated
        streams (the input ``streams`` itself when ``block_out`` is ``None``), the next block's
        ``post`` and ``comb``, and its normed input in ``streams.dtype``.
    """
    return _post_pre(
        _REFERENCES,
        block_out,
        streams,
        post,
        comb,
        fn,
        base,
        scale,
        norm_eps,
        hc_eps,
        sinkhorn_iters,
        norm_weight,
    )


def _head_norm(
    ops: Any,
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    norm_weight: torch.Tensor | None,
) -> torch.Tensor:
    """``hc_head_norm`` as its sequence over ``ops`` (a resolved table, or the references)."""
    return ops.rms_norm(ops.hc_head(streams, fn, base, scale, norm_eps, hc_eps), norm_weight, norm_eps)


def _hc_head_norm_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    (args, _), d = _hc_head_cases(g, dtype)[0], 16
    return [((*args, 1 + randn(g, d, scale=0.1)), {}), ((*args, None), {})]


@define_op(
    "hc_head_norm",
    "mhc",
    batch_invariant=True,
    sample_cases=_hc_head_norm_cases,
    decomposition=_head_norm,
)
def hc_head_norm(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    norm_weight: torch.Tensor | None,
) -> torch.Tensor:
    """The streams' final collapse and the model's last norm.

    Exactly :func:`hc_head`, then ``rms_norm`` of its result with ``norm_weight`` and
    ``norm_eps``; a backend may fuse the two (the decomposition runs them over a table's ops
    where the backend does not).

    Args:
        streams, fn, base, scale, norm_eps, hc_eps: :func:`hc_head`'s.
        norm_weight: ``[D]`` float32 weight of the final norm, or ``None``.

    Returns:
        ``[T, D]`` in ``streams.dtype``.
    """
    return _head_norm(_REFERENCES, streams, fn, base, scale, norm_eps, hc_eps, norm_weight)
