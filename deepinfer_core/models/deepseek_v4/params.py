"""The parameter inventory of DeepSeek-V4: every tensor the model needs, by HF name.

This is the single source of truth used by weight loading (to check names, shapes and
dtypes), by ``deepinfer make-tiny`` (to create random checkpoints) and by the model (to
bind tensors).  Names follow HF transformers' ``DeepseekV4ForCausalLM`` state dict; the
native DeepSeek names are mapped onto these by :mod:`deepinfer_core.models.deepseek_v4.names`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CSA, HCA, DeepseekV4Config


@dataclass(frozen=True)
class ParamSpec:
    """Expected shape and kind of one parameter.

    ``kind`` is ``"linear"`` (a 2-D ``[out, in]`` matmul weight, quantisable to FP8),
    ``"experts"`` (a 3-D ``[E, out, in]`` stack, quantisable to FP4), ``"fp32"`` (kept in
    float32 whatever the model dtype: norms, mHC, sinks, biases), ``"embedding"`` or
    ``"int"`` (integer tables such as ``tid2eid``).
    """

    shape: tuple[int, ...]
    kind: str

    @property
    def dtype_class(self) -> str:
        """``"int"`` for integer tables, ``"float"`` otherwise."""
        return "int" if self.kind == "int" else "float"


def parameter_specs(cfg: DeepseekV4Config) -> dict[str, ParamSpec]:
    """All parameters of the model, in a stable order, keyed by HF name (the MTP layers'
    are separate: :func:`mtp_parameter_specs`)."""
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    s: dict[str, ParamSpec] = {"model.embed_tokens.weight": ParamSpec((V, D), "embedding")}
    for i in range(cfg.num_hidden_layers):
        s.update(
            block_specs(cfg, f"model.layers.{i}.", cfg.layer_types[i], cfg.mlp_layer_types[i] == "hash_moe")
        )
    s["model.norm.weight"] = ParamSpec((D,), "fp32")
    s["model.hc_head.hc_fn"] = ParamSpec((N, N * D), "fp32")
    s["model.hc_head.hc_base"] = ParamSpec((N,), "fp32")
    s["model.hc_head.hc_scale"] = ParamSpec((1,), "fp32")
    s["lm_head.weight"] = ParamSpec((V, D), "linear")
    return s


MTP_PREFIX = "model.mtp."
"""HF-style names of the multi-token-prediction layers: ``model.mtp.{i}.<name>``, the block's
tensors under the same sub-names as a main layer's (``self_attn.*``, ``mlp.*``, ``attn_hc.*``,
...), mapped from the native ``mtp.{i}.*`` by :mod:`deepinfer_core.models.deepseek_v4.names`."""

MTP_SHARED = ("embed_tokens.weight", "lm_head.weight")
"""MTP tensors a checkpoint may leave out: the layer then shares the main model's embedding
(``model.embed_tokens.weight``) and output head (``lm_head.weight``)."""


def mtp_parameter_specs(cfg: DeepseekV4Config, layers: range | None = None) -> dict[str, ParamSpec]:
    """The parameters of the multi-token-prediction layers ``layers`` (default: all
    ``num_nextn_predict_layers``), keyed by HF-style name (:data:`MTP_PREFIX`).

    Per layer ``i``: ``enorm`` / ``hnorm`` (RMS norms of the next token's embedding and of the
    target's hidden streams), ``e_proj`` / ``h_proj`` (``D -> D``), the head's stream collapse
    ``hc_head.*``, its norm and output head (``lm_head``, optional: :data:`MTP_SHARED`), an
    optional own embedding, and one V4 block whose attention kind is ``mtp_layer_types[i]`` and
    whose MoE is top-k routed (no hash routing).
    """
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    s: dict[str, ParamSpec] = {}
    for i in range(cfg.num_nextn_predict_layers) if layers is None else layers:
        p = f"{MTP_PREFIX}{i}."
        s[p + "embed_tokens.weight"] = ParamSpec((V, D), "embedding")
        s[p + "enorm.weight"] = ParamSpec((D,), "fp32")
        s[p + "hnorm.weight"] = ParamSpec((D,), "fp32")
        s[p + "e_proj.weight"] = ParamSpec((D, D), "linear")
        s[p + "h_proj.weight"] = ParamSpec((D, D), "linear")
        s.update(block_specs(cfg, p, cfg.layer_type(cfg.num_hidden_layers + i), False))
        s[p + "hc_head.hc_fn"] = ParamSpec((N, N * D), "fp32")
        s[p + "hc_head.hc_base"] = ParamSpec((N,), "fp32")
        s[p + "hc_head.hc_scale"] = ParamSpec((1,), "fp32")
        s[p + "norm.weight"] = ParamSpec((D,), "fp32")
        s[p + "lm_head.weight"] = ParamSpec((V, D), "linear")
    return s


def block_specs(cfg: DeepseekV4Config, p: str, kind: str, hash_moe: bool) -> dict[str, ParamSpec]:
    """The parameters of one decoder block under prefix ``p`` (``model.layers.{i}.``):
    attention of ``kind`` (sliding / CSA / HCA), MoE (hash-routed when ``hash_moe``), mHC."""
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    H, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol = cfg.o_groups, cfg.o_lora_rank
    E, inter, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    hc = (2 + N) * N
    s: dict[str, ParamSpec] = {}
    a = p + "self_attn."
    s[a + "sinks"] = ParamSpec((H,), "fp32")
    s[a + "q_a_proj.weight"] = ParamSpec((ql, D), "linear")
    s[a + "q_a_norm.weight"] = ParamSpec((ql,), "fp32")
    s[a + "q_b_proj.weight"] = ParamSpec((H * hd, ql), "linear")
    s[a + "kv_proj.weight"] = ParamSpec((hd, D), "linear")
    s[a + "kv_norm.weight"] = ParamSpec((hd,), "fp32")
    s[a + "o_a_proj.weight"] = ParamSpec((G * ol, H * hd // G), "linear")
    s[a + "o_b_proj.weight"] = ParamSpec((D, G * ol), "linear")
    if kind in (CSA, HCA):
        r = cfg.compress_rates[kind]
        coff = 2 if kind == CSA else 1  # CSA keeps two overlapping series
        c = a + "compressor."
        s[c + "kv_proj.weight"] = ParamSpec((coff * hd, D), "linear_bf16")
        s[c + "gate_proj.weight"] = ParamSpec((coff * hd, D), "linear_bf16")
        s[c + "position_bias"] = ParamSpec((r, coff * hd), "fp32")
        s[c + "kv_norm.weight"] = ParamSpec((hd,), "fp32")
        if kind == CSA:
            x = c + "indexer."
            s[x + "kv_proj.weight"] = ParamSpec((2 * ihd, D), "linear_bf16")
            s[x + "gate_proj.weight"] = ParamSpec((2 * ihd, D), "linear_bf16")
            s[x + "position_bias"] = ParamSpec((r, 2 * ihd), "fp32")
            s[x + "kv_norm.weight"] = ParamSpec((ihd,), "fp32")
            s[x + "q_b_proj.weight"] = ParamSpec((ih * ihd, ql), "linear")
            s[x + "scorer.weights_proj.weight"] = ParamSpec((ih, D), "linear_bf16")
    m = p + "mlp."
    s[m + "gate.weight"] = ParamSpec((E, D), "linear_bf16")
    if hash_moe:
        s[m + "gate.tid2eid"] = ParamSpec((V, k), "int")
    else:
        s[m + "gate.e_score_correction_bias"] = ParamSpec((E,), "fp32")
    s[m + "experts.gate_up_proj"] = ParamSpec((E, 2 * inter, D), "experts")
    s[m + "experts.down_proj"] = ParamSpec((E, D, inter), "experts")
    s[m + "shared_experts.gate_proj.weight"] = ParamSpec((inter, D), "linear")
    s[m + "shared_experts.up_proj.weight"] = ParamSpec((inter, D), "linear")
    s[m + "shared_experts.down_proj.weight"] = ParamSpec((D, inter), "linear")
    s[p + "input_layernorm.weight"] = ParamSpec((D,), "fp32")
    s[p + "post_attention_layernorm.weight"] = ParamSpec((D,), "fp32")
    for h in ("attn_hc", "ffn_hc"):
        s[p + f"{h}.fn"] = ParamSpec((hc, N * D), "fp32")
        s[p + f"{h}.base"] = ParamSpec((hc,), "fp32")
        s[p + f"{h}.scale"] = ParamSpec((3,), "fp32")
    return s


def target_dtype(spec: ParamSpec, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter is held in when the model runs in ``model_dtype``."""
    if spec.kind == "int":
        return torch.int64
    if spec.kind == "fp32":
        return torch.float32
    return model_dtype
