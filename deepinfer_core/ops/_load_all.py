"""Imports every op family module so that their ops are registered."""

from . import attention, cache, linear, mhc, moe, norm, rope  # noqa: F401
