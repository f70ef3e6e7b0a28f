"""Access to the Ascend operator libraries the backend's ops call: ``torch_npu`` (CANN's fused
operators) and, where used, TileKernels' Ascend API.

The modules are looked up at the call, never at import: this package imports on machines without
``torch_npu`` (whose import fails without CANN), and the plugin's tests install an emulator of
the documented operator semantics under the same module names (``plugins/ascend950/tests/npu_emulator``).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (imported on first use)."""
    return importlib.import_module("torch_npu")
