"""Sampling: per-request parameters, logit processing and the batched counter-based sampler."""

from .batch import SamplingBatch
from .filters import top_k_top_p_keep
from .logprobs import top_logprobs
from .params import SamplingParams
from .random import derive_seed, gumbel_noise
from .sampler import Sampler, SamplerOutput

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
