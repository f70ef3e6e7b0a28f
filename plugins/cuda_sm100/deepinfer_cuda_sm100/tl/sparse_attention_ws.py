"""``sparse_attention`` with FlashMLA's "seesaw" schedule on SM90, plain pools (bf16 / fp16) and
packed FP8 ones: the dispatcher's language ``"tilelang_ws"`` (:mod:`deepinfer_cuda_sm100.attention_dispatch`),
taken where the measured table found it the fastest.

One CTA per (query token, split, head block of 64), 384 threads, keys in blocks of ``BNW = 32``:

- a producer warpgroup (threads 256..383, 72 registers) gathers the blocks into a four-slot ring
  (two iterations in flight: iteration ``it``'s blocks go to slots ``2 (it % 2) + g``) by 16-byte
  ``cp.async`` copies completing on an mbarrier (``bar_ready[slot]``); it waits for
  ``bar_free[slot]`` (both consumers done with the slot) before refilling it, so the next
  iteration's gathers overlap this one's GEMMs.  It computes each row's address itself (the
  compacted explicit rows, then the paged entries through the block table, an entry's page
  and slot by :mod:`~deepinfer_cuda_sm100.tl.page_division`'s multiply and shift); a row past the
  sequence (or past this split) loads the lowest pool's first row instead (finite data, never
  garbage in the tile), and the consumers mask it from its place in the sequence.
- consumer 0 (threads 0..127) takes the even blocks, consumer 1 (128..255) the odd ones.  Each
  computes its block's logits ``[64 heads, 32 keys]`` (one wgmma GEMM, K = D), its row maxima,
  exchanges them with the other consumer through shared memory and two mbarriers, so that both
  use the maximum over both blocks; each rescales its half of the ``[64, D]`` output
  accumulator (consumer 0: values ``0 .. D/2``, consumer 1: ``D/2 .. D``), writes its
  probabilities (bf16) to ``p_s[g]`` and multiplies its own block's and then the other
  consumer's probabilities into its half of the output.  One consumer's softmax thus overlaps
  the other's GEMMs, and no block barrier is needed inside the loop.
- the denominators: each consumer sums its own blocks' probabilities (the sink's share starts
  in consumer 0), and the two sums are exchanged once at the end; the output is the
  accumulator times one reciprocal a row (not an IEEE division an output: half the kernel's
  code, 6,857 SASS instructions against 3,401 on plain pools, offline for sm_90a).

Shared memory: the queries (64 KB at D = 512), the ring (4 x 32 KB), the probabilities (8 KB).

Packed FP8 pools (:class:`~deepinfer_core.ops.kv_format.Fp8KVPool`, the row layout of
:func:`fp8_supports`): the producer alone dequantises, as FlashMLA's SM90 FP8 decode does.  Four
of its threads take a row: each fetches its quarter of the row's 8-byte words (nope bytes and
bfloat16 rope values, interleaved ``4 k + quarter``) and the word of the scale bytes into
registers by plain 8-byte loads, two blocks in flight: a block's words are fetched as soon as
its slot's previous block is converted, and its rows' indices an iteration ahead.
Each word of 8 nope bytes becomes 8 bfloat16 values in one 16-byte shared store, by integer
and bfloat16 operations rather than conversion instructions (which run at a quarter of the
rate and made the producer the bottleneck): each byte's bits placed as a bfloat16 that is
exactly its value times ``2**-120`` (normal and subnormal e4m3 alike), times ``2**120``, then
times ``2**(scale byte - 127)`` (its bits built from the byte), rounded once to bfloat16: what
:func:`~deepinfer_core.ops.kv_format.dequantize_fp8_rows` computes (the NaN byte, which the
quantiser never writes, reads as 480 instead); a rope word is stored as it is, and
``fence.proxy.async`` makes the stores visible to the consumers' wgmma before the slot's
arrival.  Registers: producer 120, consumers 192 (two blocks of words in flight a producer
thread, :attr:`Schedule.words_in_flight`).

:class:`Schedule` variants (one block of words in flight, one multiply a value pair, a lazy
rescale of the output, the output stored from registers, L2 prefetches) promise the default's
bits;
``bench_attention.py --tune`` times them, the op runs :data:`DEFAULT` (on packed pools with
the rows prefetched into L2 ahead of the producer's slot waits, :attr:`Schedule.l2_prefetch`).

Split-KV as :mod:`deepinfer_cuda_sm100.tl.sparse_attention`: split ``s`` takes blocks
``lo .. hi`` of the sequence and writes fp32 partials ``(acc, m, l)``; the same combine kernel
merges them.  Its own plan (:func:`plan_splits`) splits less: to at most :data:`SPLIT_CTAS`
CTAs, and short key lists less still (:data:`FEW_KEYS`).
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as objects.
import functools
from dataclasses import dataclass

import torch

from . import sparse_attention as sa
from .compile_log import logged_compile
from .page_division import page_and_slot
from .pdl import prologue
from .sparse_attention import BH, LOG2E
from .target import cuda_target

BNW = 32  # keys a block
SLOTS = 4  # ring slots: two iterations of the two consumers
THREADS = 384
CONSUMER_REGS = 216
PRODUCER_REGS = 72
FP8_CONSUMER_REGS = 200
FP8_PRODUCER_REGS = 104  # the words of a block in flight, the dequantisation
FP8_TWO_BLOCKS_REGS = (120, 192)  # (producer, consumers) with two blocks of words in flight
FP8_ROW_THREADS = 4  # producer threads a packed row


@dataclass(frozen=True)
class Schedule:
    """Variants of the kernel's schedule, each bitwise the default's result (``bench_attention.py
    --tune`` times them against it and checks the bits; the op runs :data:`DEFAULT`).

    Attributes:
        words_in_flight: packed pools: blocks of words a producer thread has in flight, 2 (the
            default: a block's words fetched as soon as its slot's previous block is converted;
            120 producer and 192 consumer registers) or 1 (the next block fetched once the
            previous one is converted; 104 and 200).  Measured on an H200 (FP8 CSA, 4k context):
            two blocks 0.0962 ms against 0.1078 at 256 decode tokens, 1.4645 against 1.5569 at
            an 8,192-token prefill chunk.
        vector_words: packed pools (rows starting on 16 bytes, as
            :data:`~deepinfer_core.ops.kv_format.ROW_ALIGN` lays them out): a producer thread
            fetches its data words two at a time, one 16-byte load for words ``2c, 2c + 1`` of
            its chunks ``c = 4 k + quarter`` (16 nope values, so that its ``k``-th chunk lies
            in scale group ``k``, or 8 rope values), where the default takes one 8-byte load a
            word: half the load instructions, and a rope chunk goes to shared memory in one
            16-byte store.  An H100 profile of the default at 64 decode tokens (64k context)
            had 17 % of its warp samples waiting for the memory-instruction queue
            (``lg_throttle``), all in the producer's word loads.  The same words converted the
            same way, so the same bits; the host refuses pools whose rows do not start on 16
            bytes.  Built for sm_90 offline: 36 16-byte loads and 3 8-byte ones in the
            producer where the default has 57 8-byte ones, the same 168 registers, and no
            stack on paged calls (the default spills 8 bytes there).
        one_multiply: packed pools: one bf16x2 multiply a value pair where the group's scale
            allows (scale byte 0..134: 2**(byte - 7) is a bfloat16) instead of two.
        lazy_rescale: a consumer rescales its output rows only where its row maxima grew (a
            factor of exactly 1 otherwise: a warp whose rows all kept their maxima skips it).
        staged_store: unsplit calls: each consumer writes its half of the output into the
            queries' shared memory (free once the final statistics are exchanged: both
            consumers' last GEMMs have completed), syncs its warpgroup, and copies the half out
            in 16-byte row segments (a warp's store: 512 contiguous bytes; the default), or
            (``False``) stores its accumulator fragment directly (4 bytes a store, eight rows a
            warp's store).  Measured on an H100 (CSA, 4k context): staged 0.0881 ms against
            0.0968 at 256 decode tokens, 0.0505 against 0.0547 at 128, 1.0363 against 1.1856
            at an 8,192-token prefill chunk; split calls (64 tokens) write fp32 partials
            either way.
        l2_prefetch: plain pools: iterations ahead the producer prefetches rows into L2, each
            of a row's eight threads one 128-byte line (``prefetch.global.L2``), at the top of
            each iteration before it waits for the iteration's slots: 1, that iteration's rows
            (their addresses from the indices loaded an iteration earlier, as the copies take
            them); 2, the next iteration's (their indices loaded an iteration earlier still,
            so the index loads run twice); 0, none.  The ring holds two
            iterations, so the copies of iteration ``i`` start only when the consumers have
            finished iteration ``i - 2``; a prefetch starts the rows' DRAM reads one or two
            iterations earlier and the copies then read L2 (an H100 profile of 64-token calls:
            the consumers wait on full slots, DRAM at 52 % of its peak).  The same copies of
            the same rows, so the same bits.  Packed pools with two blocks of words in flight
            (the default :attr:`words_in_flight`): at 1 the rows whose words the producer
            loads after the iteration's slot waits, their lines into L2 before the waits (a
            row's four threads a line each, two of them a fifth and the scale word's line); at
            2 the next iteration's rows (their indices from a second set of index loads, an
            iteration earlier still), the first iteration also its own: a block's words are
            fetched one block's conversion before they are converted, so at 1 that is all the
            time its DRAM reads get, at 2 an iteration more; with one block in flight, none.
            Built for sm_90 without spills except on paged calls: 64 bytes of the producer's
            stack at 2 ahead on plain pools, 8 on packed ones at 1 and 24 at 2.  ``None`` (the
            default): 1 on packed pools (two blocks of words in flight), 0 on plain ones
            (:meth:`prefetch`).  Measured on an H100
            (``bench_attention.py --tune``, 64k context, 640 keys a token): on packed pools
            3.4-5.2 % faster at 64 and 128 tokens
            (CSA 0.0423 against 0.0438 ms at 64, 0.0460 against 0.0485 at 128; HCA 0.0376
            against 0.0396 at 64); on plain pools 1 gained nothing (0.0351 against 0.0358 ms,
            HCA at 64 tokens; 0.0510 against 0.0507, CSA at 128) and 2 was 10-20 % slower:
            there the copies' addresses are known an iteration ahead already.
        next_queries: grids of more than one wave (a prefill chunk, 256 decode tokens): once
            its own queries are requested, the producer prefetches into L2 the queries of the
            CTA one wave later in launch order (its linear index plus the SM count,
            ``%nsmid``; one CTA an SM), 64 KB, four 128-byte lines a thread, so that CTA's
            query load reads L2 instead of DRAM at its start, where nothing else hides it.  A
            prefetch only, so the same bits.  Built for sm_90 without spills except 8 bytes of
            the producer's stack on direct paged calls of packed pools.  Measured on an H100 at
            64 and 128 decode tokens (64k context): within 4 % of the default either way (CSA
            plain, 128 tokens: 0.0503 against 0.0507 ms; HCA plain, 64: 0.0374 against
            0.0358), hence off.

    A variant in which the kernel compacted its index lists itself (every thread loading its
    token's rows at once, warp ballots placing the valid ones in shared memory, so no prologue
    launch) was bit for bit the default on an H100 and no faster (CSA at 64k context, 32 / 64
    tokens: 0.0255 / 0.0342 ms against 0.0255 / 0.0349 on plain pools, 0.0300 / 0.0410 against
    0.0301 / 0.0408 on FP8 ones): under PDL the kernel is launched while the prologue runs, so
    the prologue's 3.1 us of device time a call were mostly hidden already.  It was removed.
    """

    words_in_flight: int = 2
    vector_words: bool = False
    one_multiply: bool = False
    lazy_rescale: bool = False
    staged_store: bool = True
    l2_prefetch: int | None = None
    next_queries: bool = False

    def prefetch(self, packed: bool) -> int:
        """:attr:`l2_prefetch` on plain (``packed=False``) or packed pools, its default
        (``None``) resolved: 1 on packed pools with two blocks of words in flight (where it
        applies), else 0."""
        if self.l2_prefetch is not None:
            return self.l2_prefetch
        return 1 if packed and self.words_in_flight == 2 else 0


DEFAULT = Schedule()
"""The schedule the op runs."""

FP8_DEVICE_CODE = r"""
__device__ __forceinline__ void deepinfer_e4m3x8_store(void* dst, long long word, long long scales,
                                                       int shift) {
  // 8 e4m3 bytes (little-endian: value 0 lowest) times 2**(scale byte - 127) as 8 bfloat16 values
  // in one 16-byte shared store, by integer and bfloat16 operations (no conversion instructions):
  // a byte's sign and its 7 other bits placed as a bfloat16's sign and low bits (exponent field
  // 0000eeee, mantissa mmm0000) read as exactly the e4m3 value times 2**-120, normal and
  // subnormal alike; times 2**120 (exact), then times 2**(byte - 127), its bits byte << 7 (byte 0
  // -> 0.0), rounded once: what dequantize_fp8_rows computes in float32, then rounds to bfloat16
  const unsigned byte = (unsigned)((unsigned long long)scales >> shift) & 255u;
  const unsigned factor = (byte << 7) | (byte << 23);
  const unsigned two120 = 0x7B807B80u;
  const unsigned halves[2] = {(unsigned)word, (unsigned)((unsigned long long)word >> 32)};
  unsigned out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned x = __byte_perm(halves[i >> 1], 0u, (i & 1) ? 0x3424u : 0x1404u);  // b1 << 24 | b0 << 8
    const unsigned bits = (x & 0x80008000u) | ((x >> 4) & 0x07F007F0u);
    unsigned exact;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(exact) : "r"(bits), "r"(two120));
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out[i]) : "r"(exact), "r"(factor));
  }
  const unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(out[0]), "r"(out[1]), "r"(out[2]), "r"(out[3]) : "memory");
}

__device__ __forceinline__ void deepinfer_load16(int64_t* dst, const void* src) {
  // two 8-byte words of a packed row by one 16-byte load (the row starts on 16 bytes)
  const longlong2 v = *reinterpret_cast<const longlong2*>(src);
  dst[0] = v.x;
  dst[1] = v.y;
}

__device__ __forceinline__ void deepinfer_store16(void* dst, long long lo, long long hi) {
  // 16 bytes (8 bfloat16 rope values) as they are
  const unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("st.shared.v2.b64 [%0], {%1, %2};" :: "r"(addr), "l"(lo), "l"(hi) : "memory");
}

__device__ __forceinline__ void deepinfer_store8(void* dst, long long word) {
  // 8 bytes (4 bfloat16 rope values) as they are
  const unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("st.shared.b64 [%0], %1;" :: "r"(addr), "l"(word) : "memory");
}
"""

FP8_FUSED_CODE = r"""
__device__ __forceinline__ void deepinfer_e4m3x8_store_fused(void* dst, long long word, long long scales,
                                                             int shift) {
  // deepinfer_e4m3x8_store with one multiply a pair where 2**(byte - 7) is a bfloat16 (byte
  // 1..134; byte 0: 0.0): the same exact product, rounded once, so the same bits
  const unsigned byte = (unsigned)((unsigned long long)scales >> shift) & 255u;
  if (byte > 134u) {
    deepinfer_e4m3x8_store(dst, word, scales, shift);
    return;
  }
  const unsigned e = byte ? byte + 120u : 0u;
  const unsigned factor = (e << 7) | (e << 23);
  const unsigned halves[2] = {(unsigned)word, (unsigned)((unsigned long long)word >> 32)};
  unsigned out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned x = __byte_perm(halves[i >> 1], 0u, (i & 1) ? 0x3424u : 0x1404u);
    const unsigned bits = (x & 0x80008000u) | ((x >> 4) & 0x07F007F0u);
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out[i]) : "r"(bits), "r"(factor));
  }
  const unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "r"(addr), "r"(out[0]), "r"(out[1]), "r"(out[2]), "r"(out[3]) : "memory");
}
"""
"""The device function of :attr:`Schedule.one_multiply` (after :data:`FP8_DEVICE_CODE`)."""

PREFETCH_DEVICE_CODE = r"""
__device__ __forceinline__ void deepinfer_prefetch_l2(const void* line) {
  // the 128-byte line at this address into L2, no wait (each thread its own address: no
  // uniform-register loop, as a bulk prefetch of a row per thread would take)
  asm volatile("prefetch.global.L2 [%0];" :: "l"(line) : "memory");
}
"""
"""The device function of :attr:`Schedule.l2_prefetch` and :attr:`Schedule.next_queries`: a
128-byte line into L2."""

SM_COUNT_DEVICE_CODE = r"""
__device__ __forceinline__ int deepinfer_sm_count() {
  // the SM identifiers (%nsmid): a wave of one-CTA-an-SM launches
  unsigned n;
  asm volatile("mov.u32 %0, %%nsmid;" : "=r"(n));
  return (int)n;
}
"""
"""The device function of :attr:`Schedule.next_queries`: the SM count (``%nsmid``)."""


def build_attention_ws(
    paged: bool,
    split: bool,
    heads: int,
    dim: int,
    dtype: str,
    fp8: sa.Fp8Geometry | None = None,
    pdl: bool = False,
    schedule: Schedule = DEFAULT,
):
    """The ``prim_func`` (same arguments as ``build_attention(paged, split, heads, dim, dtype,
    fp8, pdl)``; ``fp8``: packed pools of that row geometry, which :func:`fp8_supports` accepts;
    ``pdl``: the PDL prologue first; ``schedule``: a variant of :class:`Schedule`)."""
    import tilelang.language as T

    start = prologue()

    acc_t = "float32"
    H, D = heads, dim
    HALF = D // 2
    n_tok, n_split = T.dynamic("T"), T.dynamic("S")
    t_out, t_part, ke = T.dynamic("TO"), T.dynamic("TP"), T.dynamic("KE")
    t2, r_bt, p_bt, nf = T.dynamic("T2"), T.dynamic("R"), T.dynamic("P"), T.dynamic("NF")
    VEC = 8  # elements a 16-byte copy moves
    Q_ROW_THREADS = 8  # producer threads a query row: each copies every 64th element group
    # key rows: 8 threads a plain row (16-byte copies), 4 a packed row (8-byte words)
    ROW_THREADS = Q_ROW_THREADS if fp8 is None else FP8_ROW_THREADS
    ROWS_AT_ONCE = 128 // ROW_THREADS  # rows a pass: BNW / ROWS_AT_ONCE passes a block
    PASSES = BNW // ROWS_AT_ONCE
    producer_regs, consumer_regs = registers(fp8, schedule)
    prefetch = schedule.prefetch(fp8 is not None)  # (a plain value: the macros read it as one)
    if fp8 is not None and schedule.vector_words and (fp8.nope % 64 or (D - fp8.nope) * 2 % 64):
        raise ValueError(f"vector_words takes nope and rope parts of 64-byte multiples, got {fp8}")
    if fp8 is not None:
        NOPE_W, ROPE_W = fp8.nope // 8, (D - fp8.nope) // 4  # 8-byte words of a packed row
        WORDS = (NOPE_W + ROPE_W) // FP8_ROW_THREADS  # a thread's data words of a row
        SCALE_WORD, FIRST = fp8.scale_offset // 8, fp8.scale_offset % 8

    @T.macro
    def load_rows(raw, first, rows):
        """The producer's next iteration: each of its rows' index loads (the compacted row and,
        paged, the block-table entry) issued together, clamped in range, and kept as loaded
        (the compacted rows int32): nothing uses a loaded value before :func:`offset_of` does,
        after the wait for the slots, so their latency overlaps that wait."""
        t, page_row, n0, n01, n_expl, j_end, compact, block_table, bases, strides, pages, p = rows
        compact_rows, paged_rows = raw
        ke, p_bt = compact.shape[1], block_table.shape[1]
        for k in T.unroll(2 * PASSES, explicit=True):
            j = first + (k // PASSES) * BNW + (k % PASSES) * ROWS_AT_ONCE + p // ROW_THREADS
            compact_rows[k] = compact[t, T.max(T.min(j, ke - 1), 0)]
            if paged:
                page, _ = page_and_slot(j - n_expl, *pages)
                paged_rows[k] = block_table[page_row, T.max(T.min(page, p_bt - 1), 0)]

    @T.macro
    def offset_of(offs, raw, k, j, rows):
        """``offs[k]`` = row ``j`` of the sequence's element offset in the flat pool view (a row
        past this split's keys reads the lowest pool's first row), from :func:`load_rows`."""
        t, page_row, n0, n01, n_expl, j_end, compact, block_table, bases, strides, pages, p = rows
        compact_rows, paged_rows = raw
        _, slot = page_and_slot(j - n_expl, *pages)
        wide = T.Cast("int64", compact_rows[k])  # widened here, an iteration after its load
        row = T.if_then_else(j < n_expl, wide, paged_rows[k] * pages[0] + slot) if paged else wide
        later = T.if_then_else(j < n01, bases[1] + row * strides[1], bases[2] + row * strides[2])
        here = T.if_then_else(j < n0, bases[0] + row * strides[0], later)
        offs[k] = T.if_then_else(j < j_end, here, bases[0])

    @T.macro
    def rescale(acc_o, m, m_prev, grew):
        """:attr:`Schedule.lazy_rescale`: the thread's output rows times their factors only where
        one of its rows' maxima grew (the others' factor is exactly 1)."""
        grew[0] = 0
        for h in T.Parallel(BH):
            grew[0] = grew[0] | T.Cast("int32", m[h] != m_prev[h])
        if grew[0] != 0:
            for h, d in T.Parallel(BH, HALF):
                acc_o[h, d] = acc_o[h, d] * T.exp2(m_prev[h] - m[h])

    @T.macro
    def step(g, it, own, peer, seq, smem, frags, bars, scale2, grew):
        """Consumer ``g``'s iteration ``it``: its block in slot ``own``, the other's in ``peer``."""
        t, s, hb, n_iter, lo, j_end = seq
        q_s, k_s, p_s, row_max, row_sum = smem
        acc_o, acc_s, m, m_prev, m_peer, l, l_i = frags
        bar_q, bar_ready, bar_free, bar_stats, bar_p = bars
        T.barrier_wait(bar_ready[own], (it >> 1) & 1)
        T.clear(acc_s)
        T.wgmma_gemm(q_s, k_s[own, :, :], acc_s, transpose_B=True)
        T.copy(m, m_prev)
        T.wait_wgmma(0)
        for h, i in T.Parallel(BH, BNW):
            j = (lo + 2 * it + g) * BNW + i  # the key's place in the sequence: past j_end masked
            acc_s[h, i] = T.if_then_else(j < j_end, acc_s[h, i] * scale2, -T.infinity(acc_t))
        T.reduce_max(acc_s, m, dim=1, clear=False)
        T.copy(m, row_max[g, :])
        T.barrier_arrive(bar_stats[g])
        T.barrier_wait(bar_stats[1 - g], it & 1)
        T.copy(row_max[1 - g, :], m_peer)
        for h in T.Parallel(BH):
            m[h] = T.max(m[h], m_peer[h])
        if schedule.lazy_rescale:
            rescale(acc_o, m, m_prev, grew)
        else:
            for h, d in T.Parallel(BH, HALF):
                acc_o[h, d] = acc_o[h, d] * T.exp2(m_prev[h] - m[h])
        for h in T.Parallel(BH):
            l[h] = l[h] * T.exp2(m_prev[h] - m[h])
        for h, i in T.Parallel(BH, BNW):
            acc_s[h, i] = T.exp2(acc_s[h, i] - m[h])
        T.reduce_sum(acc_s, l_i, dim=1)
        for h in T.Parallel(BH):
            l[h] = l[h] + l_i[h]
        T.copy(acc_s, p_s[g, :, :])
        T.fence_proxy_async()  # the stores visible to the other consumer's wgmma (async proxy)
        T.barrier_arrive(bar_p[g])
        T.wgmma_gemm(p_s[g, :, :], k_s[own, :, g * HALF : g * HALF + HALF], acc_o)
        T.barrier_wait(bar_p[1 - g], it & 1)
        T.wgmma_gemm(p_s[1 - g, :, :], k_s[peer, :, g * HALF : g * HALF + HALF], acc_o)
        T.wait_wgmma(1)
        T.barrier_arrive(bar_free[own])
        T.wait_wgmma(0)
        T.barrier_arrive(bar_free[peer])

    @T.macro
    def store_staged(g, q_s, acc_o, l, out, t, hb):
        """:attr:`Schedule.staged_store`: consumer ``g``'s normalised half of the output through
        its half of ``q_s``, then out in 16-byte segments (a warp a row's half, each thread
        every 128th segment).  TileLang's sync pass orders the shared stores and reads by a
        barrier of the consumer's own 128 threads (``bar.sync id, 128``): the producer, which
        has exited by then, takes no part."""
        for h, d in T.Parallel(BH, HALF):
            q_s[h, g * HALF + d] = acc_o[h, d] * l[h]
        lane = T.get_thread_binding() - g * 128
        SEGMENTS = HALF // VEC  # 16-byte segments of a row's half
        for r in T.unroll(BH * SEGMENTS // 128, explicit=True):
            h = (r * 128 + lane) // SEGMENTS
            c = g * HALF + (r * 128 + lane) % SEGMENTS * VEC
            for v in T.vectorized(VEC):
                out[t, hb * BH + h, c + v] = q_s[h, c + v]

    @T.macro
    def consumer(g, seq, smem, frags, bars, io):
        """Consumer ``g`` (its own thread range: TileLang lays its fragments over its 128 threads):
        slot ``g``'s blocks, output values ``g * HALF ..``."""
        t, s, hb, n_iter, lo, j_end = seq
        q_s, k_s, p_s, row_max, row_sum = smem
        sinks, scale2, out, part, ml = io
        acc_o, acc_s, m, m_prev, m_peer, l, l_i = frags
        bar_q, bar_ready, bar_free, bar_stats, bar_p = bars
        T.set_max_nreg(consumer_regs, 1)
        T.barrier_wait(bar_q, 0)
        for slot in T.unroll(SLOTS, explicit=True):
            T.barrier_arrive(bar_free[slot])
        T.fill(acc_o, 0)
        for h in T.Parallel(BH):  # split 0 starts from the sink (its share in consumer 0)
            m[h] = T.if_then_else(s == 0, sinks[hb * BH + h] * LOG2E, -1e30)
            l[h] = T.if_then_else(s == 0, 1.0 if g == 0 else 0.0, 0.0)
        grew = T.alloc_local((1,), "int32")  # :func:`rescale`'s flag
        for it in T.serial(n_iter):
            step(g, it, (it % 2) * 2 + g, (it % 2) * 2 + 1 - g, seq, smem, frags, bars, scale2, grew)
        T.copy(l, row_sum[g, :])
        T.barrier_arrive(bar_stats[g])
        T.barrier_wait(bar_stats[1 - g], n_iter & 1)
        T.copy(row_sum[1 - g, :], l_i)
        for h in T.Parallel(BH):
            l[h] = l[h] + l_i[h]
        if split:
            for h, d in T.Parallel(BH, HALF):
                part[t, s, hb * BH + h, g * HALF + d] = acc_o[h, d]
            if g == 0:
                for h in T.Parallel(BH):
                    ml[t, s, hb * BH + h, 0] = m[h]
                    ml[t, s, hb * BH + h, 1] = l[h]
        else:
            for h in T.Parallel(BH):  # one reciprocal a row, not an IEEE division an output
                l[h] = 1.0 / l[h]
            if schedule.staged_store:
                store_staged(g, q_s, acc_o, l, out, t, hb)
            else:
                for h, d in T.Parallel(BH, HALF):
                    out[t, hb * BH + h, g * HALF + d] = acc_o[h, d] * l[h]

    @T.macro
    def queries(q_s, q, t, hb, p):
        """The producer's ``cp.async`` copies of the CTA's ``[64, D]`` queries."""
        for r in T.unroll(BH * Q_ROW_THREADS // 128, explicit=True):
            h = r * (128 // Q_ROW_THREADS) + p // Q_ROW_THREADS
            for u in T.unroll(D // (VEC * Q_ROW_THREADS)):
                c = (u * Q_ROW_THREADS + p % Q_ROW_THREADS) * VEC
                T.ptx_cp_async(
                    T.access_ptr(q_s[h, c], "w", VEC), T.access_ptr(q[t, hb * BH + h, c], "r", VEC), VEC
                )

    @T.macro
    def next_queries(q, t, s, hb, p):
        """:attr:`Schedule.next_queries`: the queries of the CTA one wave later in launch order
        (x fastest: token, then split, then head block) into L2, where it exists."""
        later = t + n_tok * (s + n_split * hb) + T.call_extern("int32", "deepinfer_sm_count")
        t_next, rest = later % n_tok, later // n_tok
        hb_next = rest // n_split
        if hb_next < H // BH:
            for r in T.unroll(BH * D // 64 // 128, explicit=True):  # 128-byte lines (64 values)
                line = (r * 128 + p) * 64
                head, col = hb_next * BH + line // D, line % D
                T.call_extern("handle", "deepinfer_prefetch_l2", T.access_ptr(q[t_next, head, col], "r", 1))

    @T.macro
    def addresses(offs, raw, first, rows, p):
        """The producer's rows of blocks ``first`` and ``first + 1`` (their indices in ``raw``)
        as flat offsets in ``offs``, all before any copy (:attr:`Schedule.l2_prefetch`)."""
        for g2 in T.unroll(2, explicit=True):
            for r in T.unroll(PASSES, explicit=True):
                i = r * ROWS_AT_ONCE + p // ROW_THREADS
                offset_of(offs, raw, g2 * PASSES + r, (first + g2) * BNW + i, rows)

    @T.macro
    def prefetch_lines(flat, offs, p):
        """:attr:`Schedule.l2_prefetch`: the thread's 128-byte line (its place among a row's
        eight threads) of each of its rows at ``offs`` into L2."""
        line = p % ROW_THREADS * (D // ROW_THREADS)
        for k in T.unroll(2 * PASSES, explicit=True):
            T.call_extern("handle", "deepinfer_prefetch_l2", T.access_ptr(flat[offs[k] * 8 + line], "r", 1))

    @T.macro
    def produce_plain(flat, k_s, raw, offs, bars, n_iter, lo, rows, p):
        """Plain pools: each block's rows by 16-byte ``cp.async`` copies into its slot (with
        :attr:`Schedule.l2_prefetch`, their lines into L2 first)."""
        bar_q, bar_ready, bar_free, bar_stats, bar_p = bars
        ahead = prefetch
        if ahead == 2:  # the next iteration's indices, beside this one's
            raw2 = (
                T.alloc_local((2 * PASSES,), "int32"),
                T.alloc_local((2 * PASSES if paged else 1,), "int64"),
            )
            load_rows(raw2, (lo + 2) * BNW, rows)
        for it in T.serial(n_iter):
            if ahead == 1:  # this iteration's addresses first, then their lines into L2
                addresses(offs, raw, lo + 2 * it, rows, p)
                prefetch_lines(flat, offs, p)
            elif ahead == 2:  # the next iteration's, and the indices of the one after
                addresses(offs, raw2, lo + 2 * it + 2, rows, p)
                prefetch_lines(flat, offs, p)  # (offs: free until the copies below set it)
                load_rows(raw2, (lo + 2 * it + 4) * BNW, rows)
            for g2 in T.unroll(2, explicit=True):
                slot = (it % 2) * 2 + g2
                T.barrier_wait(bar_free[slot], (it >> 1) & 1)
                for r in T.unroll(PASSES, explicit=True):
                    i = r * ROWS_AT_ONCE + p // ROW_THREADS
                    k = g2 * PASSES + r
                    if ahead != 1:  # (at 1 computed above)
                        offset_of(offs, raw, k, (lo + 2 * it + g2) * BNW + i, rows)
                    for u in T.unroll(D // (VEC * ROW_THREADS)):
                        c = (u * ROW_THREADS + p % ROW_THREADS) * VEC
                        T.ptx_cp_async(
                            T.access_ptr(k_s[slot, i, c], "w", VEC),
                            T.access_ptr(flat[offs[k] * 8 + c], "r", VEC),
                            VEC,
                        )
                T.cp_async_barrier_noinc(bar_ready[slot])
            load_rows(raw, (lo + 2 * it + 2) * BNW, rows)  # the next iteration's

    @T.macro
    def fetch(words, flat64, offset, quarter):
        """A packed row's words of this thread: data words ``4 w + quarter``, then the scales'."""
        for w in T.unroll(WORDS, explicit=True):
            words[w] = flat64[offset + w * FP8_ROW_THREADS + quarter]
        words[WORDS] = flat64[offset + SCALE_WORD]

    @T.macro
    def convert(k_s, slot, i, words, quarter):
        """The fetched words into row ``i`` of the slot: nope words dequantised (8 values a
        16-byte store), rope words as they are.  The stores are the device functions' own (the
        pointers marked read: the slots' mbarriers order them, no block barrier)."""
        for w in T.unroll(NOPE_W // FP8_ROW_THREADS, explicit=True):
            word = w * FP8_ROW_THREADS + quarter
            T.call_extern(
                "handle",
                "deepinfer_e4m3x8_store_fused" if schedule.one_multiply else "deepinfer_e4m3x8_store",
                T.access_ptr(k_s[slot, i, word * 8], "r", 8),
                words[w],
                words[WORDS],
                (FIRST + word // 8) * 8,  # the word's scale byte: one a group of 64 values
            )
        for w in T.unroll(ROPE_W // FP8_ROW_THREADS, explicit=True):
            word = w * FP8_ROW_THREADS + quarter
            T.call_extern(
                "handle",
                "deepinfer_store8",
                T.access_ptr(k_s[slot, i, fp8.nope + word * 4], "r", 4),
                words[NOPE_W // FP8_ROW_THREADS + w],
            )

    @T.macro
    def fetch_vector(words, flat64, offset, quarter):
        """:attr:`Schedule.vector_words`: a packed row's words of this thread, chunk ``c = 4 k +
        quarter``'s two words (``2c``, ``2c + 1``) into ``words[2k]``, ``words[2k + 1]`` by one
        16-byte load, then the scales' word."""
        for k in T.unroll(WORDS // 2, explicit=True):
            c = k * FP8_ROW_THREADS + quarter
            T.call_extern(
                "handle",
                "deepinfer_load16",
                T.address_of(words[2 * k]),
                T.access_ptr(flat64[offset + 2 * c], "r", 2),
            )
        words[WORDS] = flat64[offset + SCALE_WORD]

    @T.macro
    def convert_vector(k_s, slot, i, words, quarter):
        """:func:`convert` for :func:`fetch_vector`'s words: chunk ``k``'s nope words are data
        words ``2c``, ``2c + 1`` of scale group ``k`` (8 values a 16-byte store each), its rope
        chunk the 8 rope values of words ``2c, 2c + 1`` in one 16-byte store."""
        for k in T.unroll(NOPE_W // 8, explicit=True):
            c = k * FP8_ROW_THREADS + quarter
            for h in T.unroll(2, explicit=True):
                T.call_extern(
                    "handle",
                    "deepinfer_e4m3x8_store_fused" if schedule.one_multiply else "deepinfer_e4m3x8_store",
                    T.access_ptr(k_s[slot, i, (2 * c + h) * 8], "r", 8),
                    words[2 * k + h],
                    words[WORDS],
                    (FIRST + k) * 8,  # the scale byte: a thread's k-th chunk lies in group k
                )
        for k in T.unroll(NOPE_W // 8, (NOPE_W + ROPE_W) // 8, explicit=True):
            c = k * FP8_ROW_THREADS + quarter
            T.call_extern(
                "handle",
                "deepinfer_store16",
                T.access_ptr(k_s[slot, i, fp8.nope + (2 * c - NOPE_W) * 4], "r", 8),
                words[2 * k],
                words[2 * k + 1],
            )

    # the producer's word loads and their conversion, by :attr:`Schedule.vector_words`
    fetch_words, convert_words = (fetch_vector, convert_vector) if schedule.vector_words else (fetch, convert)

    @T.macro
    def fill(k_s, slot, i, words, quarter, bar_ready):
        """Dequantise the fetched block into ``slot`` and mark the slot full."""
        convert_words(k_s, slot, i, words, quarter)
        T.fence_proxy_async()  # the generic-proxy stores visible to the consumers' wgmma
        T.barrier_arrive(bar_ready[slot])

    @T.macro
    def produce_fp8(flat64, k_s, raw, offs, bars, n_iter, lo, rows, p):
        """Packed FP8 pools: a block's words fetched into registers while the previous block's
        slot frees, dequantised into the slot (see the module docstring)."""
        bar_q, bar_ready, bar_free, bar_stats, bar_p = bars
        words = T.alloc_local((WORDS + 1,), "int64")
        i, quarter = p // FP8_ROW_THREADS, p % FP8_ROW_THREADS
        offset_of(offs, raw, 0, lo * BNW + i, rows)
        fetch_words(words, flat64, offs[0], quarter)
        for it in T.serial(n_iter):
            T.barrier_wait(bar_free[(it % 2) * 2], (it >> 1) & 1)
            fill(k_s, (it % 2) * 2, i, words, quarter, bar_ready)
            offset_of(offs, raw, 1, (lo + 2 * it + 1) * BNW + i, rows)
            fetch_words(words, flat64, offs[1], quarter)
            load_rows(raw, (lo + 2 * it + 2) * BNW, rows)  # the next iteration's rows
            T.barrier_wait(bar_free[(it % 2) * 2 + 1], (it >> 1) & 1)
            fill(k_s, (it % 2) * 2 + 1, i, words, quarter, bar_ready)
            offset_of(offs, raw, 0, (lo + 2 * it + 2) * BNW + i, rows)
            fetch_words(words, flat64, offs[0], quarter)  # (past the last block: the first row, unused)

    @T.macro
    def prefetch_packed(flat64, offset, quarter):
        """:attr:`Schedule.l2_prefetch` on packed pools: the lines of the packed row at word
        ``offset`` into L2, a row's four threads the first four (128 bytes = 16 words each),
        threads 0 and 1 also the fifth and the scale word's."""
        T.call_extern("handle", "deepinfer_prefetch_l2", T.access_ptr(flat64[offset + quarter * 16], "r", 1))
        if quarter < 2:
            tail = T.if_then_else(quarter == 0, 64, SCALE_WORD)
            T.call_extern("handle", "deepinfer_prefetch_l2", T.access_ptr(flat64[offset + tail], "r", 1))

    @T.macro
    def produce_fp8_two(flat64, k_s, raw, offs, bars, n_iter, lo, rows, p):
        """:func:`produce_fp8` with two blocks of words in flight a thread
        (:attr:`Schedule.words_in_flight`): a slot's next block is fetched as soon as its
        current one is converted, the rows' indices an iteration ahead."""
        bar_q, bar_ready, bar_free, bar_stats, bar_p = bars
        even = T.alloc_local((WORDS + 1,), "int64")
        odd = T.alloc_local((WORDS + 1,), "int64")
        i, quarter = p // FP8_ROW_THREADS, p % FP8_ROW_THREADS
        offset_of(offs, raw, 0, lo * BNW + i, rows)
        offset_of(offs, raw, 1, (lo + 1) * BNW + i, rows)
        fetch_words(even, flat64, offs[0], quarter)
        fetch_words(odd, flat64, offs[1], quarter)
        load_rows(raw, (lo + 2) * BNW, rows)  # iteration 1's rows
        if prefetch == 2:  # the rows a prefetch takes an iteration before the fetches: their indices
            raw2 = (
                T.alloc_local((2 * PASSES,), "int32"),
                T.alloc_local((2 * PASSES if paged else 1,), "int64"),
            )
            load_rows(raw2, (lo + 4) * BNW, rows)  # iteration 2's rows
        for it in T.serial(n_iter):
            if prefetch == 2:  # the next iteration's rows into L2, the indices of the one after
                offset_of(offs, raw2, 0, (lo + 2 * it + 4) * BNW + i, rows)
                offset_of(offs, raw2, 1, (lo + 2 * it + 5) * BNW + i, rows)
                for k in T.unroll(2, explicit=True):
                    prefetch_packed(flat64, offs[k], quarter)
                load_rows(raw2, (lo + 2 * it + 6) * BNW, rows)
            offset_of(offs, raw, 0, (lo + 2 * it + 2) * BNW + i, rows)
            offset_of(offs, raw, 1, (lo + 2 * it + 3) * BNW + i, rows)
            if prefetch == 1:  # the rows fetched after this iteration's slot waits
                for k in T.unroll(2, explicit=True):
                    prefetch_packed(flat64, offs[k], quarter)
            elif prefetch == 2:  # noqa: SIM102 (a Python constant, then a TIR condition)
                if it == 0:  # (later iterations' rows went into L2 an iteration earlier)
                    for k in T.unroll(2, explicit=True):
                        prefetch_packed(flat64, offs[k], quarter)
            load_rows(raw, (lo + 2 * it + 4) * BNW, rows)  # two iterations ahead
            T.barrier_wait(bar_free[(it % 2) * 2], (it >> 1) & 1)
            fill(k_s, (it % 2) * 2, i, even, quarter, bar_ready)
            fetch_words(even, flat64, offs[0], quarter)  # (past the last block: the first row, unused)
            T.barrier_wait(bar_free[(it % 2) * 2 + 1], (it >> 1) & 1)
            fill(k_s, (it % 2) * 2 + 1, i, odd, quarter, bar_ready)
            fetch_words(odd, flat64, offs[1], quarter)

    @T.macro
    def body(q, pool, compact, nvalid, block_table, token_rows, io, bases, strides, pages):
        """The kernel of both signatures: ``pool`` is the plain flat view or the packed one's
        8-byte words."""
        with T.Kernel(n_tok, n_split, H // BH, threads=THREADS) as (t, s, hb):
            if pdl:
                start()
            device_code = ""
            if fp8 is not None:
                device_code += FP8_DEVICE_CODE + (FP8_FUSED_CODE if schedule.one_multiply else "")
            if prefetch or schedule.next_queries:
                device_code += PREFETCH_DEVICE_CODE
            if schedule.next_queries:
                device_code += SM_COUNT_DEVICE_CODE
            if device_code != "":  # (one source a kernel)
                T.import_source(device_code)
            q_s = T.alloc_shared((BH, D), dtype)
            k_s = T.alloc_shared((SLOTS, BNW, D), dtype)
            p_s = T.alloc_shared((2, BH, BNW), dtype)
            row_max = T.alloc_shared((2, BH), acc_t, scope="shared")
            row_sum = T.alloc_shared((2, BH), acc_t, scope="shared")
            offs = T.alloc_local((2 * PASSES,), "int64")  # the producer's rows (flat offsets)
            raw = (  # their index loads (:func:`load_rows`): compacted rows, paged block-table entries
                T.alloc_local((2 * PASSES,), "int32"),
                T.alloc_local((2 * PASSES if paged else 1,), "int64"),
            )

            frags = [
                (
                    T.alloc_fragment((BH, HALF), acc_t),
                    T.alloc_fragment((BH, BNW), acc_t),
                    *[T.alloc_fragment((BH,), acc_t) for _ in range(5)],
                )
                for _ in range(2)
            ]

            bar_q = T.alloc_barrier(arrive_count=128)
            bar_ready = T.alloc_barrier(arrive_count=[128] * SLOTS)
            bar_free = T.alloc_barrier(arrive_count=[256] * SLOTS)
            bar_stats = T.alloc_barrier(arrive_count=[128, 128])
            bar_p = T.alloc_barrier(arrive_count=[128, 128])
            bars = (bar_q, bar_ready, bar_free, bar_stats, bar_p)

            n0 = nvalid[t, 0]
            n01 = n0 + nvalid[t, 1]
            total = n01 + nvalid[t, 2]
            n_expl = n01 if paged else total
            nb = T.ceildiv(total, BNW)
            lo = T.min(s * T.ceildiv(nb, n_split), nb)
            hi = T.min(lo + T.ceildiv(nb, n_split), nb)
            j_end = T.min(hi * BNW, total)  # keys of this split end here (a last odd slot is masked)
            n_iter = T.ceildiv(T.max(hi - lo, 1), 2)
            tx = T.get_thread_binding()
            seq = (t, s, hb, n_iter, lo, j_end)
            smem = (q_s, k_s, p_s, row_max, row_sum)

            if tx >= 256:  # producer
                T.set_max_nreg(producer_regs, 0)
                p = tx - 256
                page_row = T.Cast("int32", token_rows[T.min(t, t2 - 1)]) if paged else 0
                rows = (t, page_row, n0, n01, n_expl, j_end, compact, block_table, bases, strides, pages, p)
                load_rows(raw, lo * BNW, rows)  # iteration 0's rows
                queries(q_s, q, t, hb, p)
                T.cp_async_barrier_noinc(bar_q)
                if schedule.next_queries:
                    next_queries(q, t, s, hb, p)
                if fp8 is None:
                    produce_plain(pool, k_s, raw, offs, bars, n_iter, lo, rows, p)
                elif schedule.words_in_flight == 1:
                    produce_fp8(pool, k_s, raw, offs, bars, n_iter, lo, rows, p)
                else:
                    produce_fp8_two(pool, k_s, raw, offs, bars, n_iter, lo, rows, p)
            elif tx < 128:
                consumer(0, seq, smem, frags[0], bars, io)
            else:
                consumer(1, seq, smem, frags[1], bars, io)

    if fp8 is None:

        @T.prim_func
        def sparse_attention_decode_ws(
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
            io, bases, strides = (sinks, scale2, out, part, ml), (base0, base1, base2), (st0, st1, st2)
            pages = (epp, epp_magic, epp_shift)
            body(q, flat, compact, nvalid, block_table, token_rows, io, bases, strides, pages)

        return sparse_attention_decode_ws

    @T.prim_func
    def sparse_attention_decode_ws_fp8(
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
        io, bases, strides = (sinks, scale2, out, part, ml), (base0, base1, base2), (st0, st1, st2)
        pages = (epp, epp_magic, epp_shift)
        body(q, flat64, compact, nvalid, block_table, token_rows, io, bases, strides, pages)

    return sparse_attention_decode_ws_fp8


def registers(fp8: sa.Fp8Geometry | None, schedule: Schedule = DEFAULT) -> tuple[int, int]:
    """``(producer, consumer)`` registers a thread (``setmaxnreg``).  The three warpgroups share
    the registers the CTA is launched with, 168 a thread (64 K over 384 threads, in steps of 8):
    ``p + 2 c`` must not exceed ``3 x 168``, or a consumer's ``setmaxnreg.inc`` waits forever."""
    if fp8 is None:
        return PRODUCER_REGS, CONSUMER_REGS
    return (FP8_PRODUCER_REGS, FP8_CONSUMER_REGS) if schedule.words_in_flight == 1 else FP8_TWO_BLOCKS_REGS


@functools.cache
@logged_compile("sparse_attention_ws")
def _kernel(
    paged: bool,
    split: bool,
    heads: int,
    dim: int,
    dtype: str,
    fp8: sa.Fp8Geometry | None = None,
    pdl: bool = False,
    schedule: Schedule = DEFAULT,
):
    """A compiled kernel (kept in TileLang's disk cache), with the PDL prologue when ``pdl``;
    bounds guards off, as the other attention kernel (the gathers read the pools through one
    flat address space)."""
    import tilelang

    func = build_attention_ws(paged, split, heads, dim, dtype, fp8, pdl, schedule)
    return tilelang.compile(func, out_idx=None, target=cuda_target(), pass_configs=pass_configs(fp8))


def pass_configs(fp8: sa.Fp8Geometry | None) -> dict[str, bool]:
    """TileLang's pass options for the kernel: bounds guards off; packed, also the check that
    a local buffer is written before it is read (the device functions' stores are not seen)."""
    configs = {"tl.disable_safe_memory_legalize": True}
    return configs if fp8 is None else {**configs, "tl.disable_buffer_init_check": True}


def fp8_supports(geometry: sa.Fp8Geometry, dim: int) -> bool | str:
    """``True`` when the producer's packed-row split takes this row geometry, else why not:
    nope bytes then bfloat16 rope values, each a multiple of four 8-byte words, and the scale
    bytes in one 8-byte word."""
    rope_bytes = 2 * (dim - geometry.nope)
    if geometry.nope % (8 * FP8_ROW_THREADS) or rope_bytes % (8 * FP8_ROW_THREADS):
        return f"FP8 row geometry {geometry}: the seesaw kernel takes nope and rope parts of 4k 8-byte words"
    if geometry.rope_offset != geometry.nope or geometry.scale_offset != geometry.nope + rope_bytes:
        return f"FP8 row geometry {geometry}: the seesaw kernel takes nope, rope, scales back to back"
    if geometry.scale_offset % 8 + geometry.groups > 8:
        return f"FP8 row geometry {geometry}: the seesaw kernel takes at most 8 scale bytes in one word"
    return True


def supports(q, kv_pools) -> bool | str:
    """``True`` when this kernel takes a call the other TileLang kernel takes, else why not:
    plain pools, or packed FP8 pools whose row geometry :func:`fp8_supports` takes."""
    geometry = sa.fp8_geometry(kv_pools)
    return True if geometry is None else fp8_supports(geometry, q.shape[2])


SPLIT_CTAS = {False: 64, True: 128}
"""At most this many CTAs (tokens x head blocks x splits) a call launches split, on plain pools
(``False``) and packed FP8 pools (``True``); a call of that many CTAs or more runs unsplit.
Each split adds a token's fp32 partials (128 KB at 64 heads) to the bytes its keys take, so a
plain pool splits only until about half the SMs are busy; a packed pool's producer dequantises
too slowly for one CTA to take an SM's share of the bandwidth, so it splits to a full wave.
Measured on an H100 (``bench_attention.py --tune``, CSA and HCA at 640 valid of 768 keys, 16 /
32 / 64 decode tokens): plain pools fastest at 4 / 2 / 1 splits (CSA 0.0218 / 0.0261 / 0.0344
ms, against 0.0221 / 0.0300 at 6 / 4 splits and 0.0400 at 2), packed ones at 6 / 4 / 2
(0.0229 / 0.0293 / 0.0395; one split at 64: 0.0439)."""

FEW_KEYS = 384
"""Calls whose widest key list is shorter (``max_keys``) split less from :data:`FEW_KEYS_CTAS`
CTAs on: plain pools not at all, packed ones to :data:`SPLIT_CTAS` ``[False]``.  Measured on an
H100 (HCA at a 4k context, 160 valid of 288 keys, 16 / 32 / 64 tokens): plain pools fastest
unsplit (0.0150 / 0.0161 / 0.0184 ms, against 0.0195 / 0.0198 / 0.0258 at the other kernel's
5 / 3 / 2 splits), packed ones at 4 / 1 / 1 (0.0166 / 0.0185 / 0.0195, against 0.0182 / 0.0200
/ 0.0249 at 5 / 3 / 2; two splits at 32 tokens: 0.0195)."""

FEW_KEYS_CTAS = 16
"""The fewest CTAs at which :data:`FEW_KEYS` applies (measured from 16 tokens on; below, a
token's few keys spread over more CTAs are unmeasured, and the other kernel's plan stands)."""


def plan_splits(tokens: int, heads: int, max_keys: int, sms: int, packed: bool = False) -> int:
    """Splits per (token, head block): the other kernel's plan
    (:func:`deepinfer_cuda_sm100.tl.sparse_attention.plan_splits`) capped at
    :data:`SPLIT_CTAS` CTAs, and less for short key lists (:data:`FEW_KEYS`).  Static shapes
    only."""
    ctas = tokens * (heads // BH)
    other = sa.plan_splits(tokens, heads, max_keys, sms)
    few = max_keys < FEW_KEYS and ctas >= FEW_KEYS_CTAS
    if few and not packed:
        return 1
    return max(1, min(other, SPLIT_CTAS[packed and not few] // ctas))


def sparse_attention(q, kv_pools, indices, sinks, scale, schedule: Schedule = DEFAULT) -> torch.Tensor:
    """The op (host side: :func:`deepinfer_cuda_sm100.tl.sparse_attention.launch`, the other
    kernel's: the Triton prologue, the pools' flat views, the combine; its own split plan,
    :func:`plan_splits`); ``schedule``: a variant of :class:`Schedule` (the op runs
    :data:`DEFAULT`)."""
    packed = sa.fp8_geometry(kv_pools) is not None
    plan = functools.partial(plan_splits, packed=packed)
    if schedule.vector_words and packed:
        rows = [(p.data.data_ptr(), p.data.stride(0) * p.data.element_size()) for p in kv_pools]
        if any(start % 16 or stride % 16 for start, stride in rows):
            raise ValueError(
                f"vector_words reads packed rows that start on 16 bytes, got (address, row bytes) {rows}"
            )
    compiled = _kernel if schedule == DEFAULT else functools.partial(_kernel, schedule=schedule)
    return sa.launch(q, kv_pools, indices, sinks, scale, compiled, plan)


def variants(packed: bool) -> list[Schedule]:
    """The :class:`Schedule` variants that apply to plain (``packed=False``) or packed pools,
    the default first: what ``bench_attention.py --tune`` times."""
    out = [DEFAULT, Schedule(lazy_rescale=True), Schedule(staged_store=False), Schedule(next_queries=True)]
    if not packed:
        out += [Schedule(l2_prefetch=1), Schedule(l2_prefetch=2)]
    if packed:
        out += [
            Schedule(l2_prefetch=0),
            Schedule(l2_prefetch=2),
            Schedule(vector_words=True),
            Schedule(vector_words=True, l2_prefetch=2),
            Schedule(words_in_flight=1),
            Schedule(one_multiply=True),
            Schedule(words_in_flight=1, one_multiply=True, lazy_rescale=True),
        ]
    return out
