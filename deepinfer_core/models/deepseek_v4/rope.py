"""RoPE frequencies of V4's two rope families (``main``: sliding layers; ``compress``:
CSA/HCA layers, their compressors and the indexer), computed in float32 as transformers
does (default RoPE and YaRN)."""

from __future__ import annotations

import math

import torch

from .config import DeepseekV4Config


def inv_freq(cfg: DeepseekV4Config, family: str) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rope_dim/2] float32, cos/sin scale)`` of rope family ``family``."""
    p = cfg.rope_main if family == "main" else cfg.rope_compress
    dim, base = cfg.rope_dim, p.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if p.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = p.factor if p.factor is not None else 1.0
    orig = p.original_max_position_embeddings or cfg.max_position_embeddings
    scale = p.attention_factor
    if scale is None:
        scale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.beta_fast or 32), correction_dim(p.beta_slow or 1)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(scale)


def inverse(rope: dict, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, -sin)`` of ``family`` in a step's rope tables ``rope`` (``{family: (cos, sin)}``):
    the rotation back, made once a step (on first use) and kept in ``rope`` for the other
    layers."""
    key = (family, "inverse")
    if key not in rope:
        cos, sin = rope[family]
        rope[key] = (cos, -sin)
    return rope[key]
