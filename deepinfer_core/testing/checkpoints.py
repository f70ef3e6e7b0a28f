"""Constructed checkpoints whose behaviour is known in advance (tests and benchmarks)."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint

MTP_PREFIX = "model.mtp.0."


def write_bigram_mtp_checkpoint(out: Path) -> Path:
    """The built-in tiny model with every block's output projections zeroed (attention
    ``o_b_proj``, the experts' and shared expert's ``down_proj``), main layers and MTP block
    alike: the streams carry the token embedding through (scaled), so the target's greedy next
    token is a function of the current token alone.  The MTP layer ignores the hidden state
    (``h_proj = 0``) and passes the next token's embedding through (``e_proj = I``,
    ``enorm = 1``, the main model's final norm): it predicts the token after next exactly as the
    target will decode it greedily.  Written (native names, with the tiny tokenizer) to ``out``,
    which is returned."""
    cfg = DeepseekV4Config.from_dict(dict(tiny.TINY_CONFIG))
    w = tiny.random_weights(cfg)
    for name in w:
        if name.endswith(("o_b_proj.weight", "experts.down_proj", "shared_experts.down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    d = cfg.hidden_size
    w[MTP_PREFIX + "h_proj.weight"] = torch.zeros(d, d)
    w[MTP_PREFIX + "e_proj.weight"] = torch.eye(d)
    w[MTP_PREFIX + "enorm.weight"] = torch.ones(d)
    w[MTP_PREFIX + "norm.weight"] = w["model.norm.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(w, dict(tiny.TINY_CONFIG), out, names="native")
    tiny.write_tokenizer_files(out)
    return out
