"""EMULATOR: the moe family's torch_npu entry points (see the package docstring)."""

from __future__ import annotations

FUNCTIONS: dict = {}
