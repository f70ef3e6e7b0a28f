"""DeepSeek-V4 attention block: shared-KV MQA over a sliding window plus compressed entries.

Per query at position ``t``: keys are the window ``t-W+1..t`` (from the slot's ring for
earlier steps -- ``W+S`` rows per slot with ``S`` spare rows for speculative drafts, see
:mod:`.metadata` -- from this step's rows otherwise) plus, on CSA layers, the Lightning
Indexer's top-k compressed entries among those closed by ``t`` and, on HCA layers, all of
them; a per-head sink joins the softmax.  K = V, so the output's rope slice is rotated back.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from deepinfer_core.models.cache_spec import CacheSpec, PagedSpec, RingSpec
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.kv_format import PackedKVPool
from deepinfer_core.ops.overlap import fork
from deepinfer_core.weights.quant import Weight

from .compressor import Compressor
from .config import CSA, HCA, SLIDING, DeepseekV4Config
from .fused import FusedProjection
from .metadata import StepMetadata
from .plan_tensors import kept_arange
from .rope import inverse

QUERY_KV = range(2)
"""The query (``q_a``) and window key (``kv``) parts of the block's input projection; the
compressors' (and the indexer's) parts follow."""


def fold_power_of_two(weight: Weight, factor: float) -> tuple[Weight, bool]:
    """``(weight * factor, True)`` when ``factor`` is a power of two and ``weight`` a plain tensor:
    scaling by a power of two is exact (barring subnormals), so a projection by the result is
    bitwise the projection scaled afterwards.  Else ``(weight, False)``: scale afterwards."""
    mantissa, _ = math.frexp(factor)
    if mantissa != 0.5 or not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return weight, False
    return weight * factor, True


class Attention:
    """Attention of layer ``layer`` (weights bound from the model's tensor dict)."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        layer: int,
        w: dict[str, Weight],
        dtype: torch.dtype,
        prefix: str | None = None,
    ):
        # ``prefix``: the block's weight-name prefix (default ``model.layers.{layer}.``; an MTP
        # layer's is ``model.mtp.{i}.`` with ``layer = num_hidden_layers + i``)
        p = (prefix or f"model.layers.{layer}.") + "self_attn."
        self.cfg, self.layer = cfg, layer
        self.kind = cfg.layer_type(layer)
        self.rope_family = "main" if self.kind == SLIDING else "compress"
        self.q_norm, self.wq_b = w[p + "q_a_norm.weight"], w[p + "q_b_proj.weight"]
        self.kv_norm, self.sinks = w[p + "kv_norm.weight"], w[p + "sinks"].float()
        self.wo_a, self.wo_b = w[p + "o_a_proj.weight"], w[p + "o_b_proj.weight"]
        self.heads, self.head_dim, self.eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        self.compressor = self.indexer = None
        # every projection of the block input x runs as one fused matmul (or one per run of
        # parts of one format, see .fused), split afterwards; the parts are popped from ``w``:
        # the fused copy is the only one kept
        in_weights = [(n, w.pop(p + n)) for n in ("q_a_proj.weight", "kv_proj.weight")]
        if self.kind in (CSA, HCA):
            r = cfg.compress_rates[self.kind]
            self.ratio = r
            c = p + "compressor."
            self.compressor = Compressor(c, w, r, cfg.head_dim, self.kind == CSA, "ckv", self.eps)
            in_weights += [("compressor." + n, t) for n, t in self.compressor.pop_in_weights(w)]
            if self.kind == CSA:
                self.indexer = Compressor(c + "indexer.", w, r, cfg.index_head_dim, True, "ikv", self.eps)
                self.wi_q = w[c + "indexer.q_b_proj.weight"]
                in_weights += [("compressor.indexer." + n, t) for n, t in self.indexer.pop_in_weights(w)]
                scorer = "compressor.indexer.scorer.weights_proj.weight"
                # the head weights' scale H**-0.5 folded into the projection where that is exact
                self.head_scale = cfg.index_n_heads**-0.5
                scorer_w, self.scale_folded = fold_power_of_two(w.pop(p + scorer), self.head_scale)
                in_weights.append((scorer, scorer_w))
        self.w_in = FusedProjection(in_weights, dtype, p.removesuffix("."))

    def cache_specs(self, kv_cache_dtype: str = "auto", num_spec_tokens: int = 0) -> list[CacheSpec]:
        """Window ring, plus the compressor's (and indexer's) pools and slot state.

        ``kv_cache_dtype="fp8"`` stores what ``sparse_attention`` reads from the cache -- the
        ring and the compressed entries (``ckv``) -- as packed FP8 rows whose trailing
        ``rope_dim`` channels stay bfloat16; the indexer keys and the compressor state keep
        the model dtype.  ``num_spec_tokens`` (``S``, the most draft tokens of a verify step)
        gives the ring ``S`` spare rows and the compressor state room for the windows
        rejected drafts close (see :mod:`.metadata`).
        """
        ring = RingSpec("window", self.cfg.sliding_window, self.head_dim, spare=num_spec_tokens)
        specs: list[CacheSpec] = [ring]
        for comp in (self.compressor, self.indexer):
            if comp is not None:
                specs += comp.cache_specs(num_spec_tokens)
        if kv_cache_dtype == "auto":
            return specs
        if kv_cache_dtype != "fp8":
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        attended = {"window"} | ({self.compressor.pool_name} if self.compressor is not None else set())
        return [
            replace(s, kv_format="fp8", rope_dim=self.cfg.rope_dim)
            if isinstance(s, RingSpec | PagedSpec) and s.name in attended
            else s
            for s in specs
        ]

    def __call__(
        self, x: torch.Tensor, md: StepMetadata, cache_get, ops: OpTable, rope: dict
    ) -> torch.Tensor:
        """``x`` ``[T, D]`` (normed block input) -> ``[T, D]`` attention output.

        With a context-parallel plan (``md.cp``) ``x`` holds this rank's ``L`` local rows
        (``rope`` is theirs too): the values the caches take from every row -- the window key
        and the compressors' projections -- are all-gathered into natural order, so the caches
        get exactly what a single process writes; the queries are the local rows only.
        """
        cfg, t = self.cfg, x.shape[0]
        cos, sin = rope[self.rope_family]
        # the compressors' cache updates (and their projection, where it is a matmul of its own) on
        # a side branch while the query path runs; with context parallelism they wait for the gather
        local = md.cp is None
        apart = self.compressor is not None and self.w_in.separable(QUERY_KV)
        if apart:
            q_a, kv = self.w_in.project(x, ops, QUERY_KV)
            comp: list[torch.Tensor] = []
        else:
            q_a, kv, *comp = self.w_in(x, ops)

        def compress() -> tuple[list[torch.Tensor], tuple | None]:
            c = self.w_in.project(x, ops, range(len(QUERY_KV), self.w_in.part_count)) if apart else comp
            return c, self._compress(c, md, cache_get, ops, rope) if local else None

        side = None if self.compressor is None else fork(x, compress, *comp, enabled=local)
        q_res = ops.rms_norm(q_a, self.q_norm, self.eps)
        cand = None  # the compressed entries each query may attend (the indexer picks among them)
        if self.compressor is not None:
            cand = md.plans[self.ratio].entries if md.local is None else md.local.entries[self.ratio]
        index = cand is not None and self.indexer is not None and cand.max_count > cfg.index_topk
        if index:  # the indexer's queries beside the attention's (max_count: a static bound)

            def index_queries() -> torch.Tensor:
                iq = ops.linear(q_res, self.wi_q).view(t, cfg.index_n_heads, cfg.index_head_dim)
                return ops.apply_rope(iq, *rope["compress"])

            queries_branch = fork(x, index_queries, q_res, enabled=local)
        q = ops.linear(q_res, self.wq_b).view(t, self.heads, self.head_dim)
        # the queries' per-head norm, the shared key's norm and the rope of both: one op
        q, kv = ops.qk_norm_rope(q, kv, self.kv_norm, self.eps, cos, sin)
        queries = md  # the per-query plans (window rows, visible entries) of the rows of x
        if not local:
            kv, comp = self._gather_rows(md, kv, comp if side is None else side.join()[0])
            queries = md.local
        n = kv.shape[0]  # every row of the step
        ring = cache_get("window")
        chunk = kv
        if isinstance(ring, PackedKVPool):
            # this step's keys in the ring's format too: a key reads the same whether it comes
            # from the ring or from this step's rows, so chunking changes nothing (batch
            # invariance), and a kernel sees one format for every source
            chunk = ring.empty_rows(n)  # every row written whole just below
            # rows 0..n-1: a kept arange (no arange launch per layer and step)
            ops.cache_write(chunk, kept_arange(n, kv.device), kv)
        pools = [ring, chunk]
        idx = [queries.window_ring, queries.window_chunk]
        if side is not None:
            if local:
                comp, (ckv, ikv) = side.join()
            else:
                ckv, ikv = self._compress(comp, md, cache_get, ops, rope)
            if index:
                # the head weights as projected (the op reads any float dtype as float32)
                iw = comp[4] if self.scale_folded else comp[4].float() * self.head_scale
                iq = queries_branch.join()
                cand = ops.indexer_topk(iq, iw, ikv, cand, cfg.index_topk, cfg.index_head_dim**-0.5)
            pools.append(ckv)
            idx.append(cand)
        out = ops.sparse_attention(q, pools, idx, self.sinks, self.head_dim**-0.5)
        # this step's keys into the window ring beside the output projection (no op of the step
        # reads them: the attention above took them from the step's rows)
        store = fork(x, lambda: ops.cache_write(ring, md.ring_rows, kv), kv)
        out = ops.apply_rope(out, *inverse(rope, self.rope_family))
        g = cfg.o_groups
        out = ops.grouped_linear(out.reshape(t, g, -1), self.wo_a).reshape(t, -1)
        out = ops.linear(out, self.wo_b)
        store.join()
        return out

    def _compress(
        self, comp: list[torch.Tensor], md: StepMetadata, cache_get, ops: OpTable, rope: dict
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's closed windows into the compressors' pools (a CSA or HCA layer's):
        ``(kv pool, indexer key pool or None)``."""
        assert self.compressor is not None
        inv_rope = rope["compress_freqs"]
        ckv = self.compressor(comp[0], comp[1], md, cache_get, ops, inv_rope)
        ikv = None if self.indexer is None else self.indexer(comp[2], comp[3], md, cache_get, ops, inv_rope)
        return ckv, ikv

    def _gather_rows(
        self, md: StepMetadata, kv: torch.Tensor, comp: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Context parallelism: the window keys ``kv`` and the compressors' kv / gate
        projections of every row of the step in natural order (one all-gather over the CP
        group), from this rank's local rows; the indexer's per-query head weights stay local."""
        cp = md.cp
        shared = 0 if self.compressor is None else 2 if self.indexer is None else 4
        parts = [kv, *comp[:shared]]
        if len({p.dtype for p in parts}) > 1:  # not one tensor: one gather each
            full = [cp.gather(p) for p in parts]
        else:
            sizes = [p.shape[-1] for p in parts]
            full = list(cp.gather(torch.cat(parts, dim=-1)).split(sizes, dim=-1))
        return full[0], [*full[1:], *comp[shared:]]
