"""The CUDA device code that ends a grouped indexer CTA with its tokens' top-k selection
(:func:`deepinfer_cuda_sm100.tl.indexer_grouped.build_grouped_scores` with ``select``).

When one CTA has scored a token's whole row (at most :data:`MAX_COLUMNS` candidates: all of a
prefill chunk's compressed entries), it can also pick the row's top ``k`` itself, instead of a
second launch reading the scores back from memory.  After a block barrier (the row's scores
were stored by both warpgroups), each warpgroup (128 threads, its own named barrier) takes one
token of the group at a time:

1. its 128 threads load :data:`PER_THREAD` consecutive scores each (the row is still in L2) as
   the order-preserving unsigned image of each fp32 value (negative values' bits flipped,
   positive ones' sign bit set); columns past the token's entry count are 0, below every score;
2. the ``kk``-th largest image (``kk = min(k, count)``) is fixed bit by bit from the top, a bit
   kept where at least ``kk`` images reach the candidate value (a warp ``redux`` and a shared
   sum over the four warps a bit), stopping where exactly ``kk`` reach it;
3. one scan over the threads in column order places every image above the threshold and the
   earliest ones equal to it (the contract's tie rule) in shared memory as 64-bit keys,
   ``image << 32 | (2**32 - 1 - column)``;
4. a bitonic sort of the next power of two of keys (descending; the padding keys are 0) puts the
   picks best first, equal scores by column;
5. each pick's column becomes its pool row through the token's block-table row (``-1`` for a
   ``-inf`` score, which only an entry without a page gets), ``-1`` past ``kk``.

The picks and their order are those of every other selection path (the contract fixes them).
Its scratch is the CTA's dynamic shared memory, free once the scores are stored: at most
:data:`MAX_K` keys a warpgroup.
"""

PER_THREAD = 16
"""Scores a thread holds: 128 threads x 16 = :data:`MAX_COLUMNS`."""
MAX_COLUMNS = 128 * PER_THREAD
"""Longest row (candidates) the in-CTA selection takes."""
MAX_K = 1024
"""Most picks a row (``min(k, C)``): the keys a warpgroup sorts in shared memory."""
SCRATCH_BYTES = 2 * (MAX_K * 8 + 64)
"""Dynamic shared memory the selection uses (two warpgroups' keys and sums)."""

DEVICE_CODE = r"""
namespace deepinfer_group_topk {

constexpr int kPer = __PER__;
constexpr int kMaxK = __MAXK__;
constexpr int kRegion = kMaxK * 8 + 64;  // a warpgroup's keys, then its sums' slots

__device__ __forceinline__ unsigned ordered(float s) {
  const unsigned b = __float_as_uint(s);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ void wg_sync(int wg) {
  // barriers 1 and 2 (constant ids: a register id makes ptxas reserve all sixteen)
  if (wg == 0) {
    asm volatile("bar.sync 1, 128;" ::: "memory");
  } else {
    asm volatile("bar.sync 2, 128;" ::: "memory");
  }
}

// the sum of v over the warpgroup's 128 threads; slots: 4 ints not read by a pending sum
__device__ __forceinline__ int wg_sum(int v, volatile int* slots, int lane, int wg) {
  v = __reduce_add_sync(0xffffffffu, v);
  if ((lane & 31) == 0) slots[lane >> 5] = v;
  wg_sync(wg);
  return slots[0] + slots[1] + slots[2] + slots[3];
}

// token row: the top kk of its n scores (best first, ties to the earlier column) as pool rows
__device__ __forceinline__ void select_row(const float* row, int64_t* out, const int64_t* bt_row,
                                           int n, int kk, int out_cols, int pages, int epp,
                                           unsigned long long* keys, volatile int* sums, int lane,
                                           int wg) {
  wg_sync(wg);  // the scratch's last readers (the warpgroup's previous row) are done
  if (kk <= 0) {
    for (int r = lane; r < out_cols; r += 128) out[r] = -1;
    return;
  }
  const int base = lane * kPer;
  unsigned o[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) o[i] = base + i < n ? ordered(row[base + i]) : 0u;

  unsigned thr = 0u;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned cand = thr | (1u << bit);
    int count = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) count += o[i] >= cand ? 1 : 0;
    const int total = wg_sum(count, sums + (bit & 1) * 4, lane, wg);
    if (total >= kk) thr = cand;
    if (total == kk) {  // the images above cand - 1 are exactly the top kk
      thr = cand - 1u;
      break;
    }
  }

  // (above, equal) counts of the thread's columns, packed 16 + 16 bits, scanned in column order
  int above = 0, equal = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    above += o[i] > thr ? 1 : 0;
    equal += o[i] == thr ? 1 : 0;
  }
  const int mine = above | (equal << 16);
  int incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, d);
    if ((lane & 31) >= d) incl += y;
  }
  volatile int* warp_tot = sums + 8;
  if ((lane & 31) == 31) warp_tot[lane >> 5] = incl;
  wg_sync(wg);
  int before = incl - mine, total = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const int t = warp_tot[w];
    before += w < (lane >> 5) ? t : 0;
    total += t;
  }
  const int need = kk - (total & 0xffff);  // ties at the threshold to take, earliest first
  int eq_rank = before >> 16;
  int pos = (before & 0xffff) + min(eq_rank, need);
  int padded = 1;
  while (padded < kk) padded <<= 1;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const bool tie = o[i] == thr;
    if (o[i] > thr || (tie && eq_rank < need)) {
      keys[pos++] = ((unsigned long long)o[i] << 32) | (0xffffffffu - (unsigned)(base + i));
    }
    eq_rank += tie ? 1 : 0;
  }
  for (int r = kk + lane; r < padded; r += 128) keys[r] = 0ull;
  wg_sync(wg);

  // bitonic sort of keys[0, padded), descending
  for (int size = 2; size <= padded; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int p = lane; p < (padded >> 1); p += 128) {
        const int i = ((p & ~(stride - 1)) << 1) | (p & (stride - 1));
        const unsigned long long a = keys[i], b = keys[i + stride];
        if ((i & size) == 0 ? a < b : a > b) {
          keys[i] = b;
          keys[i + stride] = a;
        }
      }
      wg_sync(wg);
    }
  }

  for (int r = lane; r < out_cols; r += 128) {
    long long v = -1;
    if (r < kk) {
      const unsigned long long key = keys[r];
      if ((unsigned)(key >> 32) != 0x007fffffu) {  // a -inf score: an entry without a page
        const int c = (int)(0xffffffffu - (unsigned)key);
        const int q = c / epp;
        v = (long long)bt_row[min(q, pages - 1)] * epp + (c - q * epp);
      }
    }
    out[r] = v;
  }
}

}  // namespace deepinfer_group_topk

// the CTA's two tokens (rows row0 / row1 of the block table, count0 / count1 entries; a token
// at or past n_tok is skipped): each warpgroup selects whole rows, tokens wg, wg + warpgroups
__device__ __forceinline__ void deepinfer_group_topk2(const float* scores, int64_t* picks,
                                                      const int64_t* block_table, int t0, int n_tok,
                                                      int n_cand, int out_cols, int pages, int epp,
                                                      long long row0, long long row1,
                                                      long long count0, long long count1) {
  extern __shared__ __align__(1024) unsigned char deepinfer_topk_smem[];
  const int wg = threadIdx.x >> 7, lane = threadIdx.x & 127, groups = blockDim.x >> 7;
  unsigned char* region = deepinfer_topk_smem + wg * deepinfer_group_topk::kRegion;
  unsigned long long* keys = (unsigned long long*)region;
  volatile int* sums = (volatile int*)(region + deepinfer_group_topk::kMaxK * 8);
  for (int j = wg; j < 2; j += groups) {
    const int t = t0 + j;
    if (t >= n_tok) break;
    const long long row = j == 0 ? row0 : row1;
    const int n = (int)min(j == 0 ? count0 : count1, (long long)n_cand);
    deepinfer_group_topk::select_row(scores + (long long)t * n_cand, picks + (long long)t * out_cols,
                                     block_table + row * pages, n, min(n, out_cols), out_cols, pages,
                                     epp, keys, sums, lane, wg);
  }
}
""".replace("__PER__", str(PER_THREAD)).replace("__MAXK__", str(MAX_K))
"""The device functions (``deepinfer_group_topk2`` called once by every thread of the CTA)."""
