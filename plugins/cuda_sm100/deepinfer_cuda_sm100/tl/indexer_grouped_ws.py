"""The grouped indexer scores (:mod:`deepinfer_cuda_sm100.tl.indexer_grouped`) warp-specialised:
a producer warpgroup gathers the key blocks into a ring while two consumer warpgroups multiply.

In the grouped kernel every warpgroup gathers a block, waits for it at a block barrier, then
multiplies it by its tokens' queries, and a CTA can hold at most two tokens' accumulators: a
key block crosses L2 once per two tokens.  Here one CTA a SM (384 threads) takes ``group``
tokens (4 by default), and:

- the producer warpgroup (threads 256..383, :data:`PRODUCER_REGS` registers) copies the
  group's queries into shared memory by ``cp.async`` (completing on ``bar_q``), then the
  blocks of :data:`~deepinfer_cuda_sm100.tl.indexer.BN` entries: each thread resolves its
  eight rows of a block (a row's 16-byte chunks spread over eight threads, so a warp's copy
  covers whole 128-byte lines) to pool rows through the block table, waits for the block's
  slot to be free (``bar_free[slot]``), issues the rows' 16-byte ``cp.async`` copies and marks
  the slot full when they land (``bar_ready[slot]``), :data:`SLOTS` blocks ahead of the
  consumers;
- consumer ``wg`` (threads ``128 wg ..``, :data:`CONSUMER_REGS` registers) takes rows ``64 wg
  .. 64 wg + 63`` of every block: it issues the ``wgmma`` GEMM of each token of the group (one
  accumulator a token) against the slot, then waits for them one at a time, so a token's
  epilogue runs while the later tokens' GEMMs multiply; once the last one is done the slot is
  handed back to the producer.  The epilogue is the grouped kernel's (relu, scale, the head
  weight's product rounded, the sum over heads within a row's quad), and ``-inf`` at or past
  the token's count and where the table holds no page (the consumer reads that entry of the
  table itself).

A key block thus crosses L2 once per ``group`` tokens, the gathers run ahead of the GEMMs
through the ring, and no block barrier is needed after the set-up.  A group spanning requests
takes one pass per run of equal block-table rows, as in the grouped kernel; the producer and
the consumers walk the same passes and count the blocks across them, which keeps the ring's
phases in step.

**Bits.**  Each token's product is a ``wgmma`` ``m64nHk16`` sequence over the same 64 rows and
the same K order as the one-token kernel's, followed by the same epilogue, so its scores equal
that kernel's bit for bit (the GPU test asserts it beside the grouped kernel's variants).
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as
# objects (shapes built from closure variables).
import functools

from .compile_log import logged_compile
from .indexer import BN, group_rows, grouped_scores_func
from .page_division import page_and_slot, page_of
from .pdl import prologue
from .target import cuda_target

THREADS = 384
"""Two consumer warpgroups and the producer (one consumer: 256)."""
CONSUMERS = 2
"""Consumer warpgroups a CTA by default: one CTA an SM, a ring block of 128 rows."""
CONSUMER_CHOICES = (1, 2)
"""Consumer warpgroups a CTA may have: at 1 a ring block is 64 rows, and two CTAs share an SM
(each's stages overlap the other's start and end), where its shared memory allows
(:data:`TWO_CTA_SMEM`)."""
TWO_CTA_SMEM = 110 * 1024
"""The most shared memory (queries and ring) of a one-consumer CTA, two of which share an SM."""
SLOTS = 4
"""Key blocks the ring holds (32 KB each at ``D = 128``): with a group of 4 tokens' queries
(64 KB), 192 KB of shared memory, one CTA an SM."""
SLOT_CHOICES = (2, 3, 4)
"""Ring depths a launch may take (each a compiled configuration)."""
GROUP = 4
"""Tokens a CTA by default."""
GROUP_CHOICES = (2, 4)
"""Tokens a CTA may take (a consumer holds one ``[64, H]`` fp32 accumulator a token)."""
MAX_HEADS = 64
"""The most heads: four tokens' ``[64, H]`` accumulators fill a consumer's registers."""
PRODUCER_REGS = 56
"""The producer's registers a thread (``setmaxnreg``): its eight rows' pool rows and their
copies."""
CONSUMER_REGS = 224
"""A consumer's registers a thread: four tokens' accumulators take 128 at ``H = 64``.  The
CTA is launched with 168 a thread (64 K over 384 threads, in steps of 8), and ``p + 2 c`` may
not exceed ``3 x 168``, or a consumer's ``setmaxnreg.inc`` waits forever."""
ONE_CONSUMER_REGS = (56, 200)
"""``(producer, consumer)`` registers of a one-consumer CTA, two an SM: launched with 128 a
thread (64 K over 512 threads), so ``p + c`` may not exceed ``2 x 128``."""
ROW_THREADS = 8
"""Producer threads a key row: each copies every eighth 16-byte chunk of it."""
VEC = 8
"""Elements a 16-byte copy (bfloat16 / float16)."""
HALF = 64
"""Rows of a block a consumer takes (one ``wgmma`` M tile)."""


def problem(heads: int, dim: int) -> str | None:
    """Why the kernel cannot take ``heads`` x ``dim`` queries (one line), or ``None``."""
    if heads % 16 or heads > MAX_HEADS or dim % 64:
        return (
            f"{heads} heads x {dim}: the warp-specialised grouped scores take a multiple of 16 "
            f"heads up to {MAX_HEADS} and a dim that is a multiple of 64"
        )
    return None


def registers(consumers: int) -> tuple[int, int]:
    """``(producer, consumer)`` registers a thread (``setmaxnreg``) of a CTA of ``consumers``
    consumer warpgroups."""
    return (PRODUCER_REGS, CONSUMER_REGS) if consumers == 2 else ONE_CONSUMER_REGS


def fit_problem(heads: int, dim: int, group: int, slots: int, consumers: int) -> str | None:
    """Why a CTA of ``consumers`` consumer warpgroups cannot hold ``group`` tokens' queries and a
    ring of ``slots`` blocks (one line), or ``None``."""
    if consumers not in CONSUMER_CHOICES:
        return f"consumers must be one of {CONSUMER_CHOICES}, got {consumers}"
    smem = (group * heads + slots * HALF * consumers) * dim * 2
    if consumers == 1 and smem > TWO_CTA_SMEM:
        return (
            f"a one-consumer CTA of {group} tokens and {slots} slots takes {smem // 1024} KB of shared "
            f"memory, over the {TWO_CTA_SMEM // 1024} KB two CTAs an SM allow"
        )
    return None


def build_specialized_scores(
    heads: int,
    dim: int,
    dtype: str,
    blocks: int,
    group: int = GROUP,
    pdl: bool = False,
    slots: int = SLOTS,
    consumers: int = CONSUMERS,
):
    """The TileLang ``prim_func`` of one static configuration (paged candidates only), with the
    grouped kernel's signature (:func:`~deepinfer_cuda_sm100.tl.indexer_grouped.
    build_grouped_scores`).

    Args:
        heads: ``H`` (a multiple of 16, at most 64: a consumer's accumulators); dim: ``D`` (a
            multiple of 64); dtype: ``"bfloat16"`` or ``"float16"``.
        blocks: blocks of ``BN`` entries per CTA; group: query tokens per CTA (one of
            :data:`GROUP_CHOICES`); slots: the ring's depth (one of :data:`SLOT_CHOICES`).
        pdl: start with the PDL prologue (:func:`deepinfer_cuda_sm100.tl.pdl.prologue`) before
            any global access.
        consumers: consumer warpgroups a CTA (one of :data:`CONSUMER_CHOICES`).
    """
    if group not in GROUP_CHOICES:
        raise ValueError(f"group must be one of {GROUP_CHOICES}, got {group}")
    if slots not in SLOT_CHOICES:
        raise ValueError(f"slots must be one of {SLOT_CHOICES}, got {slots}")
    shape = problem(heads, dim) or fit_problem(heads, dim, group, slots, consumers)
    if shape:
        raise ValueError(shape)
    import tilelang.language as T

    acc_t = "float32"
    H, D, G = heads, dim, group
    n_tok, n_cand, nf = T.dynamic("T"), T.dynamic("C"), T.dynamic("NF")
    r_bt, p_bt, t2, t3 = T.dynamic("R"), T.dynamic("P"), T.dynamic("T2"), T.dynamic("T3")
    start = prologue()
    load_rows = group_rows(G, n_tok)
    span = HALF * consumers  # rows of a ring block (BN at two consumers)
    ring_blocks = blocks * BN // span  # ring blocks a CTA spans
    threads = 128 * (consumers + 1)
    producer_regs, consumer_regs = registers(consumers)
    rows_at_once = 128 // ROW_THREADS  # rows a producer pass copies
    passes = span // rows_at_once  # a thread's rows a block
    chunks = D // (VEC * ROW_THREADS)  # a thread's chunks a row
    q_chunks = G * H * D // VEC // 128  # a producer thread's 16-byte chunks of the queries

    def live_blocks(live, c0):
        """The ring blocks of the CTA holding an entry a token of the pass's row sees."""
        return T.min(T.Cast("int32", T.ceildiv(T.max(live - c0, T.int64(0)), span)), ring_blocks)

    @T.macro
    def load_queries(q_s, q, t0, p, bar_q):
        """The producer's ``cp.async`` copies of the group's queries (a token past the batch
        copies the last token's: finite data, never scored), landing on ``bar_q``."""
        for r in T.unroll(q_chunks, explicit=True):
            k = r * 128 + p
            j, h, c = k // (H * D // VEC), k // (D // VEC) % H, k % (D // VEC) * VEC
            T.ptx_cp_async(
                T.access_ptr(q_s[j, h, c], "w", VEC),
                T.access_ptr(q[T.min(t0 + j, n_tok - 1), h, c], "r", VEC),
                VEC,
            )
        T.cp_async_barrier_noinc(bar_q)

    @T.macro
    def produce(k_s, flat, rows, bars, it, e0, page_row, live, pages, block_table, kst, p):
        """The CTA's ``it``-th block (entries ``e0 ..``) into its slot: the thread's rows
        resolved, the slot waited for, the copies issued, the slot marked full on landing (a
        row past the pass's entries, or whose page the table lacks, copies the pool's first)."""
        bar_free, bar_ready = bars
        slot = it % slots
        for r in T.unroll(passes, explicit=True):
            e = e0 + r * rows_at_once + p // ROW_THREADS
            page = page_of(block_table, page_row, e, pages)  # (its sign is the row's)
            row = T.Cast("int32", page * pages[0] + page_and_slot(e, *pages)[1])
            rows[r] = T.if_then_else(e < live and page >= 0, row, 0)
        T.barrier_wait(bar_free[slot], (it // slots) & 1)
        for r in T.unroll(passes, explicit=True):
            i = r * rows_at_once + p // ROW_THREADS
            for u in T.unroll(chunks, explicit=True):
                c = (u * ROW_THREADS + p % ROW_THREADS) * VEC
                T.ptx_cp_async(
                    T.access_ptr(k_s[slot, i // HALF, i % HALF, c], "w", VEC),
                    T.access_ptr(flat[T.Cast("int64", rows[r]) * kst * 8 + c], "r", VEC),
                    VEC,
                )
        T.cp_async_barrier_noinc(bar_ready[slot])

    @T.macro
    def wait_full(bars, it):
        """The consumer's wait for the CTA's ``it``-th block to land."""
        T.barrier_wait(bars[1][it % slots], (it // slots) & 1)

    @T.macro
    def issue(k_s, it, wg, q_s, acc, j):
        """Token ``j``'s GEMM over the consumer's rows of the block issued, not waited for."""
        T.clear(acc)
        T.wgmma_gemm(k_s[it % slots, wg, :, :], q_s[j, :, :], acc, transpose_B=True)

    @T.macro
    def epilogue(acc, score, w_s, j, first, ctx):
        """Token ``j``'s logits of the consumer's 64 rows (entries ``first ..``) to scores:
        relu, scale, head weight (rounded), the sum over heads; ``-inf`` at or past the token's
        count and where the table holds no page."""
        rows_s, cnt_s, scale, scores, t0, pages, block_table = ctx
        page_row = T.Cast("int32", rows_s[j])
        for i, h in T.Parallel(HALF, H):
            acc[i, h] = T.ieee_mul(T.max(acc[i, h], 0) * scale, w_s[j, h])
        T.reduce_sum(acc, score, dim=1)
        for i in T.Parallel(HALF):
            c = first + i
            if c < n_cand:
                # (the table read only below the count, where its page exists; the page id's
                # sign is the row's)
                missing = (c >= cnt_s[j]) or (page_of(block_table, page_row, c, pages) < 0)
                scores[t0 + j, c] = T.if_then_else(
                    missing, -T.infinity(acc_t), T.if_then_else(score[i] == 0, T.float32(0), score[i])
                )

    @T.macro
    def finish(acc, score, w_s, j, in_flight, release, bars, it, lead, first, ctx):
        """Token ``j``'s GEMM waited for (``in_flight`` later ones may still multiply); with
        ``release`` the slot handed back; then its epilogue where it belongs to the pass's row."""
        T.wait_wgmma(in_flight)
        if release:  # every GEMM of the slot done: the producer may refill it
            T.barrier_arrive(bars[0][it % slots])
        if ctx[0][j] == lead:
            epilogue(acc, score, w_s, j, first, ctx)

    def consume(wg, k_s, q_s, accs, score, w_s, bars, it, lead, first, ctx):
        """Consumer ``wg``'s part of the CTA's ``it``-th block: every token's GEMM issued, then
        each waited for in turn (plain Python over the tokens: one accumulator a token)."""
        wait_full(bars, it)
        for j in range(G):
            issue(k_s, it, wg, q_s, accs[j], j)
        for j in range(G):
            finish(accs[j], score, w_s, j, G - 1 - j, j == G - 1, bars, it, lead, first, ctx)

    @T.macro
    def consumer(wg, k_s, q_s, accs, score, w_s, bars, bar_q, live_s, counters, g, ctx):
        """Consumer ``wg``: the passes' blocks, then ``-inf`` past each pass's live blocks."""
        rows_s, scores, t0 = ctx[0], ctx[3], ctx[4]
        done, nb = counters
        T.set_max_nreg(consumer_regs, 1)
        for slot in T.unroll(slots, explicit=True):
            T.barrier_arrive(bars[0][slot])
        T.barrier_wait(bar_q, 0)
        done[0] = 0
        c0 = g * blocks * BN
        for p in T.serial(G):
            # a pass per run of equal rows: it leads where its row differs from the last
            if rows_s[p] >= 0 and (p == 0 or rows_s[p] != rows_s[T.max(p - 1, 0)]):
                nb[0] = live_blocks(live_s[p], c0)
                for b in T.serial(nb[0]):
                    first = c0 + b * span + wg * HALF
                    consume(wg, k_s, q_s, accs, score, w_s, bars, done[0] + b, rows_s[p], first, ctx)
                done[0] = done[0] + nb[0]
                for b in T.serial(nb[0], ring_blocks):
                    for j in T.serial(G):
                        if rows_s[j] == rows_s[p]:
                            for i in T.Parallel(HALF):
                                c = c0 + b * span + wg * HALF + i
                                if c < n_cand:
                                    scores[t0 + j, c] = -T.infinity(acc_t)

    @T.macro
    def producer(k_s, q_s, q, flat, rows, bars, bar_q, setup, counters, g, t0, pages, block_table, kst):
        """The producer: the queries, then every pass's live blocks through the ring."""
        rows_s, live_s = setup
        done, nb = counters
        T.set_max_nreg(producer_regs, 0)
        p = T.get_thread_binding() - 128 * consumers
        load_queries(q_s, q, t0, p, bar_q)
        done[0] = 0
        c0 = g * blocks * BN
        for pp in T.serial(G):
            if rows_s[pp] >= 0 and (pp == 0 or rows_s[pp] != rows_s[T.max(pp - 1, 0)]):
                page_row = T.Cast("int32", rows_s[pp])
                nb[0] = live_blocks(live_s[pp], c0)
                for b in T.serial(nb[0]):
                    source = (page_row, live_s[pp], pages, block_table, kst)
                    produce(k_s, flat, rows, bars, done[0] + b, c0 + b * span, *source, p)
                done[0] = done[0] + nb[0]

    @T.macro
    def kernel(
        q, w, flat, block_table, token_rows, counts, scores, kst, scale, max_count, epp, epp_magic, epp_shift
    ):
        grid = (T.ceildiv(n_cand, BN * blocks), T.ceildiv(n_tok, G))
        with T.Kernel(*grid, threads=threads) as (g, tg):
            q_s = T.alloc_shared((G, H, D), dtype)
            w_s = T.alloc_shared((G, H), acc_t)
            k_s = T.alloc_shared((slots, consumers, HALF, D), dtype)
            rows_s = T.alloc_shared((G,), "int64", scope="shared")
            cnt_s = T.alloc_shared((G,), "int64", scope="shared")
            live_s = T.alloc_shared((G,), "int64", scope="shared")
            rows = T.alloc_local((passes,), "int32")  # the producer's rows of a block
            accs0 = [T.alloc_fragment((HALF, H), acc_t) for _ in range(G)]
            accs1 = [T.alloc_fragment((HALF, H), acc_t) for _ in range(G)] if consumers == 2 else []
            score0 = T.alloc_fragment((HALF,), acc_t)
            score1 = T.alloc_fragment((HALF,), acc_t) if consumers == 2 else None
            # the CTA's blocks before this pass (the ring's phases), the pass's live blocks
            counters = (T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32"))
            bar_q = T.alloc_barrier(arrive_count=128)
            bar_ready = T.alloc_barrier(arrive_count=[128] * slots)
            bar_free = T.alloc_barrier(arrive_count=[128 * consumers] * slots)
            bars = (bar_free, bar_ready)
            t0 = tg * G
            if consumers == 1:  # two CTAs an SM (launched with 128 registers a thread)
                T.annotate_min_blocks_per_sm(2)
            if pdl:  # every input comes from the kernels before
                start()
            for j, h in T.Parallel(G, H):
                w_s[j, h] = w[T.min(t0 + j, n_tok - 1), h]
            load_rows(rows_s, cnt_s, live_s, token_rows, counts, t0, max_count)
            pages = (epp, epp_magic, epp_shift)
            ctx = (rows_s, cnt_s, scale, scores, t0, pages, block_table)
            tx = T.get_thread_binding()
            source = (pages, block_table, kst)
            if consumers == 2:
                if tx >= 256:
                    producer(k_s, q_s, q, flat, rows, bars, bar_q, (rows_s, live_s), counters, g, t0, *source)
                elif tx < 128:
                    consumer(0, k_s, q_s, accs0, score0, w_s, bars, bar_q, live_s, counters, g, ctx)
                else:
                    consumer(1, k_s, q_s, accs1, score1, w_s, bars, bar_q, live_s, counters, g, ctx)
            elif tx >= 128:  # one consumer, two CTAs an SM
                producer(k_s, q_s, q, flat, rows, bars, bar_q, (rows_s, live_s), counters, g, t0, *source)
            else:
                consumer(0, k_s, q_s, accs0, score0, w_s, bars, bar_q, live_s, counters, g, ctx)

    sizes = (n_tok, n_cand, nf, r_bt, p_bt, t2, t3)
    return grouped_scores_func("indexer_scores_grouped_ws", H, D, dtype, sizes, kernel)


@functools.cache
@logged_compile("indexer_grouped_ws")
def _kernel(
    heads: int,
    dim: int,
    dtype: str,
    blocks: int,
    group: int,
    pdl: bool,
    slots: int,
    consumers: int = CONSUMERS,
):
    """A compiled kernel of :func:`build_specialized_scores` (TileLang's disk cache keeps it);
    bounds guards off, as the grouped kernel's (the copies read the pool through a flat view)."""
    import tilelang

    configs = {"tl.disable_safe_memory_legalize": True}
    func = build_specialized_scores(heads, dim, dtype, blocks, group, pdl, slots, consumers)
    return tilelang.compile(func, out_idx=None, target=cuda_target(), pass_configs=configs)
