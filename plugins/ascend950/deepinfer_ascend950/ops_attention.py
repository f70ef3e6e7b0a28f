"""Ascend 950 ops of the attention side: sparse attention, indexer + top-k, cache writes in the
NPU's KV layout, mHC, RMSNorm, RoPE (``torch_npu`` fused operators).

``OPS`` maps each implemented op to its :class:`~deepinfer_core.ops.OpImpl`; the operators are
looked up at the call (:func:`deepinfer_ascend950.npu.torch_npu`), so building ``OPS`` never
imports ``torch_npu``.  The modules: :mod:`.attention_sparse` (``sparse_attention``,
``indexer_topk``), :mod:`.attention_kvquant` (``sparse_attention`` over packed FP8 pools),
:mod:`.attention_rowwise` (``rms_norm``, ``apply_rope``, ``cache_write``), :mod:`.attention_mhc`
(``hc_pre``, ``hc_post``, ``hc_head``); conformance cases at the operators' shapes in
:mod:`.attention_cases`.  Every other attention-side op (``compress_entries``,
``compress_pool``, ``rope_cos_sin``) runs on the reference: torch_npu has no fused operator for
them (``plugins/ascend950/README.md``).
"""

from __future__ import annotations

from deepinfer_core.ops import OpImpl
from deepinfer_core.ops.kv_format import PackedKVPool

from . import attention_cases, attention_kvquant, attention_mhc, attention_rowwise, attention_sparse


def _packed(kv_pools) -> bool:
    return any(isinstance(p, PackedKVPool) for p in kv_pools)


def sparse_attention(q, kv_pools, indices, sinks, scale):
    """``sparse_attention`` on ``npu_kv_quant_sparse_flash_attention`` for packed sources
    (:mod:`.attention_kvquant`), on ``npu_sparse_flash_attention`` otherwise."""
    impl = attention_kvquant if _packed(kv_pools) else attention_sparse
    return impl.sparse_attention(q, kv_pools, indices, sinks, scale)


def sparse_attention_supports(q, kv_pools, indices, sinks, scale):
    """The supports predicate of the operator :func:`sparse_attention` would call."""
    impl = attention_kvquant if isinstance(kv_pools, list | tuple) and _packed(kv_pools) else attention_sparse
    return impl.sparse_attention_supports(q, kv_pools, indices, sinks, scale)


OPS: dict = {
    "sparse_attention": OpImpl(
        sparse_attention, sparse_attention_supports, attention_cases.sparse_attention_cases
    ),
    "indexer_topk": OpImpl(
        attention_sparse.indexer_topk, attention_sparse.indexer_topk_supports, attention_cases.indexer_cases
    ),
    "rms_norm": OpImpl(attention_rowwise.rms_norm, attention_rowwise.rms_norm_supports),
    "apply_rope": OpImpl(attention_rowwise.apply_rope, attention_rowwise.apply_rope_supports),
    "cache_write": OpImpl(attention_rowwise.cache_write, attention_rowwise.cache_write_supports),
    "hc_pre": OpImpl(attention_mhc.hc_pre, attention_mhc.hc_pre_supports),
    "hc_post": OpImpl(attention_mhc.hc_post, attention_mhc.hc_post_supports),
    "hc_head": OpImpl(attention_mhc.hc_head, attention_mhc.hc_head_supports),
}
