"""Sampling: per-request parameters, logit processing and the batched counter-based sampler."""

from .params import SamplingParams
from .random import derive_seed, gumbel_noise
from .sampler import Sampler, SamplerOutput, SamplingBatch, top_k_top_p_keep, top_logprobs

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "derive_seed",
    "gumbel_noise",
    "top_k_top_p_keep",
    "top_logprobs",
]
