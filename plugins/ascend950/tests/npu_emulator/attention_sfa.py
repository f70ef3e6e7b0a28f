"""EMULATOR of two ``torch_npu`` attention operators, written from their published documentation:
``npu_sparse_flash_attention`` (SFA) and ``npu_lightning_indexer`` (LI).  Tests only.

Sources (Ascend/op-plugin, branch master as mirrored, ``docs/zh/custom_APIs/torch_npu/``):

- ``torch_npu-npu_sparse_flash_attention.md`` (signature with ``sinks``; layouts BSND / TND for
  the query, BSND / TND / PA_BSND for the key; ``sparse_mode`` 0 and 3; ``attention_mode`` 2;
  the Ascend 950PR/950DT constraints);
- ``torch_npu-npu_lightning_indexer.md`` (score formula, layouts, ``sparse_count`` values, the
  950 constraints);
- the operators' own test oracles in the same repository
  (``test/test_custom_ops/test_npu_sparse_flash_attention.py``, ``test_npu_lightning_indexer.py``)
  for what the pages leave implicit: an index past the key's actual length selects nothing, an
  SFA index list ends at its first ``-1``, an LI output row is padded with ``-1``.

Where the documents are silent the choice is stated at the function.  Everything is computed in
float32 and rounded once to the output dtype (the documents do not say how the hardware
accumulates).  The emulator validates the documented constraints it depends on and raises
``ValueError`` naming the argument otherwise, as a stand-in for the operator's own checks.
"""

from __future__ import annotations

import torch

_FLOAT16S = (torch.bfloat16, torch.float16)
_LI_SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
_LI_HEADS_950 = (8, 16, 24, 32, 64)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"EMULATOR torch_npu: {message}")


def _query_batches(query: torch.Tensor, layout: str, lengths: torch.Tensor | None) -> list[torch.Tensor]:
    """The query rows ``[S1_b, N, D]`` of each batch (TND: ``lengths`` are prefix sums)."""
    if layout == "TND":
        _require(lengths is not None, "actual_seq_lengths_query is required with layout TND")
        ends = [int(e) for e in lengths.tolist()]
        starts = [0, *ends[:-1]]
        _require(
            all(e >= s for s, e in zip(starts, ends, strict=True)), "query prefix sums must not decrease"
        )
        return [query[s:e] for s, e in zip(starts, ends, strict=True)]
    _require(layout == "BSND", f"layout_query {layout!r} is not BSND or TND")
    if lengths is None:
        return list(query)
    return [query[b, : int(n)] for b, n in enumerate(lengths.tolist())]


def _key_sequence(
    key: torch.Tensor, layout: str, b: int, lengths: torch.Tensor | None, block_table: torch.Tensor | None
) -> torch.Tensor:
    """Batch ``b``'s key sequence ``[S2_b, N2, D]`` (PA_BSND: gathered through ``block_table``)."""
    if layout == "PA_BSND":
        _require(block_table is not None and lengths is not None, "PA_BSND needs block_table and kv lengths")
        block_size = key.shape[1]
        _require(
            block_size % 16 == 0 and block_size <= 1024, f"block_size {block_size}: a multiple of 16, <= 1024"
        )
        n = int(lengths[b])
        blocks = -(-n // block_size)
        _require(blocks <= block_table.shape[1], "block_table has fewer columns than the kv length needs")
        ids = block_table[b, :blocks].long()
        return key.index_select(0, ids).reshape(blocks * block_size, *key.shape[2:])[:n]
    if layout == "TND":
        _require(lengths is not None, "TND keys need actual_seq_lengths (prefix sums)")
        ends = [int(e) for e in lengths.tolist()]
        start = ends[b - 1] if b else 0
        return key[start : ends[b]]
    _require(layout == "BSND", f"key layout {layout!r} is not BSND, TND or PA_BSND")
    return key[b] if lengths is None else key[b, : int(lengths[b])]


def npu_sparse_flash_attention(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    *,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    query_rope=None,
    key_rope=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=2**63 - 1,
    next_tokens=2**63 - 1,
    attention_mode=0,
    return_softmax_lse=False,
    sinks=None,
):
    """EMULATOR of ``torch_npu.npu_sparse_flash_attention`` (doc: Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_sparse_flash_attention.md``).

    Per query row ``i`` of batch ``b``: the key positions are ``sparse_indices[i, 0, :]`` up to
    the first ``-1`` (the doc requires valid entries first; the test oracle stops at the first
    ``-1``), each expanded to ``sparse_block_size`` consecutive positions and clipped to the
    batch's kv length; ``sparse_mode=3`` further keeps position ``j`` only if
    ``j <= (L_kv - L_q) + i``.  With ``attention_mode=2`` the logits are
    ``(q·k + q_rope·k_rope) * scale_value``; the output is ``softmax(logits) @ value`` over the
    kept positions, ``[S1, N1, D]`` of ``value``'s width.

    Silent in the doc, chosen here: ``sinks`` (float32 ``[N1]``) join each head's softmax as one
    more logit that is not scaled and carries no value (the usual attention-sink definition); a
    row that keeps no position returns zeros; a repeated index counts twice.  Only
    ``attention_mode=2`` is accepted (the only value the doc allows); ``return_softmax_lse`` is
    refused (inference on PA_BSND does not support it per the doc).  Returns
    ``(attention_out, softmax_max, softmax_sum)`` with the last two empty.
    """
    _require(attention_mode == 2, "attention_mode must be 2 (MLA-absorb), the only documented value")
    _require(not return_softmax_lse, "return_softmax_lse is not supported in inference / PA_BSND")
    _require(sparse_mode in (0, 3), f"sparse_mode {sparse_mode} is not 0 or 3")
    _require(sparse_block_size == 1, "Ascend 950: sparse_block_size must be 1")
    _require(pre_tokens == 2**63 - 1 and next_tokens == 2**63 - 1, "pre/next_tokens take the default only")
    _require(query.dtype in _FLOAT16S, f"query dtype {query.dtype}: bfloat16 or float16")
    _require(key.dtype == value.dtype == query.dtype, "query, key and value dtypes must match")
    _require(
        query.is_contiguous() and sparse_indices.is_contiguous(), "query / sparse_indices not contiguous"
    )
    _require(sparse_indices.dtype == torch.int32, "sparse_indices must be int32")
    _require(query.shape[-1] == key.shape[-1] == 512, "query / key D must be 512")
    _require(
        query_rope is not None and key_rope is not None, "attention_mode 2 needs query_rope and key_rope"
    )
    _require(query_rope.shape[-1] == key_rope.shape[-1] == 64, "query_rope / key_rope D must be 64")
    _require(key.shape[-2] == 1, "KV_N must be 1")
    n1 = query.shape[-2]
    _require(1 <= n1 <= 128, f"Ascend 950: N1 must be 1..128, got {n1}")
    if sinks is not None:
        _require(sinks.dtype == torch.float32 and tuple(sinks.shape) == (n1,), "sinks must be float32 [N1]")
    queries = _query_batches(query, layout_query, actual_seq_lengths_query)
    ropes = _query_batches(query_rope, layout_query, actual_seq_lengths_query)
    picks = _query_batches(sparse_indices, layout_query, actual_seq_lengths_query)
    out = torch.zeros(query.shape, dtype=torch.float32)
    out_rows = _query_batches(out, layout_query, actual_seq_lengths_query)
    for b, (q, qr, idx, o) in enumerate(zip(queries, ropes, picks, out_rows, strict=True)):
        k = _key_sequence(key, layout_kv, b, actual_seq_lengths_kv, block_table)[:, 0].float()
        kr = _key_sequence(key_rope, layout_kv, b, actual_seq_lengths_kv, block_table)[:, 0].float()
        v = _key_sequence(value, layout_kv, b, actual_seq_lengths_kv, block_table)[:, 0].float()
        l_kv, l_q = k.shape[0], q.shape[0]
        for i in range(l_q):
            row = idx[i, 0].tolist()
            row = row[: row.index(-1)] if -1 in row else row
            limit = l_kv if sparse_mode == 0 else min(l_kv, l_kv - l_q + i + 1)
            keep = torch.tensor([j for j in row if 0 <= j < limit], dtype=torch.long)
            if keep.numel() == 0:
                continue
            logits = (q[i].float() @ k[keep].T + qr[i].float() @ kr[keep].T) * scale_value  # [N1, K]
            if sinks is not None:
                logits = torch.cat([logits, sinks.view(-1, 1)], dim=1)
            probs = torch.softmax(logits, dim=-1)[:, : keep.numel()]
            o[i] = probs @ v[keep]
    empty = torch.empty(0)
    return out.to(query.dtype), empty, empty


def npu_lightning_indexer(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    pre_tokens=2**63 - 1,
    next_tokens=2**63 - 1,
    return_value=False,
):
    """EMULATOR of ``torch_npu.npu_lightning_indexer`` (doc: Ascend/op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md``).

    Score of key position ``s`` for query row ``i``: ``sum_h weights[i, h] * relu(q[i, h]·k[s])``
    (no scale in the formula), in float32.  Candidates are the batch's key positions
    ``0 .. L_k-1``; ``sparse_mode=3`` masks ``s > (L_k - L_q) + i``.  Output
    ``sparse_indices`` int32 ``[T1, 1, sparse_count]`` (TND) or ``[B, S1, 1, sparse_count]``:
    the best positions first, ``-1`` after the last candidate (the test oracle pads with ``-1``).

    Silent in the doc, chosen here: equal scores rank the lower position first (a stable sort;
    the operator's tie order is unspecified); masked positions never appear in the output
    (the test oracle can list them after the valid ones with a ``-inf`` score).  The Ascend 950
    constraints are enforced: query N in {8, 16, 24, 32, 64}, D = 128, weights not float32.
    Returns ``(sparse_indices, sparse_values)``, the latter empty (``return_value`` is for
    training only per the doc).
    """
    _require(not return_value, "return_value is for training only (not with PA_BSND)")
    _require(sparse_mode in (0, 3), f"sparse_mode {sparse_mode} is not 0 or 3")
    _require(sparse_count in _LI_SPARSE_COUNTS, f"sparse_count {sparse_count} is not a documented value")
    _require(pre_tokens == 2**63 - 1 and next_tokens == 2**63 - 1, "pre/next_tokens take the default only")
    _require(query.dtype in _FLOAT16S and key.dtype == query.dtype, "query / key: bfloat16 or float16, equal")
    _require(weights.dtype == query.dtype, "Ascend 950: weights must have the query's dtype (no float32)")
    _require(query.is_contiguous() and weights.is_contiguous(), "query / weights not contiguous")
    _require(query.shape[-1] == key.shape[-1] == 128, "query / key D must be 128")
    _require(query.shape[-2] in _LI_HEADS_950, f"Ascend 950: query N must be one of {_LI_HEADS_950}")
    _require(key.shape[-2] == 1, "key N must be 1")
    queries = _query_batches(query, layout_query, actual_seq_lengths_query)
    wts = _query_batches(weights, layout_query, actual_seq_lengths_query)
    out = torch.full((*query.shape[:-2], 1, sparse_count), -1, dtype=torch.int32)
    out_rows = _query_batches(out, layout_query, actual_seq_lengths_query)
    for b, (q, w, o) in enumerate(zip(queries, wts, out_rows, strict=True)):
        k = _key_sequence(key, layout_key, b, actual_seq_lengths_key, block_table)[:, 0].float()  # [S2, D]
        l_k, l_q = k.shape[0], q.shape[0]
        scores = torch.einsum("ihd,sd->ihs", q.float(), k).relu()
        scores = (scores * w.float().unsqueeze(-1)).sum(dim=1)  # [S1, S2]
        if sparse_mode == 3:
            s = torch.arange(l_k)
            allowed = s.view(1, -1) <= (l_k - l_q) + torch.arange(l_q).view(-1, 1)
            scores = scores.masked_fill(~allowed, float("-inf"))
        for i in range(l_q):
            order = torch.sort(scores[i], descending=True, stable=True).indices
            order = order[torch.isfinite(scores[i][order])][:sparse_count]
            o[i, 0, : order.numel()] = order.to(torch.int32)
    return out, torch.empty(0)


FUNCTIONS = {
    "npu_sparse_flash_attention": npu_sparse_flash_attention,
    "npu_lightning_indexer": npu_lightning_indexer,
}
