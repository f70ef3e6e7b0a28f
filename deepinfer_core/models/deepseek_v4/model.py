"""DeepSeek-V4 over a flat varlen batch and a paged hybrid KV cache.

The model is plain Python over a dict of tensors (HF names, see :mod:`.params`); every
computation goes through the resolved :class:`~deepinfer_core.ops.OpTable`, so backends
swap kernels without touching this code.
"""

from __future__ import annotations

import logging

import torch

from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.contract.step_inputs import StepInputs
from deepinfer_core.models.cache_spec import CacheSpec, HybridCache
from deepinfer_core.models.context_parallel import cp_min_tokens
from deepinfer_core.models.weight_bytes import weight_bytes, weight_storages
from deepinfer_core.ops import OpTable
from deepinfer_core.weights.quant import Weight

from .attention import Attention
from .config import DeepseekV4Config
from .metadata import StepMetadata, with_context_parallel
from .moe import MoE
from .params import MTP_PREFIX
from .plan_op import derive_plans
from .residual import Residual
from .rope import inv_freq

logger = logging.getLogger("deepinfer.model")


class DecoderLayer:
    """One block: mHC-wrapped attention then mHC-wrapped MoE.

    ``layer`` indexes the cache (and the attention kind, :meth:`DeepseekV4Config.layer_type`);
    ``prefix`` is the weights' name prefix, ``model.layers.{layer}.`` by default (a
    multi-token-prediction layer's block: ``model.mtp.{i}.``, ``layer = num_hidden_layers + i``).
    """

    def __init__(
        self,
        cfg: DeepseekV4Config,
        layer: int,
        w: dict[str, Weight],
        dtype: torch.dtype,
        prefix: str | None = None,
        parallel: ParallelState | None = None,
    ):
        p = prefix or f"model.layers.{layer}."
        self.cfg, self.layer = cfg, layer
        self.attn = Attention(cfg, layer, w, dtype, p)
        self.moe = MoE(cfg, layer, w, dtype, p, parallel=parallel)
        self.attn_norm, self.ffn_norm = (
            w[p + "input_layernorm.weight"],
            w[p + "post_attention_layernorm.weight"],
        )
        self.attn_hc = (w[p + "attn_hc.fn"], w[p + "attn_hc.base"], w[p + "attn_hc.scale"])
        self.ffn_hc = (w[p + "ffn_hc.fn"], w[p + "ffn_hc.base"], w[p + "ffn_hc.scale"])

    def __call__(
        self, h: torch.Tensor, md: StepMetadata, cache: HybridCache, ops: OpTable, rope: dict
    ) -> torch.Tensor:
        """``h`` ``[T, N, D]`` streams -> updated streams."""
        return self.run(Residual(h), md, cache, ops, rope).settled(ops)

    def run(self, r: Residual, md: StepMetadata, cache: HybridCache, ops: OpTable, rope: dict) -> Residual:
        """The block on the residual ``r`` (the previous block's output possibly still pending);
        returns the residual with this block's MoE output pending (see :mod:`.residual`)."""
        cfg = self.cfg
        hc = (cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

        def cache_get(name: str) -> torch.Tensor:
            return cache.get(self.layer, name)

        r, x = r.enter(ops, self.attn_hc, self.attn_norm, *hc)
        r = r.leave(self.attn(x, md, cache_get, ops, rope))
        r, x = r.enter(ops, self.ffn_hc, self.ffn_norm, *hc)
        ids, real = (
            (md.input_ids, md.real_tokens) if md.local is None else (md.local.input_ids, md.local.real_tokens)
        )
        return r.leave(self.moe(x, ids, ops, real))


class DeepseekV4Model:
    """DeepSeek-V4 causal LM.

    Args:
        cfg: the architecture.
        weights: every tensor of :func:`~.params.parameter_specs`, by HF name, already in
            the run dtype and on the run device; with ``keep_quantized`` some are
            :class:`~deepinfer_core.weights.quant.QuantizedTensor` (handed to the ops as they
            are).  The model takes the dict over: projections it fuses into one matmul are
            removed from it, so each weight is held once.
        ops: the resolved op table.
        parallel: this process's place in a distributed run (``None`` = a single process):
            with expert parallelism ``weights`` hold only this rank's experts; with
            ``cp_size > 1`` a step holding a prefill chunk of at least :attr:`cp_min_tokens`
            tokens splits it over the CP group (see :mod:`deepinfer_core.models.context_parallel`).

    Attributes:
        cp_min_tokens: the shortest chunk split over a CP group
            (:func:`~deepinfer_core.models.context_parallel.cp_min_tokens` at build time).
    """

    def __init__(
        self,
        cfg: DeepseekV4Config,
        weights: dict[str, Weight],
        ops: OpTable,
        parallel: ParallelState | None = None,
    ):
        self.cfg, self.ops, self.w = cfg, ops, weights
        self.parallel = parallel
        self.cp_min_tokens = cp_min_tokens()
        dtype = weights["model.embed_tokens.weight"].dtype
        self.layers = [
            DecoderLayer(cfg, i, weights, dtype, parallel=parallel) for i in range(cfg.num_hidden_layers)
        ]
        # the first multi-token-prediction layer, when its weights were loaded (the mtp drafter)
        self.mtp = MtpLayer(cfg, 0, weights, dtype) if MtpLayer.present(weights, 0) else None
        blocks = self.layers + ([self.mtp.block] if self.mtp is not None else [])
        forced = [f.dequantized for layer in blocks for f in (layer.attn.w_in, layer.moe.w_in)]
        forced = [note for note in forced if note is not None]
        if forced:
            logger.info(
                "fusing projections forced dequantisation at load of %d fused input projection(s): %s",
                len(forced),
                "; ".join(forced),
            )
        dev = weights["model.embed_tokens.weight"].device
        self.rope_params = {}
        for fam in ("main", "compress"):
            inv, scale = inv_freq(cfg, fam)
            self.rope_params[fam] = (inv.to(dev), scale)
        self.ratios = sorted({cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)} - {0})
        self.mtp_ratios = sorted({cfg.compress_ratio(self.mtp.layer)} - {0}) if self.mtp is not None else []

    def _storages(self) -> dict[int, tuple[int, bool]]:
        """Every storage of a weight the model holds (see :func:`weight_storages`)."""
        return weight_storages([self.w, self.layers, self.mtp], skip=(DeepseekV4Config,))

    def weight_bytes(self) -> int:
        """Bytes of every weight the model holds, each storage counted once (a
        :class:`QuantizedTensor` counts its data and its scales)."""
        return weight_bytes(self._storages())

    def quantized_weight_bytes(self) -> int:
        """The part of :meth:`weight_bytes` held quantised (``QuantizedTensor`` data and scales)."""
        return weight_bytes(self._storages(), quantized_only=True)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (that of the embedding table)."""
        return self.w["model.embed_tokens.weight"].dtype

    def cache_specs(self, kv_cache_dtype: str = "auto", num_spec_tokens: int = 0) -> list[list[CacheSpec]]:
        """Per layer, the caches it keeps between steps; ``kv_cache_dtype="fp8"`` stores the
        attention KV caches (window ring, compressed entries) packed (see ``EngineConfig``);
        ``num_spec_tokens`` sizes the per-slot state so a speculative verify step of up to that
        many drafts can be rolled back by position alone (see :mod:`.metadata`)."""
        specs = [layer.attn.cache_specs(kv_cache_dtype, num_spec_tokens) for layer in self.layers]
        if self.mtp is not None:  # the MTP layer's own caches, at index num_hidden_layers
            specs.append(self.mtp.block.attn.cache_specs(kv_cache_dtype, num_spec_tokens))
        return specs

    @property
    def hidden_shape(self) -> tuple[int, int]:
        """Shape of one token's hidden state as :meth:`forward` keeps it (``hidden_out``): the
        ``hc_mult`` residual streams of the last layer, ``[N, D]``."""
        return (self.cfg.hc_mult, self.cfg.hidden_size)

    def step_metadata(
        self, inputs: StepInputs, page_size: int, num_slots: int, trash_page: int, num_spec_tokens: int = 0
    ) -> StepMetadata:
        """The step's per-token plans (:func:`~.metadata.build_metadata`), derived on the device;
        ``num_spec_tokens`` must be the value :meth:`cache_specs` was given.  On a rank of a
        context-parallel group, a step holding a long prefill chunk also gets the group's row
        split (:func:`~.metadata.with_context_parallel`)."""
        md = self._plans(inputs, self.ratios, page_size, num_slots, trash_page, num_spec_tokens)
        p = self.parallel
        if p is not None and p.cp_size > 1:
            md = with_context_parallel(md, inputs, p.cp_size, p.cp_rank, p.cp_group, self.cp_min_tokens)
        return md

    def _plans(
        self,
        inputs: StepInputs,
        ratios: list[int],
        page_size: int,
        num_slots: int,
        trash_page: int,
        spec: int,
    ) -> StepMetadata:
        window = self.cfg.sliding_window
        return derive_plans(self.ops, inputs, window, ratios, page_size, num_slots, trash_page, spec)

    def _rope(self, md: StepMetadata, dtype: torch.dtype) -> dict:
        rope: dict = {}
        positions = md.positions if md.local is None else md.local.positions
        for fam, (inv, scale) in self.rope_params.items():
            rope[fam] = self.ops.rope_cos_sin(positions, inv, scale, dtype)
        rope["compress_freqs"] = self.rope_params["compress"]
        return rope

    @torch.inference_mode()
    def forward(
        self, md: StepMetadata, cache: HybridCache, hidden_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one step; returns float32 logits ``[len(md.sample_rows), vocab]``.

        ``hidden_out`` (``[>= T, N, D]``, a persistent buffer): also keep every row's last-layer
        streams (before ``hc_head``) there, the hidden states the MTP layer reads; one copy into
        a fixed address, so a captured graph keeps it.

        With a context-parallel plan (``md.cp``) the rows are this rank's local rows; the
        sampling rows' streams (or every row's, for ``hidden_out``) are gathered from their
        owners, so every rank of the group returns the same logits.
        """
        ops, cfg, w = self.ops, self.cfg, self.w
        ids = md.input_ids if md.local is None else md.local.input_ids
        x = ops.embedding(ids, w["model.embed_tokens.weight"])
        rope = self._rope(md, x.dtype)
        r = Residual(x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous())
        for layer in self.layers:
            r = layer.run(r, md, cache, ops, rope)
        h = r.settled(ops)
        if md.cp is not None and hidden_out is None:
            h = md.cp.gather_samples(h)  # only the sampling rows travel
        else:
            if md.cp is not None:
                h = md.cp.gather(h)  # every row, in natural order
            if hidden_out is not None:
                hidden_out[: h.shape[0]].copy_(h)
            h = h.index_select(0, md.sample_rows)
        eps = cfg.rms_norm_eps
        head = (w["model.hc_head.hc_fn"], w["model.hc_head.hc_base"], w["model.hc_head.hc_scale"])
        x = ops.hc_head_norm(h, *head, eps, cfg.hc_eps, w["model.norm.weight"])
        return ops.linear(x, w["lm_head.weight"]).float()

    # ---- multi-token prediction ------------------------------------------------------------
    def mtp_step_metadata(
        self, inputs: StepInputs, page_size: int, num_slots: int, trash_page: int, num_spec_tokens: int = 0
    ) -> StepMetadata:
        """The plans of an MTP step (:meth:`mtp_forward`): as :meth:`step_metadata`, for the
        MTP layer's compress ratio only (none for a sliding-window MTP layer)."""
        return self._plans(inputs, self.mtp_ratios, page_size, num_slots, trash_page, num_spec_tokens)

    @torch.inference_mode()
    def mtp_forward(
        self, md: StepMetadata, cache: HybridCache, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the MTP layer (see :class:`MtpLayer`): row ``j`` at position
        ``t = md.positions[j]`` combines the hidden streams ``hidden[j]`` (``[T, N, D]``: the
        target's last-layer streams at ``t``, or the MTP's own output at ``t - 1`` when drafting
        recursively) with the embedding of ``md.input_ids[j]`` (the token at ``t + 1``), runs
        the MTP block over the MTP layer's own caches at ``t`` and predicts the token at
        ``t + 2``.  Returns float32 logits of ``md.sample_rows`` and the output streams of
        every row ``[T, N, D]`` (the next depth's ``hidden``)."""
        if self.mtp is None:
            raise RuntimeError("the model was built without its multi-token-prediction layer")
        rope = self._rope(md, hidden.dtype)
        return self.mtp(hidden, md, cache, self.ops, rope)


class MtpLayer:
    """DeepSeek-V4 multi-token-prediction layer ``index`` (weights ``model.mtp.{index}.*``, see
    :func:`~.params.mtp_parameter_specs`), as vLLM's ``DeepSeekV4MultiTokenPredictorLayer``.

    For a row at position ``t`` with hidden streams ``h`` ``[N, D]`` and next-token embedding
    ``e`` (zeroed at ``t == 0``)::

        x = h_proj(hnorm(h)) + e_proj(enorm(e))      # per stream; e broadcast over the N streams
        x = block(x)                                  # a V4 decoder block (cache layer N_layers + index)
        logits = head(norm(hc_head(x)))               # predicts the token at t + 2

    ``x`` (the block's output streams) is also the hidden state of the next draft depth.  The
    embedding and head are the layer's own when the checkpoint has them, else the main model's.
    """

    def __init__(self, cfg: DeepseekV4Config, index: int, w: dict[str, Weight], dtype: torch.dtype):
        p = f"{MTP_PREFIX}{index}."
        self.cfg, self.index = cfg, index
        self.layer = cfg.num_hidden_layers + index  # its cache layer
        self.embed = (
            w[p + "embed_tokens.weight"] if p + "embed_tokens.weight" in w else w["model.embed_tokens.weight"]
        )
        self.head = w[p + "lm_head.weight"] if p + "lm_head.weight" in w else w["lm_head.weight"]
        self.enorm, self.hnorm = w[p + "enorm.weight"], w[p + "hnorm.weight"]
        self.e_proj, self.h_proj = w[p + "e_proj.weight"], w[p + "h_proj.weight"]
        self.hc_head = (w[p + "hc_head.hc_fn"], w[p + "hc_head.hc_base"], w[p + "hc_head.hc_scale"])
        self.norm = w[p + "norm.weight"]
        self.block = DecoderLayer(cfg, self.layer, w, dtype, p)

    @staticmethod
    def present(w: dict[str, Weight], index: int) -> bool:
        """Whether ``w`` holds MTP layer ``index``'s weights."""
        return f"{MTP_PREFIX}{index}.e_proj.weight" in w

    def __call__(
        self, hidden: torch.Tensor, md: StepMetadata, cache: HybridCache, ops: OpTable, rope: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        t, n, d = hidden.shape
        e = ops.embedding(md.input_ids, self.embed)
        e = torch.where((md.positions == 0).unsqueeze(-1), torch.zeros_like(e), e)  # as vLLM: no input at 0
        e = ops.linear(ops.rms_norm(e, self.enorm, eps), self.e_proj)
        h = ops.linear(ops.rms_norm(hidden, self.hnorm, eps).reshape(t * n, d), self.h_proj).view(t, n, d)
        x = self.block(h + e.unsqueeze(1), md, cache, ops, rope)
        y = ops.hc_head_norm(x.index_select(0, md.sample_rows), *self.hc_head, eps, cfg.hc_eps, self.norm)
        return ops.linear(y, self.head).float(), x
