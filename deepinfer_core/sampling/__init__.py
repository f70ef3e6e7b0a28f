"""Sampling: per-request parameters and the batched sampler."""

from .params import SamplingParams
from .sampler import Sampler, SamplerOutput, SamplingBatch, derive_seed, make_generator, top_k_top_p_keep

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "derive_seed",
    "make_generator",
    "top_k_top_p_keep",
]
