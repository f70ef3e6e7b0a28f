"""Imports every op family module so that their ops are registered."""

from . import attention, linear, mhc, moe, norm, rope  # noqa: F401
