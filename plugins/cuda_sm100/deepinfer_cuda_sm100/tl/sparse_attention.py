"""``sparse_attention`` decode in TileLang: FlashMLA's schedule on SM90 (contract:
``deepinfer_core.ops.attention``).

One CTA takes one query token and 64 of its heads (``BH``), two consumer warpgroups: the
``[64, D]`` queries stay in shared memory; each block of ``BN = 64`` keys is gathered row by
row (``cp.async``, 16-byte vectors, two stages: the next block's rows load while this one
computes; the row offsets sit in static shared memory, so the gather loop has no barrier
inside), the logits ``[64, 64]`` come from one wgmma GEMM (the warpgroups split the key
columns), the online softmax runs in fp32 with base-2 exponentials (plain pools: each thread
sums its own columns' probabilities and the row sums are reduced once, after the last block,
which saves a cross-warpgroup reduction per block), and the probabilities (cast
to the queries' dtype, as FlashMLA does) multiply the same shared key tile into a ``[64, D]``
fp32 accumulator that the two warpgroups split along the value dimension.

One key sequence per query.  A prologue (the Triton kernel's, :func:`compact_sources`) counts
each source's valid keys and compacts the explicit row lists (``-1`` rows dropped, order kept);
the kernel then walks one sequence: the compacted explicit rows of every source, then, when
the last source is a :class:`~deepinfer_core.ops.attention.PagedIndex`, its entries resolved
through the block table (block table and token rows read in the contract's int64, as the step
plans build them: no conversion launch per call; a call without a paged source never reads them;
an entry's page and slot by a multiply and a shift,
:mod:`~deepinfer_cuda_sm100.tl.page_division`, not an integer division by the entries a page).
Every key of a block is valid except in the sequence's last block, and a query's keys are split
over blocks the same way whichever source holds them. The pools (the queries' dtype, 16-byte
aligned rows) are addressed from the lowest pool's address in 16-byte units
(one flat address space: no per-source branch in a gather).  The softmax starts from the
head's sink (``m = sink``, ``l = 1``); the output is ``acc`` times ``1 / l``, one reciprocal a
row rather than an IEEE division an output (256 a thread, each with a call to its slow path).

Split-KV: with few queries (fewer CTAs than SMs) and long key lists the sequence's blocks are
split over ``S`` CTAs per (token, head block); each writes its fp32 partial ``(acc, m, l)``
(only split 0 starts from the sink) and a combine kernel merges the splits in order.  ``S``
depends on static shapes only (:func:`plan_splits`), so a call is CUDA-graph capturable;
kernels are compiled once per static configuration (kept in TileLang's disk cache).  Where the
Triton kernels use programmatic dependent launch, the attention kernel and the combine start
with the PDL prologue (:mod:`deepinfer_cuda_sm100.tl.pdl`): their launch overlaps the tail of
the kernel before them, and they wait for its writes before any global access.

Reduction order: blocks of 64 keys of the query's sequence, splits merged in order:
deterministic for a given split count.  The split count depends on the step's token count, so
batch-invariant mode keeps the Triton kernel (:mod:`deepinfer_cuda_sm100.kernels.attention`).
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as
# objects (shapes built from closure variables).
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_format import Fp8KVPool

from .compile_log import logged_compile
from .launch_args import TL_DTYPES, index_int64, num_sms
from .page_division import divider, pool_row
from .pdl import prologue, tl_pdl_enabled
from .target import cuda_target

LOG2E = 1.4426950408889634
BH = 64
"""Heads per CTA: one wgmma M tile (FlashMLA's ``h64``)."""
BN = 64
"""Keys per block."""
THREADS = 256
"""Two consumer warpgroups."""
MIN_SPLIT_BLOCKS = 1
"""Fewest key blocks a split gets.  Measured on the H200 (``bench_attention.py --tune``, 768
keys at 1-32 tokens): one block a split is fastest while the CTAs fit in one wave; the
partials (128 KiB a split) cost less than a block's serial latency."""


@dataclass(frozen=True)
class Fp8Geometry:
    """Byte offsets of a packed FP8 row that the kernel reads (:class:`~deepinfer_core.ops.
    kv_format.Fp8RowLayout`): nope values at ``[0, nope)``, bfloat16 rope values at
    ``rope_offset``, one UE8M0 scale byte per 64 nope values at ``scale_offset``."""

    nope: int
    rope_offset: int
    scale_offset: int
    groups: int


def build_attention(
    paged: bool,
    split: bool,
    heads: int,
    dim: int,
    dtype: str,
    fp8: Fp8Geometry | None = None,
    pdl: bool = False,
):
    """The TileLang ``prim_func`` for one static configuration.

    Args:
        paged: whether the sequence ends with a paged source (resolved through the block table).
        split: write fp32 partials for :func:`build_combine` instead of the output.
        heads: ``H`` (a multiple of :data:`BH`); dim: ``D`` (a multiple of 64, at most 512).
        dtype: ``"bfloat16"`` or ``"float16"`` (queries, plain pools, output).
        fp8: ``None``: plain pools of ``dtype``, addressed in 16-byte units; else every pool is
            a packed FP8 pool of this row geometry (:class:`~deepinfer_core.ops.kv_format.
            Fp8KVPool`), addressed in 8-byte units, dequantised into the shared key tile.
        pdl: start with the PDL prologue (:func:`deepinfer_cuda_sm100.tl.pdl.prologue`: wait for
            the kernel before, then let the next one be scheduled), before any global access.
    """
    import tilelang.language as T

    start = prologue()

    acc_t = "float32"
    H, D = heads, dim
    n_tok, n_split = T.dynamic("T"), T.dynamic("S")
    t_out, t_part, ke = T.dynamic("TO"), T.dynamic("TP"), T.dynamic("KE")
    t2, r_bt, p_bt, nf = T.dynamic("T2"), T.dynamic("R"), T.dynamic("P"), T.dynamic("NF")
    # the pipelined loop's statements: row offsets and the gathers in stage 0 (2 plain, 4
    # packed), the dequantisation (4 loops) and the 12 of the softmax block in stage 1
    loads, math = (2, 12) if fp8 is None else (4, 16)
    order, stage = list(range(loads + math)), [0] * loads + [1] * math
    if fp8 is not None:  # the 8-byte words of a packed row holding its scale bytes
        scale_words = -(-(fp8.scale_offset % 8 + fp8.groups) // 8)

    @T.macro
    def key_offsets(off, t, j0, compact, nvalid, block_table, token_rows, bases, strides, pages):
        """``off[i]``: key ``j0 + i`` of query ``t``'s sequence as a row offset in address
        units from the pools' common base, ``-1`` past the sequence's end."""
        n0 = nvalid[t, 0]
        n01 = n0 + nvalid[t, 1]
        total = n01 + nvalid[t, 2]
        n_expl = n01 if paged else total
        # the table's row (int32 index math); a call without a paged source never reads the
        # table or the token rows (the host passes unwritten placeholders)
        page_row = T.Cast("int32", token_rows[T.min(t, t2 - 1)]) if paged else 0
        for i in T.Parallel(BN):
            j = j0 + i
            row = (
                T.if_then_else(
                    j < n_expl,
                    T.Cast("int64", compact[t, T.max(T.min(j, ke - 1), 0)]),
                    pool_row(block_table, page_row, j - n_expl, pages),  # the paged source's entry
                )
                if paged
                else T.Cast("int64", compact[t, T.max(T.min(j, ke - 1), 0)])
            )
            later = T.if_then_else(j < n01, bases[1] + row * strides[1], bases[2] + row * strides[2])
            o = T.if_then_else(j < n0, bases[0] + row * strides[0], later)
            off[i] = T.if_then_else(j < total, o, -1)

    @T.macro
    def attend(q_s, k_s, p_s, off, acc_o, acc_s, m, m_prev, l, l_part, alpha, scale2):
        """The online softmax over one gathered block of keys (masked where ``off < 0``)."""
        for h, i in T.Parallel(BH, BN):
            acc_s[h, i] = T.if_then_else(off[i] >= 0, 0, -T.infinity(acc_t))
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        T.copy(m, m_prev)
        for h, i in T.Parallel(BH, BN):
            acc_s[h, i] = acc_s[h, i] * scale2
        T.reduce_max(acc_s, m, dim=1, clear=False)
        for h in T.Parallel(BH):
            alpha[h] = T.exp2(m_prev[h] - m[h])
        for h, i in T.Parallel(BH, BN):
            acc_s[h, i] = T.exp2(acc_s[h, i] - m[h])
        if fp8 is None:  # the sink's share here, each thread's own columns summed after the loop
            for h in T.Parallel(BH):
                l[h] = l[h] * alpha[h]
            for h, i in T.Parallel(BH, BN):
                l_part[h, i] = l_part[h, i] * alpha[h] + acc_s[h, i]
        else:  # (registers: the packed path keeps the row sum per block)
            T.reduce_sum(acc_s, l_part, dim=1)
            for h in T.Parallel(BH):
                l[h] = l[h] * alpha[h] + l_part[h]
        for h, d in T.Parallel(BH, D):
            acc_o[h, d] = acc_o[h, d] * alpha[h]
        T.copy(acc_s, p_s)
        T.gemm(p_s, k_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

    @T.macro
    def gather_plain(k_s, off, flat, base0):
        for i, d in T.Parallel(BN, D):
            k_s[i, d] = flat[T.if_then_else(off[i] >= 0, off[i], base0) * 8 + d]

    @T.macro
    def gather_fp8(raw8, raw16, scales, off, flat8, flat16, flat64, base0):
        """Stage 0: copy a block of packed rows' nope bytes, rope values and the 8-byte words
        holding the scale bytes into shared memory (8-byte asynchronous copies: packed rows
        are 8-byte aligned, and their length is a multiple of 8 bytes)."""
        nope, rope_offset, s0 = fp8.nope, fp8.rope_offset, fp8.scale_offset // 8
        for i, d in T.Parallel(BN, nope):
            raw8[i, d] = flat8[T.if_then_else(off[i] >= 0, off[i], base0) * 8 + d]
        for i, r in T.Parallel(BN, D - nope):
            raw16[i, r] = flat16[T.if_then_else(off[i] >= 0, off[i], base0) * 4 + rope_offset // 2 + r]
        for i, c in T.Parallel(BN, scale_words):
            scales[i, c] = flat64[T.if_then_else(off[i] >= 0, off[i], base0) + s0 + c]

    @T.macro
    def dequantise(k_s, raw8, raw16, scales, factors, raw_f):
        """Stage 1: ``fp8 * 2**(scale byte - 127)`` for the nope values (the power of two built
        from the byte's bits, as :func:`~deepinfer_core.ops.kv_format.pow2` does; the product
        is exact in fp32, then rounded to the key dtype), the bfloat16 rope values as they are
        (:mod:`deepinfer_core.ops.kv_format`), into the shared key tile.  Loops of one kind
        each, so that they vectorise (8 values a thread at a time).  The packed bytes pass
        through registers (``raw_f``): TileLang puts a barrier in every iteration of a loop
        that reads one dynamic shared buffer and writes another."""
        first = fp8.scale_offset % 8  # the first scale byte within the copied words
        for i, g in T.Parallel(BN, fp8.groups):
            word = scales[i, (first + g) // 8]  # little-endian bytes
            byte = T.Cast("uint32", T.bitwise_and(T.shift_right(word, (first + g) % 8 * 8), 255))
            factors[i, g] = T.reinterpret(acc_t, T.shift_left(byte, T.uint32(23)))
        for i, d in T.Parallel(BN, fp8.nope):
            raw_f[i, d] = raw8[i, d]
        for i, d in T.Parallel(BN, fp8.nope):
            k_s[i, d] = T.Cast(dtype, T.Cast(acc_t, raw_f[i, d]) * factors[i, d // 64])
        for i, r in T.Parallel(BN, D - fp8.nope):
            k_s[i, fp8.nope + r] = T.Cast(dtype, raw16[i, r])

    @T.macro
    def decode(q, sinks, out, part, ml, t, s, hb, pools, sequence, scale2):
        q_s = T.alloc_shared((BH, D), dtype)
        k_s = T.alloc_shared((BN, D), dtype)
        p_s = T.alloc_shared((BH, BN), dtype)
        # static shared memory: no barrier inside the loops that read it and write a tile
        off = T.alloc_shared((BN,), "int64", scope="shared")
        if fp8 is not None:
            raw8 = T.alloc_shared((BN, fp8.nope), "float8_e4m3")
            raw16 = T.alloc_shared((BN, D - fp8.nope), "bfloat16")
            scales = T.alloc_shared((BN, scale_words), "int64")
            factors = T.alloc_shared((BN, fp8.groups), acc_t, scope="shared")
            raw_f = T.alloc_fragment((BN, fp8.nope), "float8_e4m3")
        acc_o = T.alloc_fragment((BH, D), acc_t)
        acc_s = T.alloc_fragment((BH, BN), acc_t)
        m = T.alloc_fragment((BH,), acc_t)
        m_prev = T.alloc_fragment((BH,), acc_t)
        l = T.alloc_fragment((BH,), acc_t)
        l_i = T.alloc_fragment((BH,), acc_t)
        l_part = T.alloc_fragment((BH, BN) if fp8 is None else (BH,), acc_t)
        alpha = T.alloc_fragment((BH,), acc_t)
        T.copy(q[t, hb * BH, 0], q_s)
        T.fill(acc_o, 0)
        T.fill(l_part, 0)
        for h in T.Parallel(BH):  # split 0 starts from the sink, the others from nothing
            m[h] = T.if_then_else(s == 0, sinks[hb * BH + h] * LOG2E, -1e30)
            l[h] = T.if_then_else(s == 0, 1.0, 0.0)
        compact, nvalid, block_table, token_rows, bases, strides, pages = sequence
        index = (compact, nvalid, block_table, token_rows)
        nb = T.ceildiv(nvalid[t, 0] + nvalid[t, 1] + nvalid[t, 2], BN)
        lo = T.min(s * T.ceildiv(nb, n_split), nb)
        hi = T.min(lo + T.ceildiv(nb, n_split), nb)
        # at least one (then fully masked) block: a trip count that may be zero would leave
        # the pipeline's barriers inside a data-dependent branch
        for b in T.Pipelined(T.max(hi - lo, 1), order=order, stage=stage):
            key_offsets(off, t, (lo + b) * BN, *index, bases, strides, pages)
            if fp8 is None:
                gather_plain(k_s, off, pools[0], sequence[4][0])
            else:
                gather_fp8(raw8, raw16, scales, off, pools[0], pools[1], pools[2], sequence[4][0])
                dequantise(k_s, raw8, raw16, scales, factors, raw_f)
            attend(q_s, k_s, p_s, off, acc_o, acc_s, m, m_prev, l, l_part, alpha, scale2)
        if fp8 is None:
            T.reduce_sum(l_part, l_i, dim=1)
            for h in T.Parallel(BH):
                l[h] = l[h] + l_i[h]
        if split:
            for h, d in T.Parallel(BH, D):
                part[t, s, hb * BH + h, d] = acc_o[h, d]
            for h in T.Parallel(BH):
                ml[t, s, hb * BH + h, 0] = m[h]
                ml[t, s, hb * BH + h, 1] = l[h]
        else:
            for h in T.Parallel(BH):  # one reciprocal a row, not an IEEE division an output
                l[h] = 1.0 / l[h]
            for h, d in T.Parallel(BH, D):
                out[t, hb * BH + h, d] = acc_o[h, d] * l[h]

    if fp8 is None:

        @T.prim_func
        def sparse_attention_decode(
            q: T.Tensor((n_tok, H, D), dtype),
            flat: T.Tensor((nf,), dtype),
            compact: T.Tensor((n_tok, ke), "int32"),
            nvalid: T.Tensor((n_tok, 4), "int32"),
            block_table: T.Tensor((r_bt, p_bt), "int64"),
            token_rows: T.Tensor((t2,), "int64"),
            sinks: T.Tensor((H,), "float32"),
            out: T.Tensor((t_out, H, D), dtype),
            part: T.Tensor((t_part, n_split, H, D), "float32"),
            ml: T.Tensor((t_part, n_split, H, 2), "float32"),
            base0: T.int64,
            base1: T.int64,
            base2: T.int64,
            st0: T.int64,
            st1: T.int64,
            st2: T.int64,
            scale2: T.float32,
            epp: T.int32,
            epp_magic: T.int32,
            epp_shift: T.int32,
        ):
            with T.Kernel(n_tok, n_split, H // BH, threads=THREADS) as (t, s, hb):
                if pdl:
                    start()
                sequence = (
                    compact,
                    nvalid,
                    block_table,
                    token_rows,
                    (base0, base1, base2),
                    (st0, st1, st2),
                    (epp, epp_magic, epp_shift),
                )
                decode(q, sinks, out, part, ml, t, s, hb, (flat,), sequence, scale2)

        return sparse_attention_decode

    @T.prim_func
    def sparse_attention_decode_fp8(
        q: T.Tensor((n_tok, H, D), dtype),
        flat8: T.Tensor((nf,), "float8_e4m3"),
        flat16: T.Tensor((T.dynamic("NF2"),), "bfloat16"),
        flat64: T.Tensor((T.dynamic("NF8"),), "int64"),
        compact: T.Tensor((n_tok, ke), "int32"),
        nvalid: T.Tensor((n_tok, 4), "int32"),
        block_table: T.Tensor((r_bt, p_bt), "int64"),
        token_rows: T.Tensor((t2,), "int64"),
        sinks: T.Tensor((H,), "float32"),
        out: T.Tensor((t_out, H, D), dtype),
        part: T.Tensor((t_part, n_split, H, D), "float32"),
        ml: T.Tensor((t_part, n_split, H, 2), "float32"),
        base0: T.int64,
        base1: T.int64,
        base2: T.int64,
        st0: T.int64,
        st1: T.int64,
        st2: T.int64,
        scale2: T.float32,
        epp: T.int32,
        epp_magic: T.int32,
        epp_shift: T.int32,
    ):
        with T.Kernel(n_tok, n_split, H // BH, threads=THREADS) as (t, s, hb):
            if pdl:
                start()
            pages, bases = (epp, epp_magic, epp_shift), (base0, base1, base2)
            sequence = (compact, nvalid, block_table, token_rows, bases, (st0, st1, st2), pages)
            decode(q, sinks, out, part, ml, t, s, hb, (flat8, flat16, flat64), sequence, scale2)

    return sparse_attention_decode_fp8


UNROLLED_SPLITS = 8
"""Split counts up to this one are merged by :func:`build_combine` from loads all issued
before the first use; more splits take its loop."""


def build_combine(heads: int, dim: int, dtype: str, pdl: bool = False, unrolled: int = UNROLLED_SPLITS):
    """The ``prim_func`` merging ``S`` split partials per (token, head), splits in order (with
    ``pdl``, after waiting for the attention kernel: :func:`deepinfer_cuda_sm100.tl.pdl.prologue`).

    A CTA of 128 threads (64 where ``D`` is an odd multiple of 64) takes one (token, head), a
    thread ``D / 128`` (``D / 64``) contiguous values of it.  Up to ``unrolled`` splits
    (:data:`UNROLLED_SPLITS`), a thread loads every split's ``m``, ``l`` and values first,
    each load behind its check of the split count, so that their latencies overlap; in a loop
    over a dynamic count the compiler unrolls by four, and two or three splits took one
    dependent load after another (two memory latencies for the maxima, two more for the
    values; offline SASS for sm_90).  More splits take the loop.  Both forms compute the same
    expressions in the same split order, so the same bits (asserted on the GPU)."""
    import tilelang.language as T

    if dim % 64:
        raise ValueError(f"the combine takes a head dim that is a multiple of 64, got {dim}")
    start = prologue()

    H, D = heads, dim
    threads = 128 if D % 128 == 0 else 64
    V = D // threads  # values a thread
    vec = T.vectorized if V & (V - 1) == 0 else T.unroll  # (3 or 5 values: scalar loads)
    U = max(unrolled, 0)
    n_tok, n_split = T.dynamic("T"), T.dynamic("S")

    @T.prim_func
    def sparse_attention_combine(
        part: T.Tensor((n_tok, n_split, H, D), "float32"),
        ml: T.Tensor((n_tok, n_split, H, 2), "float32"),
        out: T.Tensor((n_tok, H, D), dtype),
    ):
        with T.Kernel(n_tok, H, threads=threads) as (t, h):
            if pdl:
                start()
            tx = T.get_thread_binding()
            acc = T.alloc_local((V,), "float32")
            mx = T.alloc_var("float32")
            den = T.alloc_var("float32")
            for v in vec(V):
                acc[v] = 0.0
            mx = -1e30
            den = 0.0
            if n_split <= U:
                m_s = T.alloc_local((max(U, 1),), "float32")
                l_s = T.alloc_local((max(U, 1),), "float32")
                p_s = T.alloc_local((max(U, 1) * V,), "float32")
                for s in T.unroll(U, explicit=True):
                    if s < n_split:
                        m_s[s] = ml[t, s, h, 0]
                        l_s[s] = ml[t, s, h, 1]
                        for v in vec(V):
                            p_s[s * V + v] = part[t, s, h, tx * V + v]
                for s in T.unroll(U, explicit=True):
                    if s < n_split:
                        mx = T.max(mx, m_s[s])
                for s in T.unroll(U, explicit=True):
                    if s < n_split:
                        w = T.exp2(m_s[s] - mx)
                        den = den + l_s[s] * w
                        for v in vec(V):
                            acc[v] = acc[v] + p_s[s * V + v] * w
            else:
                for s in T.serial(n_split):
                    mx = T.max(mx, ml[t, s, h, 0])
                for s in T.serial(n_split):
                    w = T.exp2(ml[t, s, h, 0] - mx)
                    den = den + ml[t, s, h, 1] * w
                    for v in vec(V):
                        acc[v] = acc[v] + part[t, s, h, tx * V + v] * w
            den = 1.0 / den  # one reciprocal, not an IEEE division an output
            for v in vec(V):
                out[t, h, tx * V + v] = acc[v] * den

    return sparse_attention_combine


@functools.cache
@logged_compile("sparse_attention")
def _kernel(
    kind: str,
    paged: bool,
    split: bool,
    heads: int,
    dim: int,
    dtype: str,
    fp8=None,
    pdl=False,
    unrolled: int = UNROLLED_SPLITS,
):
    """A compiled kernel (TileLang keeps compiled kernels in its disk cache): ``kind``
    ``"attention"`` (:func:`build_attention`'s arguments, ``fp8`` a :class:`Fp8Geometry` or
    ``None``) or ``"combine"`` (``unrolled``: :func:`build_combine`'s), with the PDL prologue
    when ``pdl``.  The attention kernel reads
    the pools through one flat address space, beyond the bounds of the tensor it is given:
    TileLang's bounds guards are off for it."""
    import tilelang

    if kind == "combine":
        func = build_combine(heads, dim, dtype, pdl, unrolled)
        return tilelang.compile(func, out_idx=None, target=cuda_target())
    func = build_attention(paged, split, heads, dim, dtype, fp8, pdl)
    configs = {"tl.disable_safe_memory_legalize": True}
    return tilelang.compile(func, out_idx=None, target=cuda_target(), pass_configs=configs)


def plan_splits(tokens: int, heads: int, max_keys: int, sms: int) -> int:
    """Splits per (token, head block): as many as one wave of CTAs holds (never a second
    wave), each with at least :data:`MIN_SPLIT_BLOCKS` blocks of keys, then as few as give
    the same blocks per split.  Static shapes only."""
    ctas = tokens * (heads // BH)
    blocks = -(-max_keys // BN)
    if ctas >= sms or blocks <= 1:
        return 1
    s = min(sms // ctas, max(1, blocks // MIN_SPLIT_BLOCKS))
    per_split = -(-blocks // s)
    return -(-blocks // per_split)


def third_kind(indices: Sequence[torch.Tensor | PagedIndex]) -> str | None:
    """The kind of the third source of a call: ``"rows"``, ``"paged"`` or ``None``."""
    if len(indices) < 3:
        return None
    return "paged" if isinstance(indices[2], PagedIndex) else "rows"


def max_keys(indices: Sequence[torch.Tensor | PagedIndex]) -> int:
    """The widest key list of a call (static: list widths and ``max_count``)."""
    return sum(i.max_count if isinstance(i, PagedIndex) else i.shape[1] for i in indices)


def compact_sources(indices: Sequence[torch.Tensor | PagedIndex]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prologue: ``(nvalid [T, 4], compact [T, KE])`` - each source's valid keys, and the
    explicit sources' valid rows compacted in order (Triton's prologue kernel)."""
    from deepinfer_cuda_sm100.kernels import attention as triton_attention

    return triton_attention.compact_sources(indices)


def fp8_geometry(kv_pools) -> Fp8Geometry | None:
    """The packed row geometry when every pool is an :class:`~deepinfer_core.ops.kv_format.
    Fp8KVPool` of one layout (the FP8 kernel), ``None`` when every pool is plain."""
    if not isinstance(kv_pools[0], Fp8KVPool):
        return None
    lay = kv_pools[0].layout
    return Fp8Geometry(lay.nope, lay.rope_offset, lay.scale_offset, lay.groups)


def _flat_views(kv_pools, fp8: Fp8Geometry | None, dtype: torch.dtype):
    """The pools' common base as the kernel's flat tensors, each pool's base and row stride in
    the kernel's address units (16 bytes plain, 8 bytes packed)."""
    data = [p if fp8 is None else p.data for p in kv_pools]
    lowest = min(data, key=lambda x: x.data_ptr())
    unit = 16 if fp8 is None else 8

    def flat(view_dtype: torch.dtype) -> torch.Tensor:
        return torch.as_strided(lowest.view(view_dtype), (1,), (1,))

    views = (
        (flat(dtype),)
        if fp8 is None
        else (flat(torch.float8_e4m3fn), flat(torch.bfloat16), flat(torch.int64))
    )
    bases = [(x.data_ptr() - lowest.data_ptr()) // unit for x in data] + [0] * (3 - len(data))
    strides = [x.stride(0) * x.element_size() // unit for x in data] + [0] * (3 - len(data))
    return views, bases, strides


def sparse_attention(q, kv_pools, indices, sinks, scale) -> torch.Tensor:
    """The op (see the module docstring; :func:`~deepinfer_cuda_sm100.attention_dispatch.
    tilelang_supports` says which calls it takes)."""
    return launch(q, kv_pools, indices, sinks, scale, functools.partial(_kernel, "attention"))


def launch(
    q,
    kv_pools,
    indices,
    sinks,
    scale,
    compiled: Callable[..., Any],
    plan: Callable[..., int] = plan_splits,
) -> torch.Tensor:
    """The host side of a TileLang attention kernel taking this module's kernel arguments (this
    module's and :mod:`~deepinfer_cuda_sm100.tl.sparse_attention_ws`'s): the Triton prologue,
    the pools' flat views, the split plan, the output or fp32 partials, and the combine.
    ``compiled(paged, split, heads, dim, dtype, fp8, pdl)`` is the kernel of the call's static
    configuration (``pdl``: with the PDL prologue, where :func:`~deepinfer_cuda_sm100.tl.pdl.
    tl_pdl_enabled` says so; the combine takes the same); ``plan(tokens, heads, max_keys, sms)``
    the kernel's split count (default :func:`plan_splits`)."""
    t, h, d = q.shape
    dtype = TL_DTYPES[q.dtype]
    dev = q.device
    paged = isinstance(indices[-1], PagedIndex)
    fp8 = fp8_geometry(kv_pools)
    nvalid, compact = compact_sources(indices)
    views, bases, strides = _flat_views(kv_pools, fp8, q.dtype)
    if paged:
        pi: PagedIndex = indices[-1]
        bt, rows, epp = index_int64(pi.block_table), index_int64(pi.token_rows), pi.entries_per_page
    else:  # never read (see key_offsets): no fill launch
        one = torch.empty(1, dtype=torch.int64, device=dev)
        bt, rows, epp = one.view(1, 1), one, 1
    s = plan(t, h, max_keys(indices), num_sms(dev))
    out = torch.empty_like(q) if s == 1 else torch.empty(1, h, d, dtype=q.dtype, device=dev)
    if s == 1:  # never written; the kernel's grid takes the split count from it
        part = torch.empty(1, s, h, d, dtype=torch.float32, device=dev)
        ml = torch.empty(1, s, h, 2, dtype=torch.float32, device=dev)
    else:
        part = torch.empty(t, s, h, d, dtype=torch.float32, device=dev)
        ml = torch.empty(t, s, h, 2, dtype=torch.float32, device=dev)
    pdl = tl_pdl_enabled()
    kernel = compiled(paged, s > 1, h, d, dtype, fp8, pdl)
    scale2 = float(scale) * LOG2E
    sinks = sinks.float().contiguous()
    tensors = (q.contiguous(), *views, compact, nvalid, bt, rows, sinks, out, part, ml)
    kernel(*tensors, *bases, *strides, scale2, epp, *divider(epp))
    if s == 1:
        return out
    out = torch.empty_like(q)
    _kernel("combine", False, False, h, d, dtype, None, pdl)(part, ml, out)
    return out
