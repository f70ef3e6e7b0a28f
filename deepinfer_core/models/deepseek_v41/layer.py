"""One V4.1 block (:class:`DecoderLayer`): (Engram, then) single-pass-mHC-wrapped attention then
MoE; and the Engram memory of a layer (:class:`Engram`: hashed n-gram lookups gated into every
stream)."""

from __future__ import annotations

import torch

from deepinfer_core.models.cache_spec import HybridCache
from deepinfer_core.ops import OpTable
from deepinfer_core.weights.quant import Weight

from .attention import Attention
from .config import DeepseekV41Config
from .engram import EngramLayout
from .metadata import V41StepMetadata
from .moe import MoE
from .ops import op


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
