"""DeepSeek-V4.1's text backbone over a flat varlen batch and a paged hybrid KV cache.

The causal encoder-decoder (CED) of the release, layer by layer:

- every layer keeps its own sliding window of ``sliding_window`` K=V rows (an FP8 record in
  the release: :func:`~.ops.kv_qdq` ``fp8_ue8m0``) and attends to it, with a per-head sink;
  with ``kv_cache_dtype="fp8"`` the window, the compressed entries and the indexer keys are
  stored in the release's byte formats (:func:`kv_specs`), otherwise as their ``kv_qdq``
  values in the model dtype -- the same values either way;
- layers with ``compress_ratios[i] == 0`` (the first two) attend to their window only, with
  the ``main`` rope;
- a kv-source layer owns a compressor: ratio 2 (the "encoder" sources) pools each two tokens
  with a softmax gate, ratio 1 (the "decoder" source) projects one entry per token; the latent
  is RMS-normed, its indexer key (``k_norm(wk(latent))``, FP4) and its rotated main entry
  (FP4) go to the group's two paged pools, which the group's other layers read through
  ``alias_of`` cache specs (one allocation per group);
- an index source scores the group's keys with its own queries and keeps the top
  ``index_topk`` visible entries; the other layers of the group reuse its picks ("Reuse"), a
  later index source re-scores ("Reindex");
- the candidate source (the last kv source in the release) also keeps each query's best
  ``candidate_topk_blocks`` blocks of ``candidate_block_size`` entries; every later index
  source scores only inside them (the hierarchical two-level top-k);
- the residual is ``hc_mult`` streams mixed by single-pass mHC (:func:`~.ops.hc_mix`): a site
  collapses its streams with the previous site's ``pre``; the last ``pre`` collapses the final
  streams (no ``hc_head``);
- the MoE is V4's top-k routed one (no hash routing), with the router temperature;
- an Engram layer first adds its hashed n-gram lookup to every stream, gated per stream
  (:mod:`.engram`); each request's look-back ids are carried in a per-slot ring.

Every computation goes through the op table; the ops V4 has none for are
:mod:`deepinfer_core.models.deepseek_v41.ops`.

The decoder-side prefill tail (``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``, off by default: it is
approximate): in a prefill step the layers after the last kv source run only on each request's
last ``tail`` rows (and the rows whose logits are wanted); see :func:`prefill_tail_setting` and
:func:`~.metadata.tail_plan`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer_core.contract.step_inputs import StepInputs
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.cache_spec import CacheSpec, HybridCache, PagedSpec, RingSpec, SlotStateSpec
from deepinfer_core.models.deepseek_v4.fused import FusedProjection
from deepinfer_core.models.deepseek_v4.metadata import buffer_windows
from deepinfer_core.models.deepseek_v4.rope import inv_freq
from deepinfer_core.models.weight_bytes import weight_bytes, weight_storages
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_blockscaled import block_format, packs
from deepinfer_core.ops.kv_format import KVPool, PackedKVPool
from deepinfer_core.weights.quant import Weight

from .config import DeepseekV41Config
from .engram import EngramLayout, hash_multipliers
from .metadata import V41StepMetadata, build_dspark_metadata, build_v41_metadata
from .ops import op

logger = logging.getLogger("deepinfer.model")

WINDOW_KV_FORMAT = ("fp8_ue8m0", 32)
"""The release's window record: every channel (rope included) e4m3, one ue8m0 scale per 32."""
COMPRESSED_KV_FORMAT = ("fp4_e4m3", 16)
"""The release's compressed entries: e2m1, one e4m3 scale per 16 channels."""
INDEXER_FORMAT = ("fp4_ue8m0", 32)
"""The release's indexer keys and queries: e2m1, one ue8m0 scale per 32 channels."""
KV_FORMATS = {"window": WINDOW_KV_FORMAT, "ckv": COMPRESSED_KV_FORMAT, "ikv": INDEXER_FORMAT}
"""The release's format of each cache a V4.1 layer keeps rows of (a ``kv_qdq`` format and block,
also the name of the packed ``kv_format`` of ``kv_cache_dtype="fp8"``)."""


def kv_specs(specs: list[CacheSpec], kv_cache_dtype: str) -> tuple[list[CacheSpec], list[str]]:
    """``specs`` with the window / ``ckv`` / ``ikv`` rows in the release's packed formats when
    ``kv_cache_dtype="fp8"`` (``kv_format`` = their :data:`KV_FORMATS` name: MXFP8 window
    records, NVFP4-like entries, MXFP4 indexer keys), and the names of those kept plain because
    their width is not a whole number of blocks (``kv_qdq`` leaves such rows unchanged, so a
    plain cache holds exactly their values).  ``"auto"``: unchanged."""
    if kv_cache_dtype == "auto":
        return specs, []
    if kv_cache_dtype != "fp8":
        raise ConfigError(f"deepseek_v41: kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    out: list[CacheSpec] = []
    plain: list[str] = []
    for s in specs:
        if isinstance(s, RingSpec | PagedSpec) and s.name in KV_FORMATS:
            fmt, block = KV_FORMATS[s.name]
            assert block_format(fmt).block == block, (fmt, block)  # the pool's block is kv_qdq's
            if packs(fmt, s.dim):
                s = replace(s, kv_format=fmt)
            else:
                plain.append(f"{s.name} ({s.dim} values, {fmt} blocks of {block})")
        out.append(s)
    return out, plain


def store_kv(ops: OpTable, pool: KVPool, rows: torch.Tensor, values: torch.Tensor, fmt: tuple) -> None:
    """``values`` into ``pool`` at ``rows`` with the release's numerics ``fmt``: a packed pool
    quantises them itself (``cache_write``, bit for bit ``kv_qdq``'s values once dequantised), a
    plain one takes their ``kv_qdq`` values.  Never both: a second ``fp4_e4m3`` quantisation of
    ``kv_qdq``'s output is not always a no-op (:mod:`deepinfer_core.ops.kv_blockscaled`)."""
    if not isinstance(pool, PackedKVPool):
        values = op(ops, "kv_qdq")(values, *fmt)
    ops.cache_write(pool, rows, values)


MTP_ON_V41 = (
    "speculative.drafter='mtp': DeepSeek-V4.1 has no MTP layer; its draft layers (mtp.*) are the DSpark "
    "block drafter's: use drafter='dspark'"
)

TAIL_ENV = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
"""Rows per request the decoder layers run on during prefill: unset / ``0`` / ``off`` = every
row (exact, the default); ``auto`` = ``sliding_window + num_spec_tokens``; ``N`` = ``N``
(at least ``sliding_window``).  The seed's engine uses 140."""


def prefill_tail_setting(cfg: DeepseekV41Config, raw: str | None = None) -> int | str | None:
    """The decoder-side prefill tail from :data:`TAIL_ENV` (``raw`` overrides the environment):
    ``None`` (off), ``"auto"`` (``sliding_window + num_spec_tokens``, resolved per step) or a
    row count ``>= sliding_window``; a one-line :class:`ConfigError` naming the variable for
    anything else."""
    raw = os.environ.get(TAIL_ENV, "") if raw is None else raw
    value = raw.strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return None
    if value == "auto":
        return "auto"
    w = cfg.sliding_window
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < w:
        raise ConfigError(
            f"environment variable {TAIL_ENV}={raw!r}: expected 0/off, auto, or a token count >= the "
            f"sliding window ({w}): the decoder layers' windows must be rebuilt by the tail"
        )
    return n


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
        q_res = ops.rms_norm(part["q_a"], self.q_norm, self.eps)
        q = ops.linear(q_res, self.wq_b).view(t, self.heads, self.head_dim)
        kv = ops.rms_norm(part["kv"], self.kv_norm, self.eps)
        cos, sin = rope[self.rope_family]
        qkv = ops.apply_rope(torch.cat([q, kv.unsqueeze(1)], dim=1), cos, sin)
        q, key = qkv[:, : self.heads], qkv[:, self.heads]
        kv = qdq(key, *WINDOW_KV_FORMAT)  # this step's rows, as the ring gives them back
        ring = cache.get(self.layer, "window")
        pools: list[Any] = [ring, kv]
        idx: list[Any] = [md.v4.window_ring, md.v4.window_chunk]
        if self.ratio:
            if self.is_kv_source:
                self._compress(part, md, cache, ops, rope)
            if self.is_index_source:
                shared["picks"] = self._index(q_res, part["i_w"], md, cache, ops, rope, shared)
            pools.append(cache.get(self.layer, "ckv"))
            idx.append(shared["picks"])
        out = ops.sparse_attention(q, pools, idx, self.sinks, self.head_dim**-0.5)
        ops.cache_write(ring, md.v4.ring_rows, key if isinstance(ring, PackedKVPool) else kv)
        out = ops.apply_rope(out, cos, -sin)
        g = self.cfg.o_groups
        out = ops.grouped_linear(out.reshape(t, g, -1), self.wo_a).reshape(t, -1)
        return ops.linear(out, self.wo_b)

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


class MoE:
    """The MoE block of layer ``layer``: ``noaux_tc`` top-k routed experts plus a shared expert.
    ``prefix`` / ``top_k``: a DSpark draft layer's (``mtp.{j}.``, ``dspark_num_experts_per_tok``;
    its expert count is its stacks')."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        layer: int,
        w: dict[str, Weight],
        dtype: torch.dtype,
        prefix: str = "",
        top_k: int | None = None,
    ):
        p = (prefix or f"layers.{layer}.") + "ffn."
        self.cfg = cfg
        self.top_k = cfg.num_experts_per_tok if top_k is None else top_k
        self.bias = w[p + "gate.bias"]
        self.gate_up, self.down = w[p + "experts.gate_up"], w[p + "experts.down"]
        names = ("gate.weight", "shared_experts.w1.weight", "shared_experts.w3.weight")
        self.w_in = FusedProjection([(n, w.pop(p + n)) for n in names], dtype, p.removesuffix("."))
        self.s_down = w[p + "shared_experts.w2.weight"]

    def __call__(self, x: torch.Tensor, ops: OpTable) -> torch.Tensor:
        cfg = self.cfg
        logits, s_gate, s_up = self.w_in(x, ops)
        if cfg.gate_temp != 1.0:
            logits = logits / cfg.gate_temp
        weights, ids = ops.moe_route(
            logits, self.bias, None, self.top_k, cfg.scoring_func, cfg.routed_scaling_factor
        )
        routed = ops.moe_experts(x, ids, weights, self.gate_up, self.down, cfg.swiglu_limit)
        return routed + ops.linear(ops.swiglu(s_gate, s_up, cfg.swiglu_limit), self.s_down)


class Engram:
    """The Engram memory of layer ``layer``: hashed n-gram lookups gated into every stream."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, w: dict[str, Weight], layout: EngramLayout, mult):
        p = f"layers.{layer}.engram."
        i = cfg.engram_layer_ids.index(layer)
        dev = w[p + "q_weight"].device
        self.table, self.wkv = w[p + "embed.weight"], w[p + "wkv.weight"]
        self.q_weight, self.k_weight = w[p + "q_weight"], w[p + "k_weight"]
        self.multipliers = mult[i].to(dev)
        self.primes = torch.tensor([x for per_n in layout.primes[i] for x in per_n], device=dev)
        self.offsets = torch.tensor(layout.offsets[i], device=dev)
        self.eps = cfg.rms_norm_eps

    def __call__(self, h: torch.Tensor, tokens: torch.Tensor, ops: OpTable) -> torch.Tensor:
        """``h`` ``[T, N, D]`` streams, ``tokens`` ``[T, ngram]`` compressed ids -> updated streams."""
        rows = op(ops, "engram_hash")(tokens, self.multipliers, self.primes, self.offsets)
        kv = ops.linear(op(ops, "engram_rows")(self.table, rows, h.dtype), self.wkv)
        return op(ops, "engram_mix")(h, kv, self.q_weight, self.k_weight, self.eps)


class DecoderLayer:
    """One block: (Engram, then) single-pass-mHC-wrapped attention then MoE.  ``prefix`` /
    ``top_k``: a DSpark draft layer's (see :class:`Attention` and :class:`MoE`)."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        layer: int,
        w: dict[str, Weight],
        dtype: torch.dtype,
        engram: Engram | None = None,
        prefix: str = "",
        top_k: int | None = None,
    ):
        p = prefix or f"layers.{layer}."
        self.cfg, self.layer = cfg, layer
        self.engram = engram
        self.attn = Attention(cfg, layer, w, dtype, prefix=p)
        self.moe = MoE(cfg, layer, w, dtype, prefix=p, top_k=top_k)
        self.attn_norm, self.ffn_norm = w[p + "attn_norm.weight"], w[p + "ffn_norm.weight"]
        self.attn_hc = tuple(w[p + f"hc_attn_{k}"] for k in ("fn", "base", "scale"))
        self.ffn_hc = tuple(w[p + f"hc_ffn_{k}"] for k in ("fn", "base", "scale"))

    def __call__(
        self,
        h: torch.Tensor,
        pre: torch.Tensor,
        md: V41StepMetadata,
        cache: HybridCache,
        ops: OpTable,
        rope: dict,
        shared: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(streams [T, N, D], previous site's pre [T, N])`` -> the same after this block."""
        cfg = self.cfg
        eps, hc_eps, it = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        if self.engram is not None:
            h = self.engram(h, shared["engram_tokens"], ops)
        mix = op(ops, "hc_mix")
        attn_pre, post, comb, x = mix(h, pre, *self.attn_hc, eps, hc_eps, it)
        a = self.attn(ops.rms_norm(x, self.attn_norm, eps), md, cache, ops, rope, shared)
        h = ops.hc_post(a, h, post, comb)
        ffn_pre, post, comb, x = mix(h, attn_pre, *self.ffn_hc, eps, hc_eps, it)
        m = self.moe(ops.rms_norm(x, self.ffn_norm, eps), ops)
        return ops.hc_post(m, h, post, comb), ffn_pre


class DeepseekV41Model:
    """DeepSeek-V4.1 causal LM (text backbone).

    Args:
        cfg: the architecture.
        weights: every tensor of :func:`~.params.parameter_specs`, in the run dtype on the run
            device (some :class:`~deepinfer_core.weights.quant.QuantizedTensor` with
            ``keep_quantized``); the model takes the dict over (fused projections are popped).
            With Engram layers it also holds ``engram.token_map`` (``[vocab]`` int64: each token's
            normalised id, built from the tokenizer by ``family.load_weights``).  With the DSpark
            drafter's tensors (``mtp.*``, ``family.load_mtp_weights``) the model also holds the
            drafter (:attr:`dspark`): its forward then writes the drafter's context keys.
        ops: the resolved op table.
    """

    keeps_hidden = False
    """The runner keeps no hidden states for the drafter: the forward writes its context itself."""

    def __init__(self, cfg: DeepseekV41Config, weights: dict[str, Weight], ops: OpTable):
        self.cfg, self.ops, self.w = cfg, ops, weights
        dtype = weights["embed.weight"].dtype
        engrams: dict[int, Engram] = {}
        self.lookback = 0
        if cfg.engram_layer_ids:
            if "engram.token_map" not in weights:
                raise ConfigError(
                    "deepseek_v41: the Engram layers need engram.token_map (see family.load_weights)"
                )
            layout = EngramLayout.from_config(cfg)
            layout.check(cfg)
            self.lookback = cfg.engram_max_ngram_size - 1
            self.token_map = weights.pop("engram.token_map")
            self.engram_pad = self.token_map[cfg.engram_pad_id].clone()
            mult = hash_multipliers(
                cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size
            )
            engrams = {i: Engram(cfg, i, weights, layout, mult) for i in cfg.engram_layer_ids}
        self.layers = [
            DecoderLayer(cfg, i, weights, dtype, engrams.get(i)) for i in range(cfg.num_hidden_layers)
        ]
        self.dspark: Any = None
        """The DSpark drafter (:class:`~.dspark.DSparkHead`) when its weights were given."""
        if "mtp.0.main_proj.weight" in weights:
            from .dspark import DSparkHead

            self.dspark = DSparkHead(cfg, weights, dtype)
        forced = [f.dequantized for layer in self.layers for f in (layer.attn.w_in, layer.moe.w_in)]
        forced = [note for note in forced if note is not None]
        if forced:
            logger.info("fusing projections forced dequantisation at load of: %s", "; ".join(forced))
        dev = weights["embed.weight"].device
        self.rope_params = {}
        for fam in ("main", "compress"):
            inv, scale = inv_freq(cfg, fam)  # type: ignore[arg-type]  (V4's rope, same fields)
            self.rope_params[fam] = (inv.to(dev), scale)
        self.ratios = sorted(set(cfg.compress_ratios) - {0})
        # the first layer after the last kv source (the CED decoder): the prefill tail starts there
        last_source = max(cfg.kv_source_layer_ids, default=cfg.num_hidden_layers)
        self.first_decoder = last_source + 1
        self.prefill_tail = prefill_tail_setting(cfg)
        if self.prefill_tail is not None and self.first_decoder < cfg.num_hidden_layers:
            logger.info(
                "%s=%s: layers %d..%d run during prefill only on each request's last tokens (approximate)",
                TAIL_ENV,
                self.prefill_tail,
                self.first_decoder,
                cfg.num_hidden_layers - 1,
            )

    def tail_tokens(self, num_spec_tokens: int = 0) -> int | None:
        """Rows per request the decoder layers run on during prefill (``None``: all rows, also
        when the model has no layer after its last kv source)."""
        if self.prefill_tail is None or self.first_decoder >= self.cfg.num_hidden_layers:
            return None
        if self.prefill_tail == "auto":
            return self.cfg.sliding_window + num_spec_tokens
        return int(self.prefill_tail)

    @property
    def dtype(self) -> torch.dtype:
        return self.w["embed.weight"].dtype

    def _storages(self) -> dict[int, tuple[int, bool]]:
        """Every storage of a weight the model holds (see :func:`weight_storages`)."""
        return weight_storages([self.w, self.layers, self.dspark], skip=(DeepseekV41Config,))

    def weight_bytes(self) -> int:
        """Bytes of every weight held, each storage once."""
        return weight_bytes(self._storages())

    def quantized_weight_bytes(self) -> int:
        """The part of :meth:`weight_bytes` held quantised."""
        return weight_bytes(self._storages(), quantized_only=True)

    def cache_specs(self, kv_cache_dtype: str = "auto", num_spec_tokens: int = 0) -> list[list[CacheSpec]]:
        """Per layer: its window ring; per kv-source group one entry pool and one indexer-key pool
        (``alias_of`` the source in the group's other layers) and the source's partial windows;
        with the DSpark drafter, then one window ring per draft layer.

        ``kv_cache_dtype="fp8"``: the window, entry and indexer-key rows in the release's byte
        formats (:func:`kv_specs`; at the release's widths 528 bytes per window row, 288 per
        compressed entry, 68 per indexer key), a width that is not a whole number of blocks kept
        in the model dtype (logged)."""
        specs: list[list[CacheSpec]] = []
        plain: set[str] = set()
        per_layer = [layer.attn.cache_specs(num_spec_tokens) for layer in self.layers]
        if self.dspark is not None:  # the draft layers' context rings (cache layers L .. L+M-1)
            per_layer += self.dspark.cache_specs(num_spec_tokens)
        for layer_spec in per_layer:
            layer_specs, kept = kv_specs(layer_spec, kv_cache_dtype)
            specs.append(layer_specs)
            plain.update(kept)
        if plain:
            logger.info(
                "kv_cache_dtype=%r: %s kept in the model dtype (kv_qdq leaves rows of partial blocks "
                "unchanged, so the values are the same)",
                kv_cache_dtype,
                ", ".join(sorted(plain)),
            )
        if self.lookback:  # the Engram look-back ring, kept with the first Engram layer's caches
            first = self.cfg.engram_layer_ids[0]
            specs[first].append(
                SlotStateSpec("engram.ids", (self.lookback + num_spec_tokens,), dtype=torch.int64)
            )
        return specs

    def step_metadata(
        self, inputs: StepInputs, page_size: int, num_slots: int, trash_page: int, num_spec_tokens: int = 0
    ) -> V41StepMetadata:
        """The step's plans (:func:`~.metadata.build_v41_metadata`), derived on the device."""
        return build_v41_metadata(
            inputs,
            self.cfg.sliding_window,
            self.ratios,
            page_size,
            num_slots,
            trash_page,
            num_spec_tokens,
            lookback=self.lookback,
            tail=self.tail_tokens(num_spec_tokens),
        )

    def dspark_step_metadata(
        self, inputs: StepInputs, page_size: int, num_slots: int, trash_page: int, num_spec_tokens: int = 0
    ) -> V41StepMetadata:
        """The plans of a DSpark block step (:func:`~.metadata.build_dspark_metadata`): every
        chunk is one request's block of ``dspark_block_size`` rows anchored at its start."""
        assert self.dspark is not None
        return build_dspark_metadata(
            inputs,
            self.cfg.sliding_window,
            self.dspark.block_size,
            page_size,
            num_slots,
            trash_page,
            num_spec_tokens,
        )

    @torch.inference_mode()
    def dspark_forward(self, md: V41StepMetadata, cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The DSpark block over ``md`` (:meth:`dspark_step_metadata`): float32 base logits
        ``[T, V]`` and collapsed hidden ``[T, D]`` of every row (:meth:`~.dspark.DSparkHead.block`)."""
        if self.dspark is None:
            raise ConfigError("deepseek_v41: the model was built without the DSpark drafter's weights")
        return self.dspark.block(md, cache, self.ops, self._rope(md, self.dtype))

    def mtp_step_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """V4.1 has no MTP layer: a one-line :class:`ConfigError` (its draft layers are DSpark's)."""
        raise ConfigError(MTP_ON_V41)

    def mtp_forward(self, *args: Any, **kwargs: Any) -> Any:
        """V4.1 has no MTP layer: a one-line :class:`ConfigError` (its draft layers are DSpark's)."""
        raise ConfigError(MTP_ON_V41)

    def _rope(self, md: V41StepMetadata, dtype: torch.dtype) -> dict:
        rope: dict = {
            fam: self.ops.rope_cos_sin(md.positions, inv, s, dtype)
            for fam, (inv, s) in self.rope_params.items()
        }
        rope["compress_freqs"] = self.rope_params["compress"]
        return rope

    def _lookback(self, md: V41StepMetadata, cache: HybridCache) -> torch.Tensor:
        """``[T, 1 + K]`` compressed ids of each token and its ``K`` predecessors (the pad id where
        its request has none), from this step's ids and the slot's look-back ring; then this
        step's ids go to the ring (:class:`~.metadata.LookbackPlan`)."""
        plan = md.lookback
        assert plan is not None
        ring = cache.get(self.cfg.engram_layer_ids[0], "engram.ids").view(-1)
        cur = self.token_map.index_select(0, md.input_ids)
        back = torch.cat([cur, ring]).index_select(0, plan.src.clamp(min=0).view(-1)).view(plan.src.shape)
        back = torch.where(plan.src >= 0, back, self.engram_pad)
        self.ops.cache_write(ring, plan.ring_rows, cur)
        return torch.cat([cur.unsqueeze(1), back], dim=1)

    @torch.inference_mode()
    def forward(
        self, md: V41StepMetadata, cache: HybridCache, hidden_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one step; float32 logits ``[len(md.sample_rows), vocab]``.  With a tail plan
        (``md.tail``) the layers after the last kv source run on its rows only; ``hidden_out``
        (every row's final streams) turns it off.  With the DSpark drafter, the step's rows'
        context keys go to its rings too (with the rows and ring plan the last layer ran on)."""
        ops, cfg, w = self.ops, self.cfg, self.w
        x = ops.embedding(md.input_ids, w["embed.weight"])
        rope = self._rope(md, x.dtype)
        t, n = x.shape[0], cfg.hc_mult
        h = x.unsqueeze(1).expand(-1, n, -1).contiguous()
        pre = torch.zeros(t, n, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # the first site collapses stream 0 (all streams start equal)
        shared: dict = {}
        if self.lookback:
            shared["engram_tokens"] = self._lookback(md, cache)
        tail = md.tail if hidden_out is None else None
        capture = set(self.dspark.target_layer_ids) if self.dspark is not None else set()
        features: dict[int, torch.Tensor] = {}  # the DSpark drafter's: stream means entering layers
        for i, layer in enumerate(self.layers):
            if tail is not None and i == self.first_decoder:  # the decoder layers: the kept rows only
                h, pre, rope, shared = _select_rows(tail.rows, h, pre, rope, shared)
                features = {k: v.index_select(0, tail.rows) for k, v in features.items()}
                md = tail.md
            if i in capture:
                features[i] = h.mean(1)
            h, pre = layer(h, pre, md, cache, ops, rope, shared)
        if self.dspark is not None:
            if len(self.layers) in capture:  # id L: the last layer's output streams
                features[len(self.layers)] = h.mean(1)
            feats = [features[i] for i in self.dspark.target_layer_ids]
            self.dspark.write_context(feats, md, cache, ops, rope)
        if hidden_out is not None:
            hidden_out[: h.shape[0]].copy_(h)
        rows = md.sample_rows
        x = op(ops, "hc_collapse")(h.index_select(0, rows), pre.index_select(0, rows))
        x = ops.rms_norm(x, w["norm.weight"], cfg.rms_norm_eps)
        return ops.linear(x, w["head.weight"]).float()


def _select_rows(
    rows: torch.Tensor, h: torch.Tensor, pre: torch.Tensor, rope: dict, shared: dict
) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """The streams, ``pre``, per-row rope tables and shared per-row plans (picks, candidate
    blocks, Engram ids) of ``rows`` only."""

    def sel(v: Any) -> Any:
        if isinstance(v, PagedIndex):
            return v.select(rows)
        if isinstance(v, torch.Tensor):
            return v.index_select(0, rows)
        if isinstance(v, tuple):
            return tuple(sel(x) for x in v)
        return v

    rope = {k: (v if k == "compress_freqs" else sel(v)) for k, v in rope.items()}
    return sel(h), sel(pre), rope, {k: sel(v) for k, v in shared.items()}
