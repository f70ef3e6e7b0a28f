"""``indexer_topk``'s scores in TileLang: the lightning indexer's ``[T, C]`` fp32 scores
(contract: ``deepinfer_core.ops.attention.indexer_topk``; the selection stays with
:mod:`deepinfer_cuda_sm100.kernels.indexer` and :mod:`deepinfer_cuda_sm100.indexer_select`).

Score of candidate ``c`` for query ``t``: ``sum_h w[t, h] * (relu(q[t, h] . key[c]) * scale)``,
``-inf`` for an invalid candidate, ``-0.0`` written as ``+0.0`` (equal scores, equal bits), as
the Triton kernel computes it.

One CTA (one warpgroup) takes one query token and up to :data:`BLOCKS` blocks of :data:`BN`
candidates (:func:`plan_blocks`: as many as keep the SMs busy).  The token's ``[H, D]``
queries stay in shared memory; the row offsets of all the CTA's candidates (explicit rows,
or the entries of a :class:`~deepinfer_core.ops.attention.PagedIndex` resolved through its
block table) are computed once, before the first block, into static shared memory; per block
the key rows are gathered by 16-byte ``cp.async`` copies into a :data:`STAGES`-deep shared
ring (TileLang's pipeline issues the next block's copies before this block's math; with the
offsets outside the dynamic shared memory, TileLang places no barrier inside the gather
loop), one wgmma GEMM gives the logits
``[BN, H]`` (candidates on wgmma's M side, heads as its N), and the epilogue applies ``relu``,
the scale and the head weights (the weight's product rounded before the sum adds it: no FMA,
so every kernel with this epilogue gets the same bits whatever nvcc schedules) and sums over
heads within each row's quad of threads.  The keys are read once, as they are stored; nothing
but the scores is written.

The pool is addressed in 16-byte units from its own base (its row stride a multiple of 16
bytes, its base 16-byte aligned), so a row's address is provably aligned and the gathers need
no bounds check per element.

A candidate's score does not depend on the other tokens or on where the candidate sits in its
block (fixed tiles, the same instructions for every block), but its summation order over heads
differs from the Triton kernel's, so the two agree to rounding, not bit for bit: the dispatcher
(:mod:`deepinfer_cuda_sm100.indexer_select`) keeps Triton in batch-invariant mode, and picks
TileLang elsewhere only where the measured table found it faster.

Where the Triton kernels use programmatic dependent launch, the kernel starts with the PDL
prologue (:mod:`deepinfer_cuda_sm100.tl.pdl`) before any global access.
"""

# No ``from __future__ import annotations``: TileLang reads the kernels' annotations as
# objects (shapes built from closure variables).
import functools

import torch

from deepinfer_core.ops.attention import PagedIndex

from .compile_log import logged_compile
from .launch_args import TL_DTYPES, index_int64, num_sms
from .page_division import divider, entries_problem, pool_row
from .pdl import prologue, tl_pdl_enabled
from .target import cuda_target

BN = 128
"""Candidates per block: two wgmma M tiles of 64."""
BLOCK_CHOICES = (1, 2, 4, 8, 16)
"""Blocks per CTA a launch may take (they share its load of the token's queries; each is a
compiled configuration): :func:`plan_blocks` picks one."""
BLOCKS = 16
"""The most blocks per CTA: the fastest where the grid stays full (measured on an H200 at 128
x 16,384, 128 x 262,144 and 8,192 x 2,048 candidates: 0.171 / 2.533 / 1.187 ms against 0.177 /
2.611 / 1.244 at 4 blocks and 0.190 / 2.712 / 1.341 at 2)."""
MIN_CTAS_PER_SM = 4
""":func:`plan_blocks` keeps at least this many CTAs per SM (two resident, two waves)."""
STAGES = 2
"""Depth of the key ring."""
THREADS = 128
"""One warpgroup."""
KINDS = ("rows", "paged")
"""Candidate forms: explicit ``[T, C]`` rows, or a paged index."""
MAX_HEADS = 128
MAX_DIM = 256


def build_scores(kind: str, heads: int, dim: int, dtype: str, blocks: int = BLOCKS, pdl: bool = False):
    """The TileLang ``prim_func`` of one static configuration.

    Args:
        kind: ``"rows"`` (candidates ``[T, C]`` int64 pool rows, ``-1`` = none) or ``"paged"``
            (a paged index: block table, token rows, entry counts, ``C = max_count``).
        heads: ``H`` (a multiple of 16, at most :data:`MAX_HEADS`); dim: ``D`` (a multiple of
            64, at most :data:`MAX_DIM`); dtype: ``"bfloat16"`` or ``"float16"``.
        blocks: blocks of :data:`BN` candidates per CTA.
        pdl: start with the PDL prologue (:func:`deepinfer_cuda_sm100.tl.pdl.prologue`: wait
            for the kernel before, then let the next be scheduled) before any global access.
    """
    import tilelang.language as T

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    acc_t = "float32"
    H, D = heads, dim
    n_tok, n_cand, nf = T.dynamic("T"), T.dynamic("C"), T.dynamic("NF")
    t_rows, c_rows = T.dynamic("TR"), T.dynamic("CR")
    r_bt, p_bt, t2, t3 = T.dynamic("R"), T.dynamic("P"), T.dynamic("T2"), T.dynamic("T3")
    start = prologue()

    @T.macro
    def offsets(off, t, c0, cand, paged, kst):
        """``off[i]``: candidate ``c0 + i``'s key row in 16-byte units, ``-1`` if invalid, for
        every candidate of the CTA (``blocks * BN``; one round of independent index loads
        before the first gather instead of one per block)."""
        block_table, token_rows, counts, max_count, epp, magic, shift = paged
        if kind == "rows":
            for i in T.Parallel(blocks * BN):
                col = c0 + i
                row = T.if_then_else(col < n_cand, cand[t, T.min(col, n_cand - 1)], T.int64(-1))
                off[i] = T.if_then_else(row >= 0, row * kst, T.int64(-1))
        else:
            count = T.min(T.max(counts[t], T.int64(0)), T.Cast("int64", max_count))
            page_row = T.Cast("int32", token_rows[t])
            for i in T.Parallel(blocks * BN):
                e = c0 + i
                row = pool_row(block_table, page_row, e, (epp, magic, shift))
                off[i] = T.if_then_else(e < count, row * kst, T.int64(-1))

    @T.macro
    def gather(k_s, off, flat, b):
        for i, d in T.Parallel(BN, D):
            k_s[i, d] = flat[T.max(off[b * BN + i], 0) * 8 + d]

    @T.prim_func
    def indexer_scores(
        q: T.Tensor((n_tok, H, D), dtype),
        w: T.Tensor((n_tok, H), "float32"),
        flat: T.Tensor((nf,), dtype),
        cand: T.Tensor((t_rows, c_rows), "int64"),
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
        with T.Kernel(T.ceildiv(n_cand, BN * blocks), n_tok, threads=THREADS) as (g, t):
            q_s = T.alloc_shared((H, D), dtype)
            w_s = T.alloc_shared((H,), acc_t)
            k_s = T.alloc_shared((BN, D), dtype)
            # static shared memory: the dynamic one holds the key ring, and TileLang's barrier
            # placement would put a barrier in every iteration of a gather loop that reads the
            # offsets from it (it cannot tell the two buffers apart there)
            off = T.alloc_shared((blocks * BN,), "int64", scope="shared")
            acc = T.alloc_fragment((BN, H), acc_t)
            score = T.alloc_fragment((BN,), acc_t)
            if pdl:  # the queries, weights, keys and index all come from the kernels before
                start()
            T.copy(q[t, 0, 0], q_s)
            for h in T.Parallel(H):
                w_s[h] = w[t, h]
            paged = (block_table, token_rows, counts, max_count, epp, epp_magic, epp_shift)
            offsets(off, t, g * blocks * BN, cand, paged, kst)
            # the gather in stage 0, the GEMM and the epilogue in stage 1
            for b in T.Pipelined(blocks, order=[0, 1, 2, 3, 4], stage=[0, 1, 1, 1, 1]):
                gather(k_s, off, flat, b)
                T.gemm(k_s, q_s, acc, transpose_B=True, clear_accum=True)
                for i, h in T.Parallel(BN, H):
                    # rounded before the sum over heads adds it (see the module docstring)
                    acc[i, h] = T.ieee_mul(T.max(acc[i, h], 0) * scale, w_s[h])
                T.reduce_sum(acc, score, dim=1)
                for i in T.Parallel(BN):
                    c = (g * blocks + b) * BN + i
                    if c < n_cand:
                        scores[t, c] = T.if_then_else(
                            off[b * BN + i] < 0,
                            -T.infinity(acc_t),
                            T.if_then_else(score[i] == 0, T.float32(0), score[i]),
                        )

    return indexer_scores


def plan_blocks(tokens: int, candidates: int, sms: int) -> int:
    """Blocks per CTA for ``tokens`` rows of ``candidates``: the most of :data:`BLOCK_CHOICES`
    that still give :data:`MIN_CTAS_PER_SM` CTAs per SM, one block where none does.  A score
    does not depend on it (the same instructions per block); static shapes only."""
    blocks = -(-candidates // BN)
    fitting = [b for b in BLOCK_CHOICES if tokens * -(-blocks // b) >= MIN_CTAS_PER_SM * sms]
    return max(fitting, default=1)


@functools.cache
@logged_compile("indexer")
def _kernel(kind: str, heads: int, dim: int, dtype: str, blocks: int = BLOCKS, pdl: bool = False):
    """A compiled kernel (TileLang keeps compiled kernels in its disk cache), with the PDL
    prologue when ``pdl``.  The gathers read the pool through a flat view beyond the bounds of
    the tensor it is given: TileLang's bounds guards are off."""
    import tilelang

    configs = {"tl.disable_safe_memory_legalize": True}
    func = build_scores(kind, heads, dim, dtype, blocks, pdl)
    return tilelang.compile(func, out_idx=None, target=cuda_target(), pass_configs=configs)


def supports(q, weights, key_pool, candidates) -> bool | str:
    """``True`` when the TileLang scores take this call (one the Triton kernel accepts), else
    the reason."""
    if q.dtype not in TL_DTYPES:
        return f"q dtype {q.dtype}: the TileLang scores take bfloat16 and float16"
    _, h, d = q.shape
    if h % 16 or h > MAX_HEADS:
        return f"{h} indexer heads: the TileLang scores take multiples of 16 up to {MAX_HEADS}"
    if d % 64 or d > MAX_DIM:
        return f"indexer head dim {d}: the TileLang scores take multiples of 64 up to {MAX_DIM}"
    if not isinstance(key_pool, torch.Tensor) or key_pool.dtype != q.dtype:
        return "key_pool must be a plain tensor of q's dtype"
    if key_pool.stride(1) != 1 or (key_pool.stride(0) * key_pool.element_size()) % 16:
        return "key_pool rows must be contiguous with a row stride of a multiple of 16 bytes"
    if key_pool.data_ptr() % 16:
        return "key_pool must start 16-byte aligned"
    if not weights.is_floating_point():
        return f"weights dtype {weights.dtype}: floating point expected"
    if isinstance(candidates, PagedIndex):
        return entries_problem(candidates.max_count, "the TileLang score kernel") or True
    return True


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: torch.Tensor,
    candidates: torch.Tensor | PagedIndex,
    scale: float,
    *,
    blocks: int | None = None,
) -> torch.Tensor:
    """The ``[T, C]`` fp32 scores (``-inf`` for invalid candidates) of a call :func:`supports`
    takes: :func:`~deepinfer_cuda_sm100.kernels.indexer.indexer_scores`'s result, to rounding.
    ``blocks``: blocks of candidates per CTA (default: :func:`plan_blocks`)."""
    t, h, d = q.shape
    dev = q.device
    one = torch.empty(1, dtype=torch.int64, device=dev)  # placeholders the kernel's kind never reads
    if isinstance(candidates, PagedIndex):
        kind, c = "paged", int(candidates.max_count)
        cand = one.view(1, 1)  # never read by the paged kernel
        bt, rows = index_int64(candidates.block_table), index_int64(candidates.token_rows)
        counts, epp = index_int64(candidates.counts), int(candidates.entries_per_page)
    else:
        kind, c = "rows", candidates.shape[1]
        cand = candidates.to(torch.int64).contiguous()
        bt, rows, counts, epp = one.view(1, 1), one, one, 1
    scores = torch.empty((t, c), dtype=torch.float32, device=dev)
    if t == 0 or c == 0:
        return scores
    flat = torch.as_strided(key_pool, (1,), (1,))
    kst = key_pool.stride(0) * key_pool.element_size() // 16
    w = weights if weights.dtype == torch.float32 else weights.float()
    if blocks is None:
        blocks = plan_blocks(t, c, num_sms(dev))
    kernel = _kernel(kind, h, d, TL_DTYPES[q.dtype], blocks, tl_pdl_enabled())
    args = (q.contiguous(), w.contiguous(), flat, cand, bt, rows, counts, scores, kst, float(scale), c)
    kernel(*args, epp, *divider(epp))
    return scores
