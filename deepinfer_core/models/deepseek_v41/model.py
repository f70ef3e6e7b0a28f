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
from typing import Any

import torch

from deepinfer_core.contract.step_inputs import StepInputs
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.cache_spec import CacheSpec, HybridCache, SlotStateSpec
from deepinfer_core.models.deepseek_v4.rope import inv_freq
from deepinfer_core.models.weight_bytes import weight_bytes, weight_storages
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.weights.quant import Weight

from .config import DeepseekV41Config
from .dspark import DSparkHead
from .engram import EngramLayout, hash_multipliers
from .kv_formats import kv_specs
from .layer import DecoderLayer, Engram
from .metadata import V41StepMetadata, build_dspark_metadata, build_v41_metadata
from .ops import op

logger = logging.getLogger("deepinfer.model")

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
            ops=self.ops,
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
