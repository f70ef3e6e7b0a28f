"""mHC ops ``hc_pre``, ``hc_post`` and ``hc_head`` (contract: ``deepinfer_core.ops.mhc``).

``hc_pre`` and ``hc_head`` run as two kernels:

1. :func:`_hc_mix_kernel`, the projection of the flattened streams ``x [T, K=N*D]`` on
   ``fn [M, K]`` as a split-K GEMM: program ``(BLOCK_T tokens, split)`` multiplies its
   ``[BLOCK_T, BLOCK_K]`` slice of ``x`` by ``fn``'s ``[BLOCK_K, M]`` slice and sums the
   squares of ``x``; it writes both to a workspace ``[T, SPLITS, BLOCK_M]`` (the sum of
   squares in column ``M``).  The unweighted RMS norm of the reference is a per-token
   factor, so it is applied after the projection: ``mix = (x @ fn.T) * rsqrt(mean(x²) + eps)``.
   Many small splits keep every SM busy at decode sizes.  The product runs on tensor cores
   as 3xTF32 (each fp32 operand split into a TF32 high part and a TF32 remainder, the three
   significant cross products accumulated in fp32): its error is of the order of fp32
   rounding (bf16 streams are exact in TF32, so only ``fn``'s split matters), measured
   ~1e-6 on V4-Flash shapes, as for an fp32 FMA loop, and about 4x faster than one.
   Triton's CPU interpreter has no TF32 (its ``tl.dot`` is a BLAS GEMM whose rounding
   depends on where a row sits in the tile), so there the product is an fp32 elementwise
   multiply-and-sum.
2. :func:`_hc_finish_kernel`, one program per ``(BLOCK_TOK tokens, BLOCK_D channels)``: it sums
   the partials over the splits (a fixed tree), applies the norm factor, computes each token's
   ``pre`` weights and collapses its channels, ``sum_n pre_n * streams_n``.  For ``hc_pre`` one
   more program per token block (the last along the channel axis) computes ``post`` and the
   Sinkhorn-normalised ``comb`` from the same sums and stores them: the collapse does not need
   them, so its programs do not wait for the 20 dependent Sinkhorn iterations.  Every load that
   does not depend on the partials (scales, biases, the norm weight, the streams' channels) is
   issued before the weights' arithmetic, so its latency overlaps the partials'.

The number of splits and every block size depend on ``N`` and ``D`` only, never on ``T``,
and every token goes through the same instructions: a token's result is the same whatever
the batch.  ``hc_post`` is one elementwise kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED, cast_to, cdiv, pow2, round_through
from .norm import MAX_BLOCK_D, rms_factor
from .pdl import pdl_args, pdl_enter

USE_DOT = tl.constexpr(not INTERPRETED)

BLOCK_T = 64
"""Tokens per projection program (they share its load of ``fn``)."""
BLOCK_K = 128
"""Channels of the flattened streams per projection program (one split)."""
SPLIT_TILE = 128
"""Splits the finishing kernel sums per step (more are summed in a fixed sequence of tiles)."""
BLOCK_D = 1024
"""Channels per collapse / ``hc_post`` program."""
MIX_WARPS, FINISH_WARPS, POST_WARPS = 4, 4, 4
"""Warps per program of each kernel."""
MAX_NORM_D = MAX_BLOCK_D
"""Widest row the finishing kernel also norms (one program holds it, as ``rms_norm``'s one tile)."""
BLOCK_TOK = 16 if INTERPRETED else 1
"""Tokens per collapse / ``hc_post`` program: one on the GPU (the most programs at decode
sizes); more in the interpreter, whose cost is per program and per operation."""


@triton.jit
def _hc_mix_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    T,
    K,
    M,
    stride_xt,
    stride_fm,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    split = tl.program_id(1)
    k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = k < K
    x_ptrs = x_ptr + rows[:, None] * stride_xt + k[None, :]
    x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    w = fn_slice(fn_ptr, k, k_mask, M, stride_fm, BLOCK_M)
    project_slice(x, w, part_ptr, rows, row_mask, split, M, SPLITS, BLOCK_M)


@triton.jit
def fn_slice(fn_ptr, k, k_mask, M, stride_fm, BLOCK_M: tl.constexpr):
    """``fn.T``'s rows ``k``: the ``[BLOCK_K, BLOCK_M]`` fp32 slice a split multiplies (columns
    ``M`` and up zero).  A weight: a kernel may load it before anything it computes."""
    ms = tl.arange(0, BLOCK_M)
    w_ptrs = fn_ptr + ms[None, :] * stride_fm + k[:, None]
    return tl.load(w_ptrs, mask=k_mask[:, None] & (ms < M)[None, :], other=0.0).to(tl.float32)


@triton.jit
def project_slice(x, w, part_ptr, rows, row_mask, split, M, SPLITS, BLOCK_M: tl.constexpr):
    """The partials of one split: ``x [BLOCK_T, BLOCK_K]`` (fp32; columns ``k`` of the flat
    streams) times ``w`` (:func:`fn_slice` of those columns), and ``x``'s sum of squares in
    column ``M``, stored at ``part[rows, split]``."""
    ms = tl.arange(0, BLOCK_M)
    if USE_DOT:
        part = tl.dot(x, w, input_precision="tf32x3")
    else:  # the interpreter's dot is a BLAS GEMM, whose rounding depends on a row's position
        part = tl.sum(x[:, :, None] * w[None, :, :], axis=1)
    part = tl.where(ms[None, :] == M, tl.sum(x * x, axis=1)[:, None], part)
    tl.store(
        part_ptr + (rows[:, None] * SPLITS + split) * BLOCK_M + ms[None, :], part, mask=row_mask[:, None]
    )


@triton.jit
def _sigmoid(x):
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))


@triton.jit
def _pick(values, index, BLOCK_M: tl.constexpr):
    """``values[:, index]`` for ``values [B, BLOCK_M]`` and ``index [I]`` (exact: a sum with zeros)."""
    ms = tl.arange(0, BLOCK_M)
    hit = ms[None, None, :] == index[None, :, None]
    return tl.sum(tl.where(hit, values[:, None, :], 0.0), axis=2)


@triton.jit
def _pick_t(values, index, BLOCK_M: tl.constexpr):
    """:func:`_pick` with the mixing rows on the middle axis: the warps then split that axis,
    which the sum removes, so every warp holds all of the ``I`` picked values (Triton's layout
    of ``[B, I, BLOCK_M]`` puts them on ``I``).  Reductions over reshapes of the result stay
    within a warp: the Sinkhorn iterations on the ``N x N`` weights run without a block
    barrier."""
    ms = tl.arange(0, BLOCK_M)
    hit = ms[None, :, None] == index[None, None, :]
    return tl.sum(tl.where(hit, values[:, :, None], 0.0), axis=1)


@triton.jit
def _hc_finish_kernel(
    part_ptr,
    x_ptr,
    base_ptr,
    scale_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    norm_w_ptr,
    T,
    K_FLOAT,
    D,
    stride_xt,
    norm_eps,
    hc_eps,
    FULL: tl.constexpr,
    NORM: tl.constexpr,
    NORM_WEIGHT: tl.constexpr,
    FACTOR_IN_X_DTYPE: tl.constexpr,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    M: tl.constexpr,
    NP: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_TOK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    toks = tl.program_id(0).to(tl.int64) * BLOCK_TOK + tl.arange(0, BLOCK_TOK)
    t_mask = toks < T
    pid_d = tl.program_id(1)
    ms = tl.arange(0, BLOCK_M)

    # what does not depend on the partials is loaded first, so that its latency overlaps theirs:
    # the mixing rows' scales and biases, the norm weight, then (once the partials' registers
    # are free) this program's channels of the N streams; the weights' own program (channels
    # past D, see below) loads no channels
    m_mask = ms < M
    group = tl.where(ms < N, 0, tl.where(ms < 2 * N, 1, 2))
    scale = tl.load(scale_ptr + group, mask=m_mask, other=0.0)
    base = tl.load(base_ptr + ms, mask=m_mask, other=0.0)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    td_mask = t_mask[:, None] & (d < D)[None, :]
    x_rows = x_ptr + toks[:, None] * stride_xt + d[None, :]
    if NORM_WEIGHT:
        w = tl.load(norm_w_ptr + d, mask=d < D, other=0.0).to(tl.float32)

    # the projection and sum of squares of each token: its partials summed over the splits
    ss = tl.arange(0, SPLIT_TILE)
    mix = tl.zeros([BLOCK_TOK, BLOCK_M], dtype=tl.float32)
    for s0 in tl.static_range(0, SPLITS, SPLIT_TILE):
        s = s0 + ss
        ptrs = part_ptr + (toks[:, None, None] * SPLITS + s[None, :, None]) * BLOCK_M + ms[None, None, :]
        mask = t_mask[:, None, None] & (s < SPLITS)[None, :, None]
        mix += tl.sum(tl.load(ptrs, mask=mask, other=0.0), axis=1)
    xs = ()  # the streams' channels, loaded once the partials' registers are free
    for n in tl.static_range(N):
        xs = xs + (tl.load(x_rows + n * D, mask=td_mask, other=0.0),)
    sum_sq = tl.sum(tl.where(ms[None, :] == M, mix, 0.0), axis=1)
    mean = tl.math.div_rn(sum_sq, tl.zeros_like(sum_sq) + K_FLOAT)
    r = tl.math.div_rn(tl.full(mean.shape, 1.0, tl.float32), tl.sqrt_rn(mean + norm_eps))

    # pre-activations base + mix*scale: pre = [0, N), post = [N, 2N), comb = [2N, M)
    act = base[None, :] + (mix * r[:, None]) * scale[None, :]  # [BLOCK_TOK, BLOCK_M]

    i = tl.arange(0, NP)
    if FULL and pid_d == tl.num_programs(1) - 1:
        # the weights' own program (the last of the token's): post and the Sinkhorn-normalised
        # comb, which the collapse does not need, so its programs do not wait for the iterations
        ti_mask = t_mask[:, None] & (i < N)[None, :]
        post = _pick(_sigmoid(act), N + i, BLOCK_M)
        tl.store(post_ptr + toks[:, None] * N + i[None, :], post + post, mask=ti_mask)

        # comb [tok, i, j]: softmax over j, + eps, then Sinkhorn: columns, then (rows, columns) x (iters-1)
        f = tl.arange(0, NP * NP)
        flat = _pick_t(act, 2 * N + (f // NP) * N + f % NP, BLOCK_M)  # [BLOCK_TOK, NP*NP]
        j = tl.arange(0, NP)
        ij_mask = ((i < N)[:, None] & (j < N)[None, :])[None, :, :]
        logits = tl.where(ij_mask, tl.reshape(flat, [BLOCK_TOK, NP, NP]), -1.0e30)
        e = tl.where(ij_mask, tl.exp(logits - tl.max(logits, axis=2)[:, :, None]), 0.0)
        row_sum = tl.where((i < N)[None, :], tl.sum(e, axis=2), 1.0)
        c = tl.where(ij_mask, tl.math.div_rn(e, row_sum[:, :, None]) + hc_eps, 0.0)
        c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + hc_eps)
        for _ in range(1, ITERS):
            c = tl.math.div_rn(c, tl.sum(c, axis=2)[:, :, None] + hc_eps)
            c = tl.math.div_rn(c, tl.sum(c, axis=1)[:, None, :] + hc_eps)
        comb_ptrs = comb_ptr + toks[:, None, None] * N * N + (i[:, None] * N + j[None, :])[None, :, :]
        tl.store(comb_ptrs, c, mask=t_mask[:, None, None] & ij_mask)
    else:
        pre = _pick(_sigmoid(act), i, BLOCK_M) + hc_eps  # [BLOCK_TOK, NP]; entries i >= N unused
        # collapse: sum_n pre_n * streams_n over this program's channels
        acc = tl.zeros([BLOCK_TOK, BLOCK_D], dtype=tl.float32)
        for n in tl.static_range(N):
            pre_n = tl.sum(tl.where(i[None, :] == n, pre, 0.0), axis=1)[:, None]
            acc += pre_n * xs[n].to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        if NORM:  # the block's input norm of the collapsed row (whole in this program): rms_norm's math
            acc = round_through(acc, dtype)  # the collapsed input as hc_pre returns it
            factor = rms_factor(tl.sum(acc * acc, axis=1), D, norm_eps, dtype, FACTOR_IN_X_DTYPE)
            acc = acc * factor[:, None]
            if NORM_WEIGHT:
                acc = acc * w[None, :]
        out_ptrs = out_ptr + toks[:, None] * D + d[None, :]
        tl.store(out_ptrs, cast_to(acc, dtype), mask=td_mask)


@triton.jit
def _hc_post_kernel(
    bo_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    T,
    D,
    stride_bt,
    stride_xt,
    stride_xn,
    stride_pt,
    stride_pn,
    stride_ct,
    stride_cj,
    stride_cn,
    N: tl.constexpr,
    NP: tl.constexpr,
    BLOCK_TOK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    toks = tl.program_id(0).to(tl.int64) * BLOCK_TOK + tl.arange(0, BLOCK_TOK)
    t_mask = toks < T
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    td_mask = t_mask[:, None] & (d < D)[None, :]  # [BLOCK_TOK, BLOCK_D]
    n = tl.arange(0, NP)
    tn_mask = t_mask[:, None] & (n < N)[None, :]  # [BLOCK_TOK, NP]
    dtype = out_ptr.dtype.element_ty
    # the reference mixes in streams.dtype: comb and post are cast to it, the mix is rounded
    post = tl.load(post_ptr + toks[:, None] * stride_pt + n[None, :] * stride_pn, mask=tn_mask, other=0.0)
    post = round_through(post.to(tl.float32), dtype)
    block_out = tl.load(bo_ptr + toks[:, None] * stride_bt + d[None, :], mask=td_mask, other=0.0)
    mixed = tl.zeros([BLOCK_TOK, NP, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(N):  # mixed[n] = sum_j comb[j, n] * streams_j
        c_ptrs = comb_ptr + toks[:, None] * stride_ct + j * stride_cj + n[None, :] * stride_cn
        c = round_through(tl.load(c_ptrs, mask=tn_mask, other=0.0).to(tl.float32), dtype)
        s_ptrs = x_ptr + toks[:, None] * stride_xt + j * stride_xn + d[None, :]
        s = tl.load(s_ptrs, mask=td_mask, other=0.0).to(tl.float32)
        mixed += c[:, :, None] * s[:, None, :]
    out = round_through(mixed, dtype) + post[:, :, None] * block_out.to(tl.float32)[:, None, :]
    out_ptrs = out_ptr + (toks[:, None, None] * N + n[None, :, None]) * D + d[None, None, :]
    tl.store(out_ptrs, cast_to(out, dtype), mask=tn_mask[:, :, None] & td_mask[:, None, :])


def flat_streams(streams: torch.Tensor) -> torch.Tensor:
    """``streams [T, N, D]`` as ``[T, N*D]`` with unit channel stride (a view when possible)."""
    t, n, d = streams.shape
    flat = streams.reshape(t, n * d)
    return flat if flat.stride(-1) == 1 or n * d <= 1 else flat.contiguous()


def unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def mix_and_finish(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
    full: bool,
    norm: bool = False,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mix` then :func:`finish` over ``streams [T, N, D]``: ``(post, comb, collapsed)``
    (``post`` / ``comb`` written when ``full``; the collapsed rows normed with ``norm``)."""
    t, n, d = streams.shape
    post, comb, out = empty_outputs(streams)
    if t == 0 or d == 0:
        return post, comb, out
    x = flat_streams(streams)
    part = mix(x, fn, n)
    finish(part, x, base, scale, post, comb, out, norm_eps, hc_eps, iters, full, norm, norm_weight)
    return post, comb, out


def empty_outputs(streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, D] streams.dtype)``."""
    t, n, d = streams.shape
    dev = streams.device
    post = torch.empty(t, n, dtype=torch.float32, device=dev)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)
    return post, comb, torch.empty(t, d, dtype=streams.dtype, device=dev)


def mix_width(m: int) -> int:
    """The partials' row width for ``m`` mixing rows: ``m`` + the sum-of-squares column, at least
    16 (``tl.dot`` tiles)."""
    return max(16, pow2(m + 1))


def mix(x: torch.Tensor, fn: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`_hc_mix_kernel` over the flat streams ``x [T, N*D]``: the partials ``[T, SPLITS,
    BLOCK_M]`` that :func:`finish` sums."""
    t, k = x.shape
    m = fn.shape[0]
    fn = unit_last(fn)
    splits = cdiv(k, BLOCK_K)
    block_m = mix_width(m)
    part = torch.empty(t, splits, block_m, dtype=torch.float32, device=x.device)
    _hc_mix_kernel[(cdiv(t, BLOCK_T), splits)](
        x,
        fn,
        part,
        t,
        k,
        m,
        x.stride(0),
        fn.stride(0),
        SPLITS=splits,
        BLOCK_T=BLOCK_T,
        BLOCK_K=BLOCK_K,
        BLOCK_M=block_m,
        num_warps=MIX_WARPS,
        **pdl_args(),
    )
    return part


def finish(
    part: torch.Tensor,
    x: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    out: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    iters: int,
    full: bool,
    norm: bool = False,
    norm_weight: torch.Tensor | None = None,
) -> None:
    """:func:`_hc_finish_kernel`: the weights (``post`` / ``comb`` too when ``full``, by a program
    of their own per token block) and the collapsed row into ``out``; with ``norm`` the row is
    then RMS-normed (``norm_weight`` or unweighted, eps ``norm_eps``) as ``rms_norm`` does, in
    the same program, which then takes the whole row (``D <= MAX_NORM_D``; with 4 warps, as
    ``rms_norm`` takes a row of 4096)."""
    t, d = out.shape
    n = post.shape[1]
    m = base.shape[0]
    splits = part.shape[1]
    base, scale = base.contiguous(), scale.contiguous()
    block_d = pow2(d) if norm else min(pow2(d), BLOCK_D)
    if norm_weight is not None:
        norm_weight = norm_weight.contiguous()
    _hc_finish_kernel[(cdiv(t, BLOCK_TOK), cdiv(d, block_d) + int(full))](
        part,
        x,
        base,
        scale,
        post,
        comb,
        out,
        norm_weight if norm_weight is not None else base,
        t,
        float(n * d),
        d,
        x.stride(0),
        float(norm_eps),
        float(hc_eps),
        FULL=full,
        NORM=norm,
        NORM_WEIGHT=norm_weight is not None,
        FACTOR_IN_X_DTYPE=norm_weight is None and out.dtype != torch.float32,
        ITERS=int(iters),
        N=n,
        M=m,
        NP=pow2(n),
        SPLITS=splits,
        SPLIT_TILE=min(pow2(splits), SPLIT_TILE),
        BLOCK_M=part.shape[2],
        BLOCK_TOK=BLOCK_TOK,
        BLOCK_D=block_d,
        num_warps=FINISH_WARPS,  # the partials summed as hc_pre sums them (their tree follows the warps)
        **pdl_args(),
    )


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton ``hc_pre``: same signature, shapes and numerics as the reference.

    ``streams`` ``[T, N, D]`` (fp32, bf16 or fp16), ``fn`` ``[(2+N)*N, N*D]``, ``base``
    ``[(2+N)*N]``, ``scale`` ``[3]``.  Returns contiguous ``(post [T, N] fp32, comb [T, N, N]
    fp32, collapsed [T, D] streams.dtype)``.
    """
    return mix_and_finish(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, full=True)


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    """Triton ``hc_head``: same signature, shapes and numerics as the reference.

    ``streams`` ``[T, N, D]``, ``fn`` ``[N, N*D]``, ``base`` ``[N]``, ``scale`` ``[1]``;
    returns ``[T, D]`` in ``streams.dtype``.
    """
    return mix_and_finish(streams, fn, base, scale, norm_eps, hc_eps, 1, full=False)[2]


def hc_post(
    block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Triton ``hc_post``: same signature, shapes and numerics as the reference.

    ``block_out`` ``[T, D]`` and ``streams`` ``[T, N, D]`` of one dtype (a non-unit channel
    stride is copied first); ``post`` ``[T, N]`` and ``comb`` ``[T, N, N]`` of any float dtype
    and strides (``hc_pre``'s reference returns ``post`` transposed).  Returns a contiguous
    ``[T, N, D]`` tensor in ``streams.dtype``: ``post_n * block_out + sum_j comb[j, n] *
    streams_j``, with ``comb`` / ``post`` cast to and the mix rounded in ``streams.dtype``
    first, as the reference does.
    """
    t, n, d = streams.shape
    out = torch.empty(t, n, d, dtype=streams.dtype, device=streams.device)
    if out.numel() == 0:
        return out
    streams, block_out = unit_last(streams), unit_last(block_out)
    block_d = min(pow2(d), BLOCK_D)
    _hc_post_kernel[(cdiv(t, BLOCK_TOK), cdiv(d, block_d))](
        block_out,
        streams,
        post,
        comb,
        out,
        t,
        d,
        block_out.stride(0),
        streams.stride(0),
        streams.stride(1),
        post.stride(0),
        post.stride(1),
        comb.stride(0),
        comb.stride(1),
        comb.stride(2),
        N=n,
        NP=pow2(n),
        BLOCK_TOK=BLOCK_TOK,
        BLOCK_D=block_d,
        num_warps=POST_WARPS,
        **pdl_args(),
    )
    return out
