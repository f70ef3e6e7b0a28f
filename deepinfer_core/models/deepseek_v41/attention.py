"""V4.1 attention: each layer's sliding window, plus on compressed layers the entries its
kv-source group shares (Reuse / Reindex, the two-level top-k) and a DSpark draft layer's context
keys."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deepinfer_core.models.cache_spec import CacheSpec, HybridCache, PagedSpec, RingSpec, SlotStateSpec
from deepinfer_core.models.deepseek_v4.fused import FusedProjection
from deepinfer_core.models.deepseek_v4.metadata import buffer_windows
from deepinfer_core.models.deepseek_v4.rope import inverse
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.kv_format import PackedKVPool
from deepinfer_core.ops.overlap import fork
from deepinfer_core.weights.quant import Weight

from .config import DeepseekV41Config
from .kv_formats import COMPRESSED_KV_FORMAT, INDEXER_FORMAT, WINDOW_KV_FORMAT, store_kv
from .metadata import V41StepMetadata
from .ops import op


class Attention:
    """Attention of layer ``layer``: window + (for compressed layers) the group's shared entries.

    ``prefix``: the block's tensors' prefix (default ``layers.{layer}.``; a DSpark draft layer's is
    ``mtp.{j}.`` with ``layer = num_hidden_layers + j``, its cache layer).  A draft layer projects
    ``wkv`` apart from ``wq_a``: its context keys (:meth:`write_context`) need only ``wkv``."""

    def __init__(
        self, cfg: DeepseekV41Config, layer: int, w: dict[str, Weight], dtype: torch.dtype, prefix: str = ""
    ):
        p = (prefix or f"layers.{layer}.") + "attn."
        self.cfg, self.layer = cfg, layer
        self.ratio = cfg.compress_ratio(layer)
        self.rope_family = "compress" if self.ratio else "main"
        self.heads, self.head_dim, self.eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        self.q_norm, self.wq_b = w[p + "q_norm.weight"], w[p + "wq_b.weight"]
        self.kv_norm, self.sinks = w[p + "kv_norm.weight"], w[p + "attn_sink"].float()
        self.wo_a, self.wo_b = w[p + "wo_a.weight"], w[p + "wo_b.weight"]
        self.source = cfg.kv_source(layer) if self.ratio else None
        self.is_kv_source = cfg.is_kv_source(layer)
        self.is_index_source = cfg.is_index_source(layer)
        in_weights = [(n, w.pop(p + n)) for n in ("wq_a.weight", "wkv.weight")]
        self.parts = ["q_a", "kv"]
        self.w_kv: FusedProjection | None = None  # a draft layer's wkv, apart
        if layer >= cfg.num_hidden_layers:
            self.w_kv = FusedProjection(in_weights[1:], dtype, p + "wkv")
            in_weights, self.parts = in_weights[:1], ["q_a"]
        if self.is_kv_source:
            c = p + "compressor."
            self.c_norm = w[c + "norm.weight"]
            in_weights.append(("compressor.wkv.weight", w.pop(c + "wkv.weight")))
            self.parts.append("c_kv")
            if self.ratio > 1:
                in_weights.append(("compressor.wgate.weight", w.pop(c + "wgate.weight")))
                self.parts.append("c_gate")
        if self.is_index_source:
            x = p + "indexer."
            self.wi_q = w[x + "wq_b.weight"]
            in_weights.append(("indexer.weights_proj.weight", w.pop(x + "weights_proj.weight")))
            self.parts.append("i_w")
            if self.is_kv_source:
                self.wi_k, self.i_k_norm = w[x + "wk.weight"], w[x + "k_norm.weight"]
        self.w_in = FusedProjection(in_weights, dtype, p.removesuffix("."))

    def cache_specs(self, num_spec_tokens: int = 0) -> list[CacheSpec]:
        """The window ring; for a compressed layer the group's entry pools (owned by the kv
        source, ``alias_of`` it elsewhere) and, for a pooling kv source, its partial windows
        (plain formats: :func:`kv_specs` packs them for ``kv_cache_dtype="fp8"``)."""
        cfg = self.cfg
        specs: list[CacheSpec] = [
            RingSpec("window", cfg.sliding_window, self.head_dim, spare=num_spec_tokens)
        ]
        if not self.ratio:
            return specs
        r, src = self.ratio, self.source
        own = self.is_kv_source
        specs.append(PagedSpec("ckv", r, self.head_dim, alias_of=None if own else (src, "ckv")))
        if self.is_index_source:
            specs.append(PagedSpec("ikv", r, cfg.index_head_dim, alias_of=None if own else (src, "ikv")))
        if own and r > 1:
            nb = buffer_windows(r, num_spec_tokens)
            specs += [
                SlotStateSpec("ckv.buf_kv", (nb * r, self.head_dim)),
                SlotStateSpec("ckv.buf_gate", (nb * r, self.head_dim)),
            ]
        return specs

    def __call__(
        self, x: torch.Tensor, md: V41StepMetadata, cache: HybridCache, ops: OpTable, rope: dict, shared: dict
    ) -> torch.Tensor:
        """``x`` ``[T, D]`` (normed block input) -> ``[T, D]``; ``shared`` carries the step's
        picks and candidate blocks from the index sources to the layers after them."""
        t = x.shape[0]
        part = dict(zip(self.parts, self.w_in(x, ops), strict=True))
        if self.w_kv is not None:
            part["kv"] = self.w_kv(x, ops)[0]
        qdq = op(ops, "kv_qdq")
        # this step's entries into the group's pools on a side branch while the query path runs
        compress = bool(self.ratio) and self.is_kv_source
        side = fork(
            x,
            lambda: self._compress(part, md, cache, ops, rope) if compress else None,
            *part.values(),
            enabled=compress,
        )
        q_res = ops.rms_norm(part["q_a"], self.q_norm, self.eps)
        q = ops.linear(q_res, self.wq_b).view(t, self.heads, self.head_dim)
        cos, sin = rope[self.rope_family]
        # the key's norm and the rope of the (unnormed) queries and the key: one op
        q, key = ops.qk_norm_rope(q, part["kv"], self.kv_norm, self.eps, cos, sin, norm_q=False)
        kv = qdq(key, *WINDOW_KV_FORMAT)  # this step's rows, as the ring gives them back
        ring = cache.get(self.layer, "window")
        pools: list[Any] = [ring, kv]
        idx: list[Any] = [md.v4.window_ring, md.v4.window_chunk]
        side.join()
        if self.ratio:
            if self.is_index_source:
                shared["picks"] = self._index(q_res, part["i_w"], md, cache, ops, rope, shared)
            pools.append(cache.get(self.layer, "ckv"))
            idx.append(shared["picks"])
        out = ops.sparse_attention(q, pools, idx, self.sinks, self.head_dim**-0.5)
        # this step's keys into the window ring beside the output projection (read next step)
        row = key if isinstance(ring, PackedKVPool) else kv
        store = fork(x, lambda: ops.cache_write(ring, md.v4.ring_rows, row), row)
        out = ops.apply_rope(out, *inverse(rope, self.rope_family))
        g = self.cfg.o_groups
        out = ops.grouped_linear(out.reshape(t, g, -1), self.wo_a).reshape(t, -1)
        out = ops.linear(out, self.wo_b)
        store.join()
        return out

    def write_context(
        self, m: torch.Tensor, ring_rows: torch.Tensor, cache: HybridCache, ops: OpTable, rope: dict
    ) -> None:
        """A DSpark draft layer's context keys: ``RMSNorm(wkv m)`` rotated at each row's position
        (``main`` rope) into its window ring at ``ring_rows``, as :meth:`__call__` stores a
        step's own keys (the window record's numerics)."""
        assert self.w_kv is not None, "only a draft layer writes context keys"
        kv = ops.rms_norm(self.w_kv(m, ops)[0], self.kv_norm, self.eps)
        key = ops.apply_rope(kv.unsqueeze(1), *rope["main"])[:, 0]
        store_kv(ops, cache.get(self.layer, "window"), ring_rows, key, WINDOW_KV_FORMAT)

    def _compress(
        self, part: dict, md: V41StepMetadata, cache: HybridCache, ops: OpTable, rope: dict
    ) -> None:
        """This step's new entries into the group's pools: ratio 1, one per token; ratio ``r``,
        one per window of ``r`` tokens closed this step (softmax-gated pooling, no position
        bias), the tokens of unfinished windows buffered per slot (V4's plan)."""
        r, layer, write = self.ratio, self.layer, ops.cache_write
        if r == 1:
            latent = ops.rms_norm(part["c_kv"], self.c_norm, self.eps)
            assert md.full is not None
            dest = md.full.dest
            cos, sin = rope["compress"]
        else:
            plan = md.v4.plans[r]
            buf_kv = cache.get(layer, "ckv.buf_kv").view(-1, self.head_dim)
            buf_gate = cache.get(layer, "ckv.buf_gate").view(-1, self.head_dim)
            latent = None
            if plan.windows.shape[0]:  # zero: no window closes (an unpadded step), or no tokens
                stage_kv = F.embedding(plan.windows, torch.cat([buf_kv, part["c_kv"]]))  # [M, r, hd]
                stage_gate = F.embedding(plan.windows, torch.cat([buf_gate, part["c_gate"]])).float()
                latent = ops.rms_norm(ops.compress_pool(stage_kv, stage_gate), self.c_norm, self.eps)
                dest = plan.dest
                inv, scale = rope["compress_freqs"]
                cos, sin = ops.rope_cos_sin(plan.positions, inv, scale, latent.dtype)
            write(buf_kv, plan.buf_rows, part["c_kv"])
            write(buf_gate, plan.buf_rows, part["c_gate"])
            if latent is None:
                return
        if self.is_index_source:  # the group's indexer keys, from the pre-rope latent
            k = ops.rms_norm(ops.linear(latent, self.wi_k), self.i_k_norm, self.eps)
            store_kv(ops, cache.get(layer, "ikv"), dest, ops.apply_rope(k, cos, sin), INDEXER_FORMAT)
        store_kv(ops, cache.get(layer, "ckv"), dest, ops.apply_rope(latent, cos, sin), COMPRESSED_KV_FORMAT)

    def _index(
        self,
        q_res: torch.Tensor,
        weights: torch.Tensor,
        md: V41StepMetadata,
        cache: HybridCache,
        ops: OpTable,
        rope: dict,
        shared: dict,
    ) -> Any:
        """The entries this layer (and the group's layers up to the next index source) attend to."""
        cfg, t = self.cfg, q_res.shape[0]
        entries = md.entries(self.ratio)
        keys = cache.get(self.layer, "ikv")
        iq = ops.linear(q_res, self.wi_q).view(t, cfg.index_n_heads, cfg.index_head_dim)
        iq = op(ops, "kv_qdq")(ops.apply_rope(iq, *rope["compress"]), *INDEXER_FORMAT)
        iw = weights.float() * cfg.index_n_heads**-0.5
        scale = cfg.index_head_dim**-0.5
        if self.layer == cfg.candidate_source_layer_id:
            nb, bs = cfg.candidate_topk_blocks, cfg.candidate_block_size
            # a static bound: with at most nb blocks visible every block is a candidate
            shared["candidates"] = (
                op(ops, "candidate_blocks")(iq, iw, keys, entries, nb, bs, scale)
                if entries.max_count > nb * bs
                else None
            )
        candidates = shared.get("candidates") if cfg.uses_candidates(self.layer) else None
        if candidates is None and entries.max_count <= cfg.index_topk:
            return entries  # every visible entry (a static bound, not a tensor value)
        pool = entries if candidates is None else candidates
        return ops.indexer_topk(iq, iw, keys, pool, cfg.index_topk, scale)
