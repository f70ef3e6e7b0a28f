"""EMULATOR of ``torch_npu.npu_kv_quant_sparse_flash_attention`` (QSFA), written from its published
documentation.  Tests only.

Source: Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_kv_quant_sparse_flash_attention.md``
(signature with ``key_quant_mode`` / ``value_quant_mode``, ``quant_scale_repo_mode``,
``tile_size``, ``rope_head_dim``, ``key_dtype``; the formula
``softmax(Q @ Dequant(K, Scale_K)^T / sqrt(d_k)) @ Dequant(V, Scale_V)``; the key layout
``KV_D = 656 = nope 512 + rope 64 * 2 + dequant_scale 4 * 4``, the rope part in the query's dtype
and the scales float32, in that order per its example; query ``Q_D = 576`` = q_nope 512 +
q_rope 64; the Ascend 950PR/950DT constraints).  The index conventions (valid entries first, a
list ends at its first ``-1``, an index past the kv length selects nothing) are those of
``npu_sparse_flash_attention``, whose page this one extends (:mod:`.attention_sfa`).

Where the page is silent or disagrees, chosen here:

- ``Dequant(x, s)`` = ``float(x) * s`` with one float32 scale per 128 consecutive nope values of
  a row ("Per-Token-Head-Tile-128"); the value operand is the dequantised 512-wide nope part of
  ``value`` (MLA-absorb: K and V are one tensor, V without its rope).  The rope part is not
  quantised (it takes the query's dtype).
- the logits are ``(q_nope·k_nope + q_rope·k_rope) * scale_value`` as in
  ``npu_sparse_flash_attention``'s ``attention_mode=2`` (the page's formula writes ``Q @ K``
  over the whole 576-wide head).
- the return: the page's return section gives the output the query's shape (576 wide), its
  example prints a 512-wide output; returned here ``[T, N, 512]`` (the value's width), one
  tensor (the page lists no softmax statistics).
- no ``sinks`` argument exists on the page: none is taken.
- precision: float32 throughout, one rounding to the query's dtype at the end.
- ``hifloat8`` keys are not emulated (refused); ``int8`` and ``float8_e4m3fn`` are.
"""

from __future__ import annotations

import torch

from .attention_sfa import _key_sequence, _query_batches, _require

_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 128)
_NOPE, _ROPE, _TILE = 512, 64, 128
_KV_D = _NOPE + 2 * _ROPE + 4 * (_NOPE // _TILE)


def _dequant_rows(rows: torch.Tensor, rope_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows ``[S, 656]`` (their own dtype) -> (nope ``[S, 512]``, rope ``[S, 64]``) in fp32."""
    b = rows.contiguous().view(torch.uint8)
    values = b[:, :_NOPE].contiguous().view(rows.dtype).float()
    rope = b[:, _NOPE : _NOPE + 2 * _ROPE].contiguous().view(rope_dtype).float()
    scales = b[:, _NOPE + 2 * _ROPE :].contiguous().view(torch.float32)  # [S, 4]
    nope = (values.view(-1, _NOPE // _TILE, _TILE) * scales.unsqueeze(-1)).view(-1, _NOPE)
    return nope, rope


def npu_kv_quant_sparse_flash_attention(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    key_quant_mode,
    value_quant_mode,
    *,
    key_dequant_scale=None,
    value_dequant_scale=None,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=2**63 - 1,
    next_tokens=2**63 - 1,
    attention_mode=0,
    quant_scale_repo_mode=1,
    tile_size=128,
    rope_head_dim=64,
    key_dtype=None,
    value_dtype=None,
):
    """EMULATOR of ``torch_npu.npu_kv_quant_sparse_flash_attention`` (see the module docstring).

    Per query row ``i`` of batch ``b``: the kept positions as in ``npu_sparse_flash_attention``
    (``sparse_mode`` 0 or 3), the logits of the dequantised keys, the softmax over them, and
    its product with the dequantised values; a row that keeps no position returns zeros.
    """
    _require(key_quant_mode == 2 and value_quant_mode == 2, "key/value_quant_mode must be 2 (per tile)")
    _require(
        key_dequant_scale is None and value_dequant_scale is None, "key/value_dequant_scale are reserved"
    )
    _require(quant_scale_repo_mode == 1, "quant_scale_repo_mode must be 1 (scales stored in the rows)")
    _require(tile_size == _TILE and rope_head_dim == _ROPE, "tile_size 128 and rope_head_dim 64 only")
    _require(attention_mode == 2, "attention_mode must be 2 (MLA-absorb)")
    _require(key_dtype is None and value_dtype is None, "hifloat8 keys are not emulated")
    _require(sparse_mode in (0, 3), f"sparse_mode {sparse_mode} is not 0 or 3")
    _require(sparse_block_size == 1, "Ascend 950: sparse_block_size must be 1")
    _require(pre_tokens == 2**63 - 1 and next_tokens == 2**63 - 1, "pre/next_tokens take the default only")
    _require(query.dtype in (torch.bfloat16, torch.float16), f"query dtype {query.dtype}: bf16 or fp16")
    _require(
        key.dtype in (torch.int8, torch.float8_e4m3fn) and value.dtype == key.dtype,
        f"key / value dtype {key.dtype} / {value.dtype}: int8 or float8_e4m3fn, equal",
    )
    _require(
        query.is_contiguous() and sparse_indices.is_contiguous(), "query / sparse_indices not contiguous"
    )
    _require(sparse_indices.dtype == torch.int32, "sparse_indices must be int32")
    _require(query.shape[-1] == _NOPE + _ROPE, f"query D must be {_NOPE + _ROPE}, got {query.shape[-1]}")
    _require(key.shape[-1] == value.shape[-1] == _KV_D, f"key / value D must be {_KV_D}")
    _require(key.shape[-2] == value.shape[-2] == 1, "KV_N must be 1")
    _require(query.shape[-2] in _HEADS, f"Q_N must be one of {_HEADS}, got {query.shape[-2]}")
    _require(sparse_indices.shape[-1] > 0, "sparse_size must be > 0")
    queries = _query_batches(query, layout_query, actual_seq_lengths_query)
    picks = _query_batches(sparse_indices, layout_query, actual_seq_lengths_query)
    out = torch.zeros(*query.shape[:-1], _NOPE, dtype=torch.float32)
    out_rows = _query_batches(out, layout_query, actual_seq_lengths_query)
    for b, (q, idx, o) in enumerate(zip(queries, picks, out_rows, strict=True)):
        k_nope, k_rope = _dequant_rows(
            _key_sequence(key, layout_kv, b, actual_seq_lengths_kv, block_table)[:, 0], query.dtype
        )
        v, _ = _dequant_rows(
            _key_sequence(value, layout_kv, b, actual_seq_lengths_kv, block_table)[:, 0], query.dtype
        )
        l_kv, l_q = k_nope.shape[0], q.shape[0]
        qf = q.float()
        for i in range(l_q):
            row = idx[i, 0].tolist()
            row = row[: row.index(-1)] if -1 in row else row
            limit = l_kv if sparse_mode == 0 else min(l_kv, l_kv - l_q + i + 1)
            keep = torch.tensor([j for j in row if 0 <= j < limit], dtype=torch.long)
            if keep.numel() == 0:
                continue
            logits = qf[i, :, :_NOPE] @ k_nope[keep].T + qf[i, :, _NOPE:] @ k_rope[keep].T
            o[i] = torch.softmax(logits * scale_value, dim=-1) @ v[keep]
    return out.to(query.dtype)


FUNCTIONS = {"npu_kv_quant_sparse_flash_attention": npu_kv_quant_sparse_flash_attention}
