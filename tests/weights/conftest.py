"""Shared fixtures: a tiny random HF DeepSeek-V4 model, its state dict and a saved checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint
from tests.models.hf_oracle import BASE, CONFIGS

transformers = pytest.importorskip("transformers")

# the parity tests' "all_types" model (every layer type, hash and top-k MoE), default rope
TINY_HF_KWARGS: dict[str, Any] = {
    **BASE,
    **{k: v for k, v in CONFIGS["all_types"].items() if k != "rope_parameters"},
}


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
