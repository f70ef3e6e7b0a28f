"""TileKernels' mHC kernels as ``hc_pre``, ``hc_post`` and V4.1's ``deepseek_v41.hc_collapse``.

- ``hc_pre``: TileKernels leaves the prenorm GEMM to DeepGEMM, so the adapter computes it in
  PyTorch (``flat @ fn.T`` and ``sum(flat**2)`` of the float32 streams, one split) and
  ``mhc_pre_big_fuse_fwd`` does the rest in one kernel: the RMS scale, ``pre = sigmoid(.)+eps``,
  ``post = 2*sigmoid(.)``, ``comb`` = softmax over ``k`` plus eps, columns first, then
  ``sinkhorn_iters - 1`` rounds of rows and columns, each ``x / (sum + eps)`` (the contract's
  Sinkhorn, ``hc_eps`` in both eps), and the collapse ``sum_n pre_n * streams_n`` in float32.
  The RMS scale is applied after the GEMM instead of before it (a different rounding, within
  the op's tolerance), and the cuBLAS GEMM is not batch invariant.
- ``hc_post``: ``mhc_post_fwd``: ``post_n * block_out + sum_j comb[j, n] * streams_j`` in
  float32, one rounding to bfloat16 (our reference rounds twice).
- ``deepseek_v41.hc_collapse``: ``mhc_pre_apply_mix_fwd``: ``sum_n pre_n * streams_n`` in float32.

All three take bfloat16 streams only (TileKernels' kernels are typed so).  ``hc_head`` is left
out: TileKernels has no fused kernel for it (its GEMM, norm, ``mhc_head_compute_mix_fwd`` and
the collapse would be four launches where ours is one, once per forward).
"""

from __future__ import annotations

import torch

from deepinfer_cuda_sm100.tk import Adapter, ChoiceKey, Verdict, device_last, dtype_name, first_problem

MAX_STREAMS = 8
"""Most streams the adapters take (V4 uses 4; the kernels keep a token's mixes in registers)."""


def _streams_checks(streams: torch.Tensor, block: int) -> Verdict:
    ok = first_problem(
        (streams.dim() == 3, f"streams has {streams.dim()} dims, expected [T, N, D]"),
        (streams.dtype == torch.bfloat16, f"streams dtype {streams.dtype}: TileKernels' mHC takes bfloat16"),
    )
    if ok is not True:
        return ok
    _, n, d = streams.shape
    return first_problem(
        (1 <= n <= MAX_STREAMS, f"{n} streams: the adapters take 1..{MAX_STREAMS}"),
        (d % block == 0 and d > 0, f"D={d}: TileKernels' kernel takes multiples of {block}"),
        (streams.is_contiguous(), "streams is not contiguous"),
    )


# ---- hc_pre --------------------------------------------------------------------------------------
def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """``hc_pre`` through ``mhc_pre_big_fuse_fwd`` (see the module docstring)."""
    from tile_kernels.mhc import mhc_pre_big_fuse_fwd

    t, n, d = streams.shape
    f32 = torch.float32
    flat = streams.reshape(t, n * d).to(f32)
    mixes = torch.mm(flat, fn.to(f32).t()).unsqueeze(0)  # [1, T, (2+N)*N]: one split
    sqrsum = flat.square().sum(-1).unsqueeze(0)  # [1, T]
    post = torch.empty(t, n, dtype=f32, device=streams.device)
    comb = torch.empty(t, n * n, dtype=f32, device=streams.device)
    collapsed = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t:
        mhc_pre_big_fuse_fwd(
            mixes,
            sqrsum,
            scale.to(f32).contiguous(),
            base.to(f32).contiguous(),
            streams,
            post,
            comb,
            collapsed,
            float(norm_eps),
            float(hc_eps),
            float(hc_eps),
            2.0,
            int(sinkhorn_iters),
            n_splits=1,
        )
    return post, comb.view(t, n, n), collapsed


@device_last
def hc_pre_supports(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) -> Verdict:
    ok = _streams_checks(streams, 64)
    if ok is not True:
        return ok
    _, n, d = streams.shape
    m = (2 + n) * n
    return first_problem(
        (tuple(fn.shape) == (m, n * d), f"fn has shape {tuple(fn.shape)}, expected {(m, n * d)}"),
        (tuple(base.shape) == (m,), f"base has shape {tuple(base.shape)}, expected {(m,)}"),
        (tuple(scale.shape) == (3,), f"scale has shape {tuple(scale.shape)}, expected (3,)"),
        (
            isinstance(sinkhorn_iters, int) and not isinstance(sinkhorn_iters, bool) and sinkhorn_iters >= 1,
            f"sinkhorn_iters {sinkhorn_iters!r}: the fused kernel takes an int >= 1",
        ),
    )


def _streams_key(streams) -> ChoiceKey:
    t, n, d = streams.shape
    return ChoiceKey("streams", dtype_name(streams.dtype), n, d, t)


# ---- hc_post -------------------------------------------------------------------------------------
def hc_post(block_out, streams, post, comb):
    """``hc_post`` through ``mhc_post_fwd``."""
    from tile_kernels.mhc import mhc_post_fwd

    t, n, d = streams.shape
    f32 = torch.float32
    out = mhc_post_fwd(
        block_out.contiguous().unsqueeze(0),
        streams.unsqueeze(0),
        post.to(f32).contiguous().view(1, t, n, 1),
        comb.to(f32).contiguous().unsqueeze(0),
    )
    return out.view(t, n, d)


@device_last
def hc_post_supports(block_out, streams, post, comb) -> Verdict:
    ok = _streams_checks(streams, 128)
    if ok is not True:
        return ok
    t, n, d = streams.shape
    return first_problem(
        (block_out.dtype == streams.dtype, f"block_out dtype {block_out.dtype} differs from streams'"),
        (
            tuple(block_out.shape) == (t, d),
            f"block_out has shape {tuple(block_out.shape)}, expected {(t, d)}",
        ),
        (tuple(post.shape) == (t, n), f"post has shape {tuple(post.shape)}, expected {(t, n)}"),
        (tuple(comb.shape) == (t, n, n), f"comb has shape {tuple(comb.shape)}, expected {(t, n, n)}"),
    )


def _post_key(block_out, streams, post, comb) -> ChoiceKey:
    return _streams_key(streams)


# ---- deepseek_v41.hc_collapse --------------------------------------------------------------------
def hc_collapse(streams, pre):
    """``deepseek_v41.hc_collapse`` through ``mhc_pre_apply_mix_fwd``."""
    from tile_kernels.mhc import mhc_pre_apply_mix_fwd

    t, _, d = streams.shape
    out = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    if t:
        mhc_pre_apply_mix_fwd(streams, pre.to(torch.float32).contiguous(), out)
    return out


@device_last
def hc_collapse_supports(streams, pre) -> Verdict:
    ok = _streams_checks(streams, 64)
    if ok is not True:
        return ok
    t, n, _ = streams.shape
    return first_problem((tuple(pre.shape) == (t, n), f"pre has shape {tuple(pre.shape)}, expected {(t, n)}"))


ADAPTERS = (
    Adapter(
        "hc_pre",
        hc_pre,
        hc_pre_supports,
        lambda streams, *rest: _streams_key(streams),
        ("torch.mm (prenorm GEMM)", "mhc_pre_big_fuse_fwd"),
        row_independent=False,
    ),
    Adapter("hc_post", hc_post, hc_post_supports, _post_key, ("mhc_post_fwd",), row_independent=True),
    Adapter(
        "deepseek_v41.hc_collapse",
        hc_collapse,
        hc_collapse_supports,
        lambda streams, pre: _streams_key(streams),
        ("mhc_pre_apply_mix_fwd",),
        row_independent=True,
    ),
)
