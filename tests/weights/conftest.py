"""Shared fixtures: a tiny random HF DeepSeek-V4 model, its state dict and a saved checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.weights.writer import save_checkpoint

transformers = pytest.importorskip("transformers")

TINY_HF_KWARGS: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    n_routed_experts=8,
    num_experts_per_tok=2,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,
)


@dataclass(frozen=True)
class TinyModel:
    """A tiny random ``DeepseekV4ForCausalLM`` saved with HF ``save_pretrained``."""

    cfg: DeepseekV4Config
    cfg_dict: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    saved_dir: Path

    def save(self, out: Path, **options: Any) -> list[Path]:
        """Save this model's state dict and config to ``out`` with :func:`save_checkpoint` ``options``."""
        return save_checkpoint(self.state_dict, self.cfg_dict, out, **options)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    torch.manual_seed(0)
    hf_cfg = transformers.DeepseekV4Config(**TINY_HF_KWARGS)
    model = transformers.DeepseekV4ForCausalLM(hf_cfg)
    with torch.no_grad():  # HF zero-initialises some tensors (tid2eid, biases); make all distinctive
        for t in model.state_dict().values():
            if t.dtype.is_floating_point:
                t.copy_(torch.randn_like(t) * 0.05)
            else:
                t.copy_(torch.randint_like(t, TINY_HF_KWARGS["n_routed_experts"]))
    out = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(out)
    cfg_dict = json.loads((out / "config.json").read_text())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return TinyModel(DeepseekV4Config.from_dict(cfg_dict), cfg_dict, state, out)
