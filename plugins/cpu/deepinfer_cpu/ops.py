"""The ``cpu`` backend's op implementations: thin wrappers over the C++ kernels
(``csrc/kernels.cpp``) with the reference signatures, and their ``supports`` predicates.

The kernels take float32 CPU tensors and plain tensor pools; any other dtype or device, and a
packed pool (``kv_cache_dtype="fp8"``), is refused with the reason, so the engine runs that call
on the reference."""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer_core.ops import OpImpl, all_ops
from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.modes import batch_invariant_enabled
from deepinfer_core.ops.registry import is_extension

F32 = torch.float32
PROVIDED_OPS = (
    "rms_norm",
    "hc_pre",
    "hc_post",
    "hc_head",
    "sparse_attention",
    "apply_rope",
    "compress_entries",
    "indexer_topk",
)
_NO_INDEX = torch.empty(0, dtype=torch.int64)


def _refusal(tensors: dict[str, torch.Tensor | None]) -> bool | str:
    """``True`` when every given tensor is float32 on the CPU, else the reason naming one."""
    for name, t in tensors.items():
        if t is not None and (t.dtype is not F32 or not t.is_cpu):
            return f"{name} is {t.dtype} on {t.device.type}: the cpu kernels take float32 CPU tensors"
    return True


def _pool_refusal(name: str, pool) -> bool | str:
    """``True`` for a plain float32 CPU tensor pool, else the reason (packed pools are refused)."""
    if not isinstance(pool, torch.Tensor):
        return f"{name} is a {type(pool).__name__}: the cpu kernels read plain float32 tensor pools"
    return _refusal({name: pool})


def _index_args(index: torch.Tensor | PagedIndex) -> tuple:
    """``(rows, block_table, token_rows, counts, entries_per_page, max_count)`` of a source's
    index for the kernels: explicit rows with empty paged fields (``entries_per_page=0``), or
    the paged fields with empty rows."""
    if isinstance(index, PagedIndex):
        return (
            _NO_INDEX,
            index.block_table,
            index.token_rows,
            index.counts,
            index.entries_per_page,
            index.max_count,
        )
    return index, _NO_INDEX, _NO_INDEX, _NO_INDEX, 0, 0


def _index_refusal(name: str, index) -> bool | str:
    tensors = (
        (index.block_table, index.token_rows, index.counts) if isinstance(index, PagedIndex) else (index,)
    )
    for t in tensors:
        if t.dtype != torch.int64 or t.device.type != "cpu":
            return f"{name} is {t.dtype} on {t.device.type}: the cpu kernels take int64 CPU indices"
    return True


def make_ops(ext: ModuleType) -> dict[str, OpImpl]:
    """The op table entries over the loaded extension module ``ext``."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return ext.rms_norm(x, weight, eps)

    def rms_norm_supports(x, weight, eps):
        return _refusal({"x": x, "weight": weight})

    def hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        return ext.hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)

    def hc_pre_supports(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        if sinkhorn_iters < 1:
            return f"sinkhorn_iters={sinkhorn_iters}: the kernel runs at least one normalisation"
        return _refusal({"streams": streams, "fn": fn, "base": base, "scale": scale})

    def hc_post(block_out, streams, post, comb):
        return ext.hc_post(block_out, streams, post, comb)

    def hc_post_supports(block_out, streams, post, comb):
        return _refusal({"block_out": block_out, "streams": streams, "post": post, "comb": comb})

    def hc_head(streams, fn, base, scale, norm_eps, hc_eps):
        return ext.hc_head(streams, fn, base, scale, norm_eps, hc_eps)

    def hc_head_supports(streams, fn, base, scale, norm_eps, hc_eps):
        return _refusal({"streams": streams, "fn": fn, "base": base, "scale": scale})

    def sparse_attention(q, kv_pools, indices, sinks, scale):
        fields = list(zip(*(_index_args(i) for i in indices), strict=True)) or [()] * 6
        return ext.sparse_attention(q, list(kv_pools), *(list(f) for f in fields), sinks, scale)

    def sparse_attention_supports(q, kv_pools, indices, sinks, scale):
        for i, (pool, index) in enumerate(zip(kv_pools, indices, strict=True)):
            for verdict in (_pool_refusal(f"kv_pools[{i}]", pool), _index_refusal(f"indices[{i}]", index)):
                if verdict is not True:
                    return verdict
        return _refusal({"q": q, "sinks": sinks})

    def apply_rope(x, cos, sin):
        return ext.apply_rope(x, cos, sin)

    def apply_rope_supports(x, cos, sin):
        if x.dim() not in (2, 3):
            return f"x has {x.dim()} dimensions: the cpu kernel rotates [T, D] or [T, H, D]"
        return _refusal({"x": x, "cos": cos, "sin": sin})

    def compress_entries(kv, gate, norm_weight, eps, positions, inv_freq, rope_scale, pool, dest, live=None):
        # ``live``: the padding windows are computed too (their rows are the trash page's)
        return ext.compress_entries(kv, gate, norm_weight, eps, positions, inv_freq, rope_scale, pool, dest)

    def compress_entries_supports(
        kv, gate, norm_weight, eps, positions, inv_freq, rope_scale, pool, dest, live=None
    ):
        verdict = _pool_refusal("pool", pool)
        if verdict is not True:
            return verdict
        if pool.dim() != 2 or pool.stride(1) != 1:
            return f"pool has strides {pool.stride()}: the cpu kernel writes [N, D] rows of contiguous values"
        for name, t in (("positions", positions), ("dest", dest)):
            if t.dtype != torch.int64:
                return f"{name} is {t.dtype}: the cpu kernel takes int64 rows and positions"
        return _refusal({"kv": kv, "gate": gate, "norm_weight": norm_weight, "inv_freq": inv_freq})

    def indexer_topk(q, weights, key_pool, candidates, k, scale):
        args = _index_args(candidates)
        return ext.indexer_topk(q, weights, key_pool, *args, k, scale, batch_invariant_enabled())

    def indexer_topk_supports(q, weights, key_pool, candidates, k, scale):
        for verdict in (_pool_refusal("key_pool", key_pool), _index_refusal("candidates", candidates)):
            if verdict is not True:
                return verdict
        return _refusal({"q": q, "weights": weights})

    # The other core ops: the reference is this backend's implementation (plain PyTorch is
    # already fast for them on CPU: GEMMs, embedding, MoE), listed so that the engine does not warn
    # about ops the backend leaves out.  Fused ops with a decomposition are left out: the table
    # runs them as their parts, i.e. on these kernels (``compress_windows``: the reference's
    # staging, then ``compress_entries``; ``hc_post_pre``: ``hc_post``, ``hc_pre``, ``rms_norm``).
    delegated = {
        name: OpImpl(fn=spec.reference)
        for name, spec in all_ops().items()
        if name not in PROVIDED_OPS and not is_extension(name) and spec.decomposition is None
    }
    return delegated | {
        "rms_norm": OpImpl(fn=rms_norm, supports=rms_norm_supports),
        "hc_pre": OpImpl(fn=hc_pre, supports=hc_pre_supports),
        "hc_post": OpImpl(fn=hc_post, supports=hc_post_supports),
        "hc_head": OpImpl(fn=hc_head, supports=hc_head_supports),
        "sparse_attention": OpImpl(fn=sparse_attention, supports=sparse_attention_supports),
        "apply_rope": OpImpl(fn=apply_rope, supports=apply_rope_supports),
        "compress_entries": OpImpl(fn=compress_entries, supports=compress_entries_supports),
        "indexer_topk": OpImpl(fn=indexer_topk, supports=indexer_topk_supports),
    }
