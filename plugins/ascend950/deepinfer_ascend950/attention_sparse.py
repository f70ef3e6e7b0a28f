"""``sparse_attention`` and ``indexer_topk`` on torch_npu's sparse flash attention (SFA) and
lightning indexer (LI) operators.

**KV layout.**  The core's paged pools are page-major rows (``[num_pages * E, D]``, ``E`` entries
per page, :mod:`deepinfer_core.models.cache_spec`), which is the operators' ``PA_BSND`` layout
``[num_pages, E, 1, D]`` as a view: the indexer reads the key pool in place through the
request's block-table row.  The attention operator reads one key tensor per call, while the
contract's sources are separate pools (the window ring, this step's rows, the compressed
entries); the op concatenates them into one ``PA_BSND`` tensor of :data:`KV_BLOCK`-row blocks
and translates every source's rows into positions of that tensor.  That copy costs the pools'
size per call; a per-layer cache tensor holding all of a layer's sources would remove it (a
cache-layout change in the core, not made).

**Shapes.**  SFA computes ``(q·k + q_rope·k_rope) * scale`` with ``D = 512`` plus a 64-wide rope
operand (``attention_mode=2``); V4's 512-wide head (rope channels included) goes whole into
the 512-wide operand and the rope operand is zero, so the logits are the contract's ``q·k``
and the values are the whole 512-wide rows.  LI takes 128-wide keys and 8, 16, 24, 32 or 64
heads on the 950.

Which calls the operators take is in the ``supports`` predicates; every other call runs on the
reference (logged once per op), among them explicit candidate lists and packed indexer keys
(V4.1's MXFP4 keys are not the scales ``npu_quant_lightning_indexer`` reads; V4 keeps its
indexer keys in the model dtype).  Packed FP8 attention sources (the backend's ``fp8_tile128``
rows) run on ``npu_kv_quant_sparse_flash_attention`` (:mod:`.attention_kvquant`).
"""

from __future__ import annotations

import torch

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_format import PackedKVPool

from .attention_checks import (
    HALF_DTYPES,
    Verdict,
    dtype_in,
    finite_number,
    first_problem,
    is_tensor,
    not_batch_invariant,
)
from .npu import torch_npu

KV_BLOCK = 128
"""Rows per ``PA_BSND`` block of the concatenated key tensor (a multiple of 16, <= 1024)."""

SFA_HEAD_DIM = 512
SFA_ROPE_DIM = 64
SFA_MAX_HEADS = 128
LI_HEAD_DIM = 128
LI_HEADS = (8, 16, 24, 32, 64)
LI_SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
_INT32_MAX = 2**31 - 1

PACKED_REFUSAL = (
    "packed KV pool: npu_sparse_flash_attention reads plain rows (packed sources go to "
    "npu_kv_quant_sparse_flash_attention as fp8_tile128 rows only; the reference dequantises the others)"
)


def _rows(index: torch.Tensor | PagedIndex) -> torch.Tensor:
    return index.rows() if isinstance(index, PagedIndex) else index


def key_positions(kv_pools, indices) -> tuple[torch.Tensor, int]:
    """Every query's keys as positions of the sources concatenated in order (``[T, K]``,
    ``-1`` = none), and the sources' total rows."""
    cols, base = [], 0
    for pool, index in zip(kv_pools, indices, strict=True):
        r = _rows(index)
        cols.append(torch.where(r >= 0, r + base, -1))
        base += pool.shape[0]
    return torch.cat(cols, dim=1), base


def valid_first(picks: torch.Tensor) -> torch.Tensor:
    """``picks`` ``[T, K]`` as the operators' ``sparse_indices``: int32 ``[T, 1, K]``, each row's
    valid positions first (the operators read a list up to its first ``-1``)."""
    order = torch.sort((picks < 0).to(torch.uint8), dim=1, stable=True).indices
    return picks.gather(1, order).to(torch.int32).unsqueeze(1).contiguous()


def sparse_attention(q, kv_pools, indices, sinks, scale):
    """The contract's ``sparse_attention`` through ``torch_npu.npu_sparse_flash_attention``.

    One batch in TND layout (every query its own index list, ``sparse_mode=0``: the indices
    alone say what a query sees), the sources concatenated into one ``PA_BSND`` key tensor
    with an identity block table, each query's valid positions first (the operator reads a
    list up to its first ``-1``), the sinks passed as the operator's ``sinks``.
    """
    npu = torch_npu()
    t, h, d = q.shape
    dev = q.device
    picks, base = key_positions(kv_pools, indices)
    picks = valid_first(picks)  # [T, 1, K]
    blocks = -(-base // KV_BLOCK)
    pad = q.new_zeros(blocks * KV_BLOCK - base, d)
    key = torch.cat([*kv_pools, pad]).view(blocks, KV_BLOCK, 1, d)
    key_rope = q.new_zeros(1, KV_BLOCK, 1, SFA_ROPE_DIM).expand(blocks, -1, -1, -1)  # 0-axis stride 0
    query_rope = q.new_zeros(t, h, SFA_ROPE_DIM)
    table = torch.arange(blocks, dtype=torch.int32, device=dev).view(1, blocks)
    out, _, _ = npu.npu_sparse_flash_attention(
        q.contiguous(),
        key,
        key,
        picks,
        scale,
        block_table=table,
        actual_seq_lengths_query=torch.full((1,), t, dtype=torch.int32, device=dev),
        actual_seq_lengths_kv=torch.full((1,), blocks * KV_BLOCK, dtype=torch.int32, device=dev),
        query_rope=query_rope,
        key_rope=key_rope,
        sparse_block_size=1,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=0,
        attention_mode=2,
        sinks=sinks.float().contiguous(),
    )
    return out


def sparse_attention_supports(q, kv_pools, indices, sinks, scale) -> Verdict:
    """Whether :func:`sparse_attention` takes the call (see the module docstring)."""
    ok = first_problem(
        not_batch_invariant(),
        is_tensor("q", q),
        (
            len(kv_pools) == len(indices) and len(kv_pools) > 0,
            "kv_pools and indices differ in length or are empty",
        ),
    )
    if ok is not True:
        return ok
    for i, pool in enumerate(kv_pools):
        if isinstance(pool, PackedKVPool):  # TileFp8KVPool sources: ops_attention routes them
            return f"kv_pools[{i}] is a {type(pool).__name__}: {PACKED_REFUSAL}"
    ok = first_problem(
        (q.dim() == 3, f"q has {q.dim()} dims, expected [T, H, D]"),
        dtype_in("q", q, HALF_DTYPES),
    )
    if ok is not True:
        return ok
    t, h, d = q.shape
    ok = first_problem(
        (d == SFA_HEAD_DIM, f"head dim {d}: the operator takes D = {SFA_HEAD_DIM}"),
        (1 <= h <= SFA_MAX_HEADS, f"{h} heads: the operator takes 1..{SFA_MAX_HEADS}"),
        (t >= 1, "no query rows"),
        is_tensor("sinks", sinks),
        finite_number("scale", scale),
    )
    if ok is not True:
        return ok
    if not sinks.is_floating_point() or tuple(sinks.shape) != (h,):
        return f"sinks must be a float [{h}] tensor, got {tuple(sinks.shape)} {sinks.dtype}"
    total, width = 0, 0
    for i, (pool, index) in enumerate(zip(kv_pools, indices, strict=True)):
        if (
            not isinstance(pool, torch.Tensor)
            or pool.dtype != q.dtype
            or pool.dim() != 2
            or pool.shape[1] != d
        ):
            return f"kv_pools[{i}] must be a [N, {d}] {q.dtype} tensor"
        total += pool.shape[0]
        if isinstance(index, PagedIndex):
            width += index.max_count
        elif isinstance(index, torch.Tensor) and index.dim() == 2 and index.shape[0] == t:
            width += index.shape[1]
        else:
            return f"indices[{i}] must be a [{t}, K] tensor or a PagedIndex"
    return first_problem(
        (width >= 1, "no key slot at all (the operator needs sparse_size > 0)"),
        (total + KV_BLOCK <= _INT32_MAX, f"{total} key rows overflow the operator's int32 positions"),
    )


def indexer_topk(q, weights, key_pool, candidates, k, scale):
    """The contract's ``indexer_topk`` through ``torch_npu.npu_lightning_indexer``.

    Every query is its own batch (TND, one row each) reading its request's entries in place:
    the key pool viewed as ``PA_BSND`` blocks of ``entries_per_page`` rows, the request's
    block-table row, ``counts`` as the key lengths, ``sparse_mode=0``.  The operator returns
    entry positions, best first; they are mapped back to pool rows.  ``scale`` (positive)
    does not change the ranking, so it is not applied; the weights go in q's dtype (the 950
    takes no float32 weights), so scores within that rounding of each other may rank
    differently from the reference.
    """
    npu = torch_npu()
    t, _, d = q.shape
    epp = candidates.entries_per_page
    table = candidates.block_table.index_select(0, candidates.token_rows)
    counts = candidates.counts
    picks, _ = npu.npu_lightning_indexer(
        q.contiguous(),
        key_pool.view(-1, epp, 1, d),
        weights.to(q.dtype).contiguous(),
        actual_seq_lengths_query=torch.arange(1, t + 1, dtype=torch.int32, device=q.device),
        actual_seq_lengths_key=counts.to(torch.int32),
        block_table=table.to(torch.int32),
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=k,
        sparse_mode=0,
    )
    entries = picks[:, 0, : min(k, candidates.max_count)].long()
    valid = (entries >= 0) & (entries < counts.unsqueeze(1))
    e = entries.clamp(min=0)
    pages = table.gather(1, (e // epp).clamp(max=table.shape[1] - 1))
    return torch.where(valid, pages * epp + e % epp, -1)


def indexer_topk_supports(q, weights, key_pool, candidates, k, scale) -> Verdict:
    """Whether :func:`indexer_topk` takes the call (see the module docstring)."""
    ok = first_problem(
        not_batch_invariant(),
        (
            isinstance(candidates, PagedIndex),
            "explicit candidate lists: the operator reads a block-table key sequence (PagedIndex only)",
        ),
        (
            not isinstance(key_pool, PackedKVPool),
            "key_pool is packed: npu_lightning_indexer reads plain keys (V4.1's MXFP4 keys are not the "
            "scales npu_quant_lightning_indexer reads)",
        ),
        is_tensor("q", q),
        is_tensor("key_pool", key_pool),
        is_tensor("weights", weights),
    )
    if ok is not True:
        return ok
    ok = first_problem(
        (q.dim() == 3, f"q has {q.dim()} dims, expected [T, H, D]"),
        dtype_in("q", q, HALF_DTYPES),
        (key_pool.dtype == q.dtype, f"key_pool dtype {key_pool.dtype} differs from q's {q.dtype}"),
    )
    if ok is not True:
        return ok
    t, h, d = q.shape
    epp, pages = candidates.entries_per_page, candidates.block_table.shape[1]
    return first_problem(
        (t >= 1, "no query rows"),
        (d == LI_HEAD_DIM, f"indexer head dim {d}: the operator takes D = {LI_HEAD_DIM}"),
        (h in LI_HEADS, f"{h} indexer heads: the 950 operator takes {LI_HEADS}"),
        (
            weights.is_floating_point() and tuple(weights.shape) == (t, h),
            f"weights must be a float [{t}, {h}]",
        ),
        (key_pool.dim() == 2 and key_pool.shape[1] == d, f"key_pool must be [N, {d}]"),
        (key_pool.is_contiguous(), "key_pool is not contiguous (viewed as PA_BSND blocks)"),
        (
            epp % 16 == 0 and 16 <= epp <= 1024,
            f"{epp} entries per page: the operator's block size is 16k <= 1024",
        ),
        (key_pool.shape[0] % epp == 0, f"key_pool rows {key_pool.shape[0]} are not whole pages of {epp}"),
        (candidates.max_count <= pages * epp, "max_count exceeds the block table's entries"),
        (k in LI_SPARSE_COUNTS, f"k={k!r} is not a sparse_count the operator takes"),
        finite_number("scale", scale),
        (isinstance(scale, int | float) and scale > 0, "scale must be positive (it is not applied)"),
    )
