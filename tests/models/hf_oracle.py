"""Tiny random HF ``DeepseekV4ForCausalLM`` models: the oracle of the parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    n_routed_experts=8,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    hc_mult=4,
    max_position_embeddings=4096,
    eos_token_id=1,
    bos_token_id=0,
)

# Each covers a different mix of layer types, MoE kinds, windows, ratios and rope settings.
CONFIGS = {
    "all_types": dict(
        num_hidden_layers=4,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 16},
        sliding_window=8,
        index_topk=4,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64},
    ),
    "csa_small_window": dict(
        num_hidden_layers=3,
        layer_types=[CSA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        compress_rates={CSA: 2, HCA: 8},
        sliding_window=4,
        index_topk=3,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "hca_topk_moe": dict(
        num_hidden_layers=3,
        layer_types=[HCA, SLIDING, HCA],
        mlp_layer_types=["moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=16,
        index_topk=8,
    ),
}


def build_hf_model(name: str, seed: int = 0):
    """A random HF model of config ``name`` with weights scaled so logits are well separated."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**BASE, **CONFIGS[name])
    model = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif pname.endswith(("position_bias", "sinks", "base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif pname.endswith("scale"):
                p.fill_(1.0)
            else:  # norm weights
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                gate.tid2eid.copy_(
                    torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(cfg.vocab_size)])
                )
            else:
                gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
    return model


def save_hf_model(model, out: Path) -> Path:
    """``save_pretrained`` as safetensors; returns the directory."""
    model.save_pretrained(out, safe_serialization=True)
    return out
