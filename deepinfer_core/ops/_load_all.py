"""Imports every op family module so that their ops are registered."""

from . import attention, cache, compressor, linear, mhc, moe, norm, rope  # noqa: F401
