"""``sparse_attention`` decode in TileLang: FlashMLA's schedule on SM90 (contract:
``deepinfer_core.ops.attention``).

One CTA takes one query token and 64 of its heads (``BH``), two consumer warpgroups: the
``[64, D]`` queries stay in shared memory; each block of ``BN = 64`` keys is gathered row by
row (``cp.async``, two stages: the next block's rows load while this one computes), the
logits ``[64, 64]`` come from one wgmma GEMM (the warpgroups split the key columns), the
online softmax runs in fp32 with base-2 exponentials, and the probabilities (cast to the
queries' dtype, as FlashMLA does) multiply the same shared key tile into a ``[64, D]`` fp32
accumulator that the two warpgroups split along the value dimension.

Sources are read in order, each with its own loop: source 0 and 1 are explicit row lists
(the window ring and this step's rows), source 2 is an explicit list (CSA's top-k picks), a
:class:`~deepinfer_core.ops.attention.PagedIndex` resolved through the block table inside the
kernel (HCA's entries), or absent (sliding-window layers).  A ``-1`` row is masked (its logit
is ``-inf``); the softmax starts from the head's sink (``m = sink``, ``l = 1``).

Split-KV: with few queries (fewer CTAs than SMs) and long key lists the keys of each source
are split over ``S`` CTAs per (token, head block); each writes its fp32 partial
``(acc, m, l)`` (only split 0 starts from the sink) and a combine kernel merges the splits.
``S`` depends on static shapes only (:func:`plan_splits`), so a call is CUDA-graph
capturable; kernels are compiled once per static configuration (TileLang's disk cache keeps
them between processes) and take any number of tokens, pool rows and list widths.

Reduction order: blocks of 64 keys per source, sources in order, splits merged in order:
deterministic for a given split count, but it depends on how the window is split between
the ring and this step's rows, so batch-invariant mode keeps the Triton kernel
(:mod:`deepinfer_cuda_sm100.kernels.attention`), whose key chunks do not.
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as
# objects (shapes built from closure variables).
import functools
from collections.abc import Sequence

import torch

from deepinfer_core.ops.attention import PagedIndex

LOG2E = 1.4426950408889634
BH = 64
"""Heads per CTA: one wgmma M tile (FlashMLA's ``h64``)."""
BN = 64
"""Keys per block."""
THREADS = 256
"""Two consumer warpgroups."""
MIN_SPLIT_BLOCKS = 4
"""Fewest key blocks a split gets (below that the partials' traffic dominates)."""

_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def build_attention(third: str | None, split: bool, heads: int, dim: int, dtype: str):
    """The TileLang ``prim_func`` for one static configuration.

    Args:
        third: ``"rows"``, ``"paged"`` or ``None``: the kind of source 2.
        split: write fp32 partials for :func:`build_combine` instead of the output.
        heads: ``H`` (a multiple of :data:`BH`); dim: ``D`` (a multiple of 64, at most 512).
        dtype: ``"bfloat16"`` or ``"float16"`` (queries, pools, output).
    """
    import tilelang.language as T

    acc_t = "float32"
    H, D = heads, dim
    n_tok, n_split = T.dynamic("T"), T.dynamic("S")
    t_out, t_part = T.dynamic("TO"), T.dynamic("TP")
    n0, n1, n2 = T.dynamic("N0"), T.dynamic("N1"), T.dynamic("N2")
    k0, k1, k2 = T.dynamic("K0"), T.dynamic("K1"), T.dynamic("K2")
    st0, st1 = T.dynamic("st0"), T.dynamic("st1")
    t2, t3, r_bt, p_bt = T.dynamic("T2"), T.dynamic("T3"), T.dynamic("R"), T.dynamic("P")
    order, stage = list(range(14)), [0, 0] + [1] * 12  # row ids + gather: stage 0; math: stage 1

    @T.macro
    def attend_block(q_s, k_s, p_s, rows, acc_o, acc_s, m, m_prev, l, l_i, alpha, scale2):
        for h, i in T.Parallel(BH, BN):
            acc_s[h, i] = T.if_then_else(rows[i] >= 0, 0, -T.infinity(acc_t))
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        T.copy(m, m_prev)
        for h, i in T.Parallel(BH, BN):
            acc_s[h, i] = acc_s[h, i] * scale2
        T.reduce_max(acc_s, m, dim=1, clear=False)
        for h in T.Parallel(BH):
            alpha[h] = T.exp2(m_prev[h] - m[h])
        for h, i in T.Parallel(BH, BN):
            acc_s[h, i] = T.exp2(acc_s[h, i] - m[h])
        T.reduce_sum(acc_s, l_i, dim=1)
        for h in T.Parallel(BH):
            l[h] = l[h] * alpha[h] + l_i[h]
        for h, d in T.Parallel(BH, D):
            acc_o[h, d] = acc_o[h, d] * alpha[h]
        T.copy(acc_s, p_s)
        T.gemm(p_s, k_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

    @T.macro
    def attend_rows(
        pool, idx, k, t, s, n_split, q_s, k_s, p_s, rows, acc_o, acc_s, m, m_prev, l, l_i, alpha, scale2
    ):
        """One explicit source: its ``k`` listed rows, this split's share of their blocks."""
        nb = T.ceildiv(k, BN)
        lo = T.min(s * T.ceildiv(nb, n_split), nb)
        hi = T.min(lo + T.ceildiv(nb, n_split), nb)
        for b in T.Pipelined(hi - lo, order=order, stage=stage):
            for i in T.Parallel(BN):
                c = (lo + b) * BN + i
                rows[i] = T.if_then_else(c < k, idx[t, T.min(c, k - 1)], -1)
            for i, d in T.Parallel(BN, D):
                k_s[i, d] = pool[T.max(rows[i], 0), d]
            attend_block(q_s, k_s, p_s, rows, acc_o, acc_s, m, m_prev, l, l_i, alpha, scale2)

    @T.prim_func
    def sparse_attention_decode(
        q: T.Tensor((n_tok, H, D), dtype),
        pool0: T.StridedTensor((n0, D), (st0, 1), dtype),
        idx0: T.Tensor((n_tok, k0), "int32"),
        pool1: T.StridedTensor((n1, D), (st1, 1), dtype),
        idx1: T.Tensor((n_tok, k1), "int32"),
        pool2: T.Tensor((n2, D), dtype),
        idx2: T.Tensor((t3, k2), "int32"),
        block_table: T.Tensor((r_bt, p_bt), "int32"),
        token_rows: T.Tensor((t2,), "int32"),
        counts: T.Tensor((t2,), "int32"),
        sinks: T.Tensor((H,), "float32"),
        out: T.Tensor((t_out, H, D), dtype),
        part: T.Tensor((t_part, n_split, H, D), "float32"),
        ml: T.Tensor((t_part, n_split, H, 2), "float32"),
        scale2: T.float32,
        epp: T.int32,
        max_count: T.int32,
    ):
        with T.Kernel(n_tok, n_split, H // BH, threads=THREADS) as (t, s, hb):
            T.assume(st0 % 8 == 0)  # whole 16-byte rows: the gathers vectorise (the wrapper checks)
            T.assume(st1 % 8 == 0)
            q_s = T.alloc_shared((BH, D), dtype)
            k_s = T.alloc_shared((BN, D), dtype)
            p_s = T.alloc_shared((BH, BN), dtype)
            rows = T.alloc_shared((BN,), "int32")
            acc_o = T.alloc_fragment((BH, D), acc_t)
            acc_s = T.alloc_fragment((BH, BN), acc_t)
            m = T.alloc_fragment((BH,), acc_t)
            m_prev = T.alloc_fragment((BH,), acc_t)
            l = T.alloc_fragment((BH,), acc_t)
            l_i = T.alloc_fragment((BH,), acc_t)
            alpha = T.alloc_fragment((BH,), acc_t)
            state = (
                q_s,
                k_s,
                p_s,
                rows,
                acc_o,
                acc_s,
                m,
                m_prev,
                l,
                l_i,
                alpha,
                scale2,
            )  # what each source's loop updates
            T.copy(q[t, hb * BH, 0], q_s)
            T.fill(acc_o, 0)
            for h in T.Parallel(BH):  # split 0 starts from the sink, the others from nothing
                m[h] = T.if_then_else(s == 0, sinks[hb * BH + h] * LOG2E, -1e30)
                l[h] = T.if_then_else(s == 0, 1.0, 0.0)
            attend_rows(pool0, idx0, k0, t, s, n_split, *state)
            attend_rows(pool1, idx1, k1, t, s, n_split, *state)
            if third == "rows":
                attend_rows(pool2, idx2, k2, t, s, n_split, *state)
            if third == "paged":
                cnt = T.min(counts[t], max_count)
                nb2 = T.ceildiv(cnt, BN)
                lo2 = T.min(s * T.ceildiv(nb2, n_split), nb2)
                hi2 = T.min(lo2 + T.ceildiv(nb2, n_split), nb2)
                # at least one (then fully masked) block: a trip count that may be zero would
                # leave the pipeline's barriers inside a data-dependent branch
                for b in T.Pipelined(T.max(hi2 - lo2, 1), order=order, stage=stage):
                    for i in T.Parallel(BN):
                        e = (lo2 + b) * BN + i
                        page = block_table[token_rows[t], T.min(e // epp, p_bt - 1)]
                        rows[i] = T.if_then_else(e < cnt, page * epp + e % epp, -1)
                    for i, d in T.Parallel(BN, D):
                        k_s[i, d] = pool2[T.max(rows[i], 0), d]
                    attend_block(q_s, k_s, p_s, rows, acc_o, acc_s, m, m_prev, l, l_i, alpha, scale2)
            if split:
                for h, d in T.Parallel(BH, D):
                    part[t, s, hb * BH + h, d] = acc_o[h, d]
                for h in T.Parallel(BH):
                    ml[t, s, hb * BH + h, 0] = m[h]
                    ml[t, s, hb * BH + h, 1] = l[h]
            else:
                for h, d in T.Parallel(BH, D):
                    out[t, hb * BH + h, d] = acc_o[h, d] / l[h]

    return sparse_attention_decode


def build_combine(heads: int, dim: int, dtype: str):
    """The ``prim_func`` merging ``S`` split partials per (token, head), splits in order."""
    import tilelang.language as T

    H, D = heads, dim
    n_tok, n_split = T.dynamic("T"), T.dynamic("S")

    @T.prim_func
    def sparse_attention_combine(
        part: T.Tensor((n_tok, n_split, H, D), "float32"),
        ml: T.Tensor((n_tok, n_split, H, 2), "float32"),
        out: T.Tensor((n_tok, H, D), dtype),
    ):
        with T.Kernel(n_tok, H, threads=128) as (t, h):
            acc = T.alloc_fragment((D,), "float32")
            mx = T.alloc_var("float32")
            den = T.alloc_var("float32")
            mx = -1e30
            for s in T.serial(n_split):
                mx = T.max(mx, ml[t, s, h, 0])
            den = 0.0
            T.fill(acc, 0)
            for s in T.serial(n_split):
                w = T.exp2(ml[t, s, h, 0] - mx)
                den = den + ml[t, s, h, 1] * w
                for d in T.Parallel(D):
                    acc[d] = acc[d] + part[t, s, h, d] * w
            for d in T.Parallel(D):
                out[t, h, d] = acc[d] / den

    return sparse_attention_combine


@functools.cache
def _kernel(kind: str, third: str | None, split: bool, heads: int, dim: int, dtype: str):
    """A compiled kernel (TileLang keeps compiled kernels in its disk cache)."""
    import tilelang

    if kind == "combine":
        func = build_combine(heads, dim, dtype)
    else:
        func = build_attention(third, split, heads, dim, dtype)
    return tilelang.compile(func, out_idx=None, target="cuda")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(tokens: int, heads: int, max_keys: int, sms: int) -> int:
    """Splits per (token, head block): enough CTAs to cover the SMs, each with at least
    :data:`MIN_SPLIT_BLOCKS` blocks of keys.  Static shapes only."""
    ctas = tokens * (heads // BH)
    if ctas >= sms:
        return 1
    by_sms = -(-sms // ctas)
    by_keys = max(1, max_keys // (BN * MIN_SPLIT_BLOCKS))
    return max(1, min(by_sms, by_keys))


def third_kind(indices: Sequence[torch.Tensor | PagedIndex]) -> str | None:
    """The kind of the third source of a call: ``"rows"``, ``"paged"`` or ``None``."""
    if len(indices) < 3:
        return None
    return "paged" if isinstance(indices[2], PagedIndex) else "rows"


def max_keys(indices: Sequence[torch.Tensor | PagedIndex]) -> int:
    """The widest key list of a call (static: list widths and ``max_count``)."""
    return sum(i.max_count if isinstance(i, PagedIndex) else i.shape[1] for i in indices)


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int32 and x.is_contiguous() else x.to(torch.int32).contiguous()


def sparse_attention(q, kv_pools, indices, sinks, scale) -> torch.Tensor:
    """The op (see the module docstring; ``supports`` in :mod:`deepinfer_cuda_sm100.tl_ops`
    says which calls it takes)."""
    t, h, d = q.shape
    dtype = _TL_DTYPES[q.dtype]
    third = third_kind(indices)
    dev = q.device
    s = plan_splits(t, h, max_keys(indices), num_sms(dev))
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    pool2 = kv_pools[2] if third else kv_pools[1]
    idx2 = _int32(indices[2]) if third == "rows" else one.view(1, 1)
    if third == "paged":
        pi: PagedIndex = indices[2]
        bt, rows, counts = _int32(pi.block_table), _int32(pi.token_rows), _int32(pi.counts)
        epp, max_count = pi.entries_per_page, pi.max_count
    else:
        bt, rows, counts, epp, max_count = one.view(1, 1), one, one, 1, 0
    if third == "rows":
        rows = counts = torch.zeros(t, dtype=torch.int32, device=dev)  # t2 = T
    sinks = sinks.float().contiguous()
    scale2 = float(scale) * LOG2E
    if s == 1:
        out = torch.empty_like(q)
        part = torch.empty(1, 1, h, d, dtype=torch.float32, device=dev)
        ml = torch.empty(1, 1, h, 2, dtype=torch.float32, device=dev)
    else:
        out = torch.empty(1, h, d, dtype=q.dtype, device=dev)
        part = torch.empty(t, s, h, d, dtype=torch.float32, device=dev)
        ml = torch.empty(t, s, h, 2, dtype=torch.float32, device=dev)
    kernel = _kernel("attention", third, s > 1, h, d, dtype)
    kernel(
        q.contiguous(),
        kv_pools[0],
        _int32(indices[0]),
        kv_pools[1],
        _int32(indices[1]),
        pool2,
        idx2,
        bt,
        rows,
        counts,
        sinks,
        out,
        part,
        ml,
        scale2,
        epp,
        max_count,
    )
    if s == 1:
        return out
    out = torch.empty_like(q)
    _kernel("combine", None, False, h, d, dtype)(part, ml, out)
    return out
