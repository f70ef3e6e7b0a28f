"""Imports every op family module so that their ops are registered."""

from . import attention, cache, compressor, expert_parallel, linear, mhc, moe, norm, rope, sampling  # noqa: F401
