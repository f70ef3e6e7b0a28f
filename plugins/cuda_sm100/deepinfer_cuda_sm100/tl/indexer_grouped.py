"""``indexer_topk``'s scores in TileLang for many query tokens of one request (prefill, and
speculative verification): the scores of :mod:`deepinfer_cuda_sm100.tl.indexer` with each
gathered key block serving several tokens.

One CTA (:data:`WARPGROUPS` warpgroups, each taking 64 of a block's rows) takes :data:`GROUP`
consecutive query tokens and up to ``blocks`` blocks of :data:`~deepinfer_cuda_sm100.tl.
indexer.BN` entries of a :class:`~deepinfer_core.ops.attention.PagedIndex`.  Tokens of one
request read the same block table row, so the CTA resolves that row's entries to pool rows
once, gathers each key block into shared memory once, and runs the one-token kernel's GEMM
and epilogue for every token of the row against it: the keys cross L2 once per group instead
of once per token (at 8,192 tokens of one request over 2,048 entries, 4.3 GB of gathers per
call with one token a CTA).

A group that spans requests (a token whose block-table row differs from its predecessor's)
takes one pass per run of equal rows: each pass gathers its row's keys and scores only the
tokens of that row, so every score is computed against the token's own keys whatever the
batch.  Entries at or past a token's own count score ``-inf``, as in the one-token kernel; a
pass reads no block-table entry past the largest count of its row's tokens (those pages need
not exist), and its blocks past that count are neither gathered nor multiplied, only written
as ``-inf`` (a causal prefill chunk's early tokens see few entries: about half the blocks of a
chunk that starts a request).

**Bits.**  Each token's product is the one-token kernel's: the same 64-row wgmma tiles
over the same gathered rows in the same K order, the same epilogue (relu, scale, head
weights, the sum over heads within each row's quad), so its scores equal that kernel's bit
for bit (asserted on the GPU).  Both round the head weight's product before the sum adds it
(``ieee_mul``): left to nvcc, the one-token kernel's straight-line epilogue fused the two into
FMAs and this kernel's did not.  The group size is static configuration: a token's scores do
not depend on the other tokens.
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as
# objects (shapes built from closure variables).
import functools

import torch

from deepinfer_core.ops.attention import PagedIndex

from .compile_log import logged_compile
from .indexer import BLOCK_CHOICES, BLOCKS, BN, MIN_CTAS_PER_SM, THREADS
from .launch_args import TL_DTYPES, index_int64, num_sms
from .page_division import divider, pool_row
from .pdl import prologue, tl_pdl_enabled
from .target import cuda_target

GROUP = 2
"""Query tokens a CTA takes (the default of :func:`indexer_scores`): their queries (16 KB
each at 64 heads x 128) share shared memory with the 64 KB key ring, two CTAs an SM at 2."""
GROUP_CHOICES = (2, 4)
"""Group sizes a launch may take (each a compiled configuration)."""
WARPGROUPS = 2
"""Warpgroups a CTA: at 2, each takes one 64-row wgmma M tile of a block (half its keys) with
all its heads, so an SM holding two CTAs (their shared memory allows no more) runs 16 warps
instead of 8 to hide the GEMM's and the gather's latency; every score is the same tile's, so
the same bits.  Measured on an H100 (``bench_attention.py --only indexer --tune``): 0.861 ms
against 0.949 at one warpgroup at 8,192 x 2,048, 0.207 against 0.213 at 128 x 16,384.  Taking
the key block into registers instead (wgmma's register-A form, one copy for the group's
GEMMs) was slower: 1.47 / 1.36 ms at 8,192 x 2,048 by one / two warpgroups."""
OVERLAP = True
"""Whether a block's GEMMs for the group's tokens are all issued before the first epilogue
(one accumulator a token, each waited for in turn: token 0's epilogue runs while token 1's
GEMM multiplies) instead of each GEMM waited for before its epilogue.  Tokens of another
request than the pass's are multiplied too and their products dropped.  The same products
and epilogue, so the same bits.  A group of 2 only, built for two CTAs an SM (128 registers
a thread at two warpgroups, no spills, offline for sm_90; four accumulators spill).  Measured
on an H100 (``bench_attention.py --only indexer --tune``, bitwise equal): 0.788 ms against
0.865 without at 8,192 x 2,048; 0.208 against 0.204 at 128 x 16,384, where the one-token
kernel (0.196) runs instead."""


HOIST = False
"""Whether the overlapped kernel (:data:`OVERLAP`) keeps its per-block bookkeeping out of
shared memory: each pass decides once which of the group's tokens it scores (a register flag a
token, where every block's epilogue read and compared two 64-bit rows from shared memory, three
times a token), and each token's head weights are read from shared memory into registers before
the wait for its GEMM (where the epilogue read them right before each multiply).  An ``ncu``
profile of the default at 8,192 x 2,048 on an H100 had the row comparison as its hottest
instruction (5 % of the warp samples, waiting on its two shared loads) and the multiplies by
the weights next (about 1.3 % each), short-scoreboard waits being 31 % of all samples.  The
same products, weights and sums, so the same bits.  Built for sm_90 offline; untimed, so off
(``bench_attention.py --only indexer --tune`` times it)."""


def overlaps(group: int) -> bool:
    """Whether a CTA of ``group`` tokens runs overlapped by default: :data:`OVERLAP`, at the
    group size it takes (2)."""
    return OVERLAP and group == 2


def build_grouped_scores(
    heads: int,
    dim: int,
    dtype: str,
    blocks: int = BLOCKS,
    group: int = GROUP,
    pdl: bool = False,
    warpgroups: int = WARPGROUPS,
    overlap: bool | None = None,
    hoist: bool = HOIST,
):
    """The TileLang ``prim_func`` of one static configuration (paged candidates only).

    Args:
        heads: ``H`` (a multiple of 16); dim: ``D`` (a multiple of 64); dtype: ``"bfloat16"``
            or ``"float16"``.
        blocks: blocks of ``BN`` entries per CTA; group: query tokens per CTA.
        pdl: start with the PDL prologue (:func:`deepinfer_cuda_sm100.tl.pdl.prologue`) before
            any global access.
        warpgroups: 1 or 2 (see :data:`WARPGROUPS`); overlap: see :data:`OVERLAP` (default
            :func:`overlaps`); hoist: see :data:`HOIST` (overlapped kernels only).
    """
    if group not in GROUP_CHOICES:
        raise ValueError(f"group must be one of {GROUP_CHOICES}, got {group}")
    overlap = overlaps(group) if overlap is None else overlap
    if warpgroups not in (1, 2):
        raise ValueError(f"warpgroups must be 1 or 2, got {warpgroups}")
    if overlap and group != 2:
        raise ValueError(f"overlap takes a group of 2 tokens (four accumulators spill), got {group}")
    hoist = hoist and overlap  # (the flags and weights serve the overlapped epilogues)
    import tilelang.language as T

    acc_t = "float32"
    H, D, G = heads, dim, group
    n_tok, n_cand, nf = T.dynamic("T"), T.dynamic("C"), T.dynamic("NF")
    r_bt, p_bt, t2, t3 = T.dynamic("R"), T.dynamic("P"), T.dynamic("T2"), T.dynamic("T3")
    start = prologue()
    # two warpgroups split a block's keys (wgmma's M), never its heads: a row's sum over heads
    # stays in one quad of threads
    split = {"policy": T.GemmWarpPolicy.FullRow} if warpgroups == 2 else {}
    # the gather in stage 0, the GEMMs and epilogues in stage 1: with OVERLAP, a token's
    # issue and finish are seven statements of the loop's body as TileLang counts them
    body = 1 + (7 * G if overlap else 1)
    stages = {"order": list(range(body)), "stage": [0] + [1] * (body - 1)}

    @T.macro
    def row_offsets(off, page_row, c0, count, pages, block_table):
        """``off[i]``: entry ``c0 + i`` of block-table row ``page_row`` as a pool row (int32,
        half the static shared memory of 16-byte offsets), ``-1`` from ``count`` on (the
        entries no token of the row sees: their pages need not exist), negative where the table
        holds no page."""
        for i in T.Parallel(blocks * BN):
            e = c0 + i
            row = pool_row(block_table, page_row, e, pages)
            off[i] = T.if_then_else(e < count, T.Cast("int32", row), -1)

    def row_count(row, count, p):
        """The most entries a token of token ``p``'s row sees, over the group's ``row`` and
        ``count`` values (an expression unrolled at trace time)."""
        out = T.if_then_else(row(0) == row(p), count(0), T.int64(0))
        for j in range(1, G):
            out = T.max(out, T.if_then_else(row(j) == row(p), count(j), T.int64(0)))
        return out

    @T.macro
    def gather(k_s, off, flat, b, kst):
        for i, d in T.Parallel(BN, D):
            k_s[i, d] = flat[T.Cast("int64", T.max(off[b * BN + i], 0)) * kst * 8 + d]

    @T.macro
    def epilogue(acc, score, w_s, j, scale, scores, token, first, off, base, count, w_r=None):
        """Token ``j``'s (row ``token`` of ``scores``) logits of a block whose first candidate
        is ``first`` (its offsets from ``off[base]``) to scores: relu, scale, head weight
        (rounded; from the registers ``w_r`` where given, else ``w_s``), the sum over heads;
        ``-inf`` at or past ``count`` and where no page is."""
        for i, h in T.Parallel(BN, H):
            if w_r is None:
                acc[i, h] = T.ieee_mul(T.max(acc[i, h], 0) * scale, w_s[j, h])
            else:
                acc[i, h] = T.ieee_mul(T.max(acc[i, h], 0) * scale, w_r[h])
        T.reduce_sum(acc, score, dim=1)
        for i in T.Parallel(BN):
            c = first + i
            if c < n_cand:
                scores[token, c] = T.if_then_else(
                    (off[base + i] < 0) or (c >= count),
                    -T.infinity(acc_t),
                    T.if_then_else(score[i] == 0, T.float32(0), score[i]),
                )

    @T.macro
    def issue(k_s, q_s, acc, j):
        """Token ``j``'s GEMM of the block issued, not waited for."""
        T.clear(acc)
        T.wgmma_gemm(k_s, q_s[j, :, :], acc, transpose_B=True, **split)

    @T.macro
    def finish(acc, j, in_flight, lead, rows_s, cnt_s, score, w_s, scale, scores, t0, g, b, off):
        """Token ``j``'s GEMM waited for (``in_flight`` later ones may still multiply), then its
        epilogue where it belongs to the pass's row (``lead``: that row)."""
        T.wait_wgmma(in_flight)
        if rows_s[j] == lead:
            epilogue(acc, score, w_s, j, scale, scores, t0 + j, (g * blocks + b) * BN, off, b * BN, cnt_s[j])

    @T.macro
    def finish_hoisted(acc, j, in_flight, live, w_r, cnt_s, score, w_s, scale, scores, t0, g, b, off):
        """:func:`finish` with :data:`HOIST`: the token's weights into ``w_r`` before the wait,
        the pass's flag ``live[j]`` instead of the rows' comparison."""
        T.copy(w_s[j, :], w_r)
        T.wait_wgmma(in_flight)
        if live[j] != 0:
            first = (g * blocks + b) * BN
            epilogue(acc, score, w_s, j, scale, scores, t0 + j, first, off, b * BN, cnt_s[j], w_r)

    def overlapped(k_s, q_s, accs, lead, *io, live=None, w_r=None):
        """:data:`OVERLAP`'s block: every token's GEMM issued, then each waited for in turn
        and its epilogue run while the later ones multiply (plain Python, so the token loop
        unrolls at trace time: one accumulator a token); with :data:`HOIST` the pass's flags
        ``live`` and the weights' registers ``w_r``."""
        for j in range(G):
            issue(k_s, q_s, accs[j], j)
        for j in range(G):
            if live is None:
                finish(accs[j], j, G - 1 - j, lead, *io)
            else:
                finish_hoisted(accs[j], j, G - 1 - j, live, w_r, *io[1:])  # (not rows_s)

    @T.prim_func
    def indexer_scores_grouped(
        q: T.Tensor((n_tok, H, D), dtype),
        w: T.Tensor((n_tok, H), "float32"),
        flat: T.Tensor((nf,), dtype),
        block_table: T.Tensor((r_bt, p_bt), "int64"),
        token_rows: T.Tensor((t2,), "int64"),
        counts: T.Tensor((t3,), "int64"),
        scores: T.Tensor((n_tok, n_cand), "float32"),
        kst: T.int64,
        scale: T.float32,
        max_count: T.int32,
        epp: T.int32,
        epp_magic: T.int32,
        epp_shift: T.int32,
    ):
        grid = (T.ceildiv(n_cand, BN * blocks), T.ceildiv(n_tok, G))
        with T.Kernel(*grid, threads=THREADS * warpgroups) as (g, tg):
            q_s = T.alloc_shared((G, H, D), dtype)
            w_s = T.alloc_shared((G, H), acc_t)
            k_s = T.alloc_shared((BN, D), dtype)
            # static shared memory, as the one-token kernel's (no barrier in the gather loop)
            off = T.alloc_shared((blocks * BN,), "int32", scope="shared")
            rows_s = T.alloc_shared((G,), "int64", scope="shared")
            cnt_s = T.alloc_shared((G,), "int64", scope="shared")
            live_s = T.alloc_shared((G,), "int64", scope="shared")
            acc = None if overlap else T.alloc_fragment((BN, H), acc_t)
            accs = [T.alloc_fragment((BN, H), acc_t) for _ in range(G)] if overlap else []
            score = T.alloc_fragment((BN,), acc_t)
            live = T.alloc_local((G,), "int32") if hoist else None  # the pass's tokens (HOIST)
            w_r = T.alloc_fragment((H,), acc_t) if hoist else None  # a token's weights (HOIST)
            nb = T.alloc_var("int32")  # a pass's live blocks (a loop bound: not a shared load)
            t0 = tg * G
            c0 = g * blocks * BN
            if overlap:  # two CTAs an SM, as without: at most 128 registers a thread
                T.annotate_min_blocks_per_sm(2)
            if pdl:  # every input comes from the kernels before
                start()
            for j, h, d in T.Parallel(G, H, D):
                q_s[j, h, d] = q[T.min(t0 + j, n_tok - 1), h, d]
            for j, h in T.Parallel(G, H):
                w_s[j, h] = w[T.min(t0 + j, n_tok - 1), h]
            for j in T.Parallel(G):
                # a token past the end gets row -1: no pass leads with it, none scores it
                tj = T.min(t0 + j, n_tok - 1)
                rows_s[j] = T.if_then_else(t0 + j < n_tok, token_rows[tj], T.int64(-1))
                cnt = T.min(T.max(counts[tj], T.int64(0)), T.Cast("int64", max_count))
                cnt_s[j] = T.if_then_else(t0 + j < n_tok, cnt, T.int64(0))
            for j in T.Parallel(G):
                # the most entries a token of token j's row sees: a pass gathers no further
                live_s[j] = row_count(lambda i: rows_s[i], lambda i: cnt_s[i], j)
            for p in T.serial(G):
                # a pass per run of equal rows: it leads where its row differs from the last
                if rows_s[p] >= 0 and (p == 0 or rows_s[p] != rows_s[T.max(p - 1, 0)]):
                    pages = (epp, epp_magic, epp_shift)
                    row_offsets(off, T.Cast("int32", rows_s[p]), c0, live_s[p], pages, block_table)
                    # the blocks holding an entry a token of the row sees (at least one: the
                    # pipeline's prologue gathers a block); past them every score is -inf
                    nb = T.max(
                        T.min(T.Cast("int32", T.ceildiv(T.max(live_s[p] - c0, T.int64(0)), BN)), blocks), 1
                    )
                    if hoist:  # which tokens the pass scores, decided once
                        for j in T.unroll(G):
                            live[j] = T.if_then_else(rows_s[j] == rows_s[p], 1, 0)
                    for b in T.Pipelined(nb, **stages):
                        gather(k_s, off, flat, b, kst)
                        if overlap:  # every token's GEMM issued, then each waited for in turn
                            frame = (rows_s, cnt_s, score, w_s, scale, scores, t0, g, b, off)
                            overlapped(k_s, q_s, accs, rows_s[p], *frame, live=live, w_r=w_r)
                        else:
                            for j in T.serial(G):
                                if rows_s[j] == rows_s[p]:
                                    T.gemm(
                                        k_s, q_s[j, :, :], acc, transpose_B=True, clear_accum=True, **split
                                    )
                                    first = (g * blocks + b) * BN
                                    io = (scores, t0 + j, first, off, b * BN, cnt_s[j])
                                    epilogue(acc, score, w_s, j, scale, *io)
                    for b in T.serial(nb, blocks):
                        for j in T.serial(G):
                            if rows_s[j] == rows_s[p]:
                                for i in T.Parallel(BN):
                                    c = (g * blocks + b) * BN + i
                                    if c < n_cand:
                                        scores[t0 + j, c] = -T.infinity(acc_t)

    return indexer_scores_grouped


def plan_blocks(tokens: int, candidates: int, sms: int, group: int = GROUP) -> int:
    """Blocks per CTA: the most of :data:`~deepinfer_cuda_sm100.tl.indexer.BLOCK_CHOICES`
    that still give :data:`~deepinfer_cuda_sm100.tl.indexer.MIN_CTAS_PER_SM` CTAs per SM
    with ``group`` tokens a CTA, one block where none does."""
    blocks = -(-candidates // BN)
    ctas = -(-tokens // group)
    fitting = [b for b in BLOCK_CHOICES if ctas * -(-blocks // b) >= MIN_CTAS_PER_SM * sms]
    return max(fitting, default=1)


@functools.cache
@logged_compile("indexer_grouped")
def _kernel(heads: int, dim: int, dtype: str, *options):
    """A compiled kernel of :func:`build_grouped_scores` (``options``: its ``blocks``,
    ``group``, ``pdl``, ``warpgroups``, ``overlap``[, ``hoist``], in order; TileLang's disk cache
    keeps it); bounds guards off, as the one-token kernel's (the gathers read the pool through
    a flat view)."""
    import tilelang

    configs = {"tl.disable_safe_memory_legalize": True}
    func = build_grouped_scores(heads, dim, dtype, *options)
    return tilelang.compile(func, out_idx=None, target=cuda_target(), pass_configs=configs)


def supports(q, weights, key_pool, candidates) -> bool | str:
    """``True`` when the grouped scores take this call: one the one-token TileLang kernel takes,
    over a paged index."""
    from .indexer import supports as one_token_supports

    if not isinstance(candidates, PagedIndex):
        return "the grouped TileLang scores take paged candidates only"
    if isinstance(key_pool, torch.Tensor) and key_pool.shape[0] >= 2**31:
        return f"{key_pool.shape[0]} pool rows: the grouped TileLang scores index rows in int32"
    return one_token_supports(q, weights, key_pool, candidates)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: torch.Tensor,
    candidates: PagedIndex,
    scale: float,
    *,
    blocks: int | None = None,
    group: int = GROUP,
    warpgroups: int = WARPGROUPS,
    overlap: bool | None = None,
    hoist: bool = HOIST,
) -> torch.Tensor:
    """The ``[T, C]`` fp32 scores of a call :func:`supports` takes, bitwise those of
    :func:`deepinfer_cuda_sm100.tl.indexer.indexer_scores`.  ``blocks``: blocks per CTA
    (default :func:`plan_blocks`); ``group``: query tokens per CTA; ``warpgroups``: 1 or 2
    (:data:`WARPGROUPS`); ``overlap``: see :data:`OVERLAP` (default :func:`overlaps`);
    ``hoist``: see :data:`HOIST` (the same bits)."""
    t, h, d = q.shape
    c = int(candidates.max_count)
    scores = torch.empty((t, c), dtype=torch.float32, device=q.device)
    if t == 0 or c == 0:
        return scores
    flat = torch.as_strided(key_pool, (1,), (1,))
    kst = key_pool.stride(0) * key_pool.element_size() // 16
    w = weights if weights.dtype == torch.float32 else weights.float()
    if blocks is None:
        blocks = plan_blocks(t, c, num_sms(q.device), group)
    overlap = overlaps(group) if overlap is None else overlap
    config = (blocks, group, tl_pdl_enabled(), warpgroups, overlap) + ((True,) if hoist and overlap else ())
    kernel = _kernel(h, d, TL_DTYPES[q.dtype], *config)
    epp = int(candidates.entries_per_page)
    kernel(
        q.contiguous(), w.contiguous(), flat, index_int64(candidates.block_table),
        index_int64(candidates.token_rows), index_int64(candidates.counts), scores, kst,
        float(scale), c, epp, *divider(epp),
    )  # fmt: skip
    return scores
