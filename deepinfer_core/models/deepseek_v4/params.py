"""The parameter inventory of DeepSeek-V4: every tensor the model needs, by HF name.

This is the single source of truth used by weight loading (to check names, shapes and
dtypes), by ``deepinfer make-tiny`` (to create random checkpoints) and by the model (to
bind tensors).  Names follow HF transformers' ``DeepseekV4ForCausalLM`` state dict; the
native DeepSeek names are mapped onto these by :mod:`deepinfer_core.weights.names`.
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
    """All parameters of the model, in a stable order, keyed by HF name."""
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    H, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol = cfg.o_groups, cfg.o_lora_rank
    E, inter, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    ih, ihd = cfg.index_n_heads, cfg.index_head_dim
    hc = (2 + N) * N
    s: dict[str, ParamSpec] = {"model.embed_tokens.weight": ParamSpec((V, D), "embedding")}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        s[a + "sinks"] = ParamSpec((H,), "fp32")
        s[a + "q_a_proj.weight"] = ParamSpec((ql, D), "linear")
        s[a + "q_a_norm.weight"] = ParamSpec((ql,), "fp32")
        s[a + "q_b_proj.weight"] = ParamSpec((H * hd, ql), "linear")
        s[a + "kv_proj.weight"] = ParamSpec((hd, D), "linear")
        s[a + "kv_norm.weight"] = ParamSpec((hd,), "fp32")
        s[a + "o_a_proj.weight"] = ParamSpec((G * ol, H * hd // G), "linear")
        s[a + "o_b_proj.weight"] = ParamSpec((D, G * ol), "linear")
        lt = cfg.layer_types[i]
        if lt in (CSA, HCA):
            r = cfg.compress_rates[lt]
            coff = 2 if lt == CSA else 1  # CSA keeps two overlapping series
            c = a + "compressor."
            s[c + "kv_proj.weight"] = ParamSpec((coff * hd, D), "linear_bf16")
            s[c + "gate_proj.weight"] = ParamSpec((coff * hd, D), "linear_bf16")
            s[c + "position_bias"] = ParamSpec((r, coff * hd), "fp32")
            s[c + "kv_norm.weight"] = ParamSpec((hd,), "fp32")
            if lt == CSA:
                x = c + "indexer."
                s[x + "kv_proj.weight"] = ParamSpec((2 * ihd, D), "linear_bf16")
                s[x + "gate_proj.weight"] = ParamSpec((2 * ihd, D), "linear_bf16")
                s[x + "position_bias"] = ParamSpec((r, 2 * ihd), "fp32")
                s[x + "kv_norm.weight"] = ParamSpec((ihd,), "fp32")
                s[x + "q_b_proj.weight"] = ParamSpec((ih * ihd, ql), "linear")
                s[x + "scorer.weights_proj.weight"] = ParamSpec((ih, D), "linear_bf16")
        m = p + "mlp."
        s[m + "gate.weight"] = ParamSpec((E, D), "linear_bf16")
        if cfg.mlp_layer_types[i] == "hash_moe":
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
    s["model.norm.weight"] = ParamSpec((D,), "fp32")
    s["model.hc_head.hc_fn"] = ParamSpec((N, N * D), "fp32")
    s["model.hc_head.hc_base"] = ParamSpec((N,), "fp32")
    s["model.hc_head.hc_scale"] = ParamSpec((1,), "fp32")
    s["lm_head.weight"] = ParamSpec((V, D), "linear")
    return s


def target_dtype(spec: ParamSpec, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter is held in when the model runs in ``model_dtype``."""
    if spec.kind == "int":
        return torch.int64
    if spec.kind == "fp32":
        return torch.float32
    return model_dtype
