"""EMULATOR (tests only, never imported at run time): plain-torch functions written from the
published documentation of the Ascend operators the ``ascend950`` backend calls, installed in
place of the real ``torch_npu`` module when no NPU is present.

Each submodule holds one family's emulated entry points in ``FUNCTIONS`` (name -> function);
every function's docstring cites the document it follows and says where documents disagree or
are silent.  :func:`installed` puts a module named ``torch_npu`` made of them into
``sys.modules`` for the duration of a ``with`` block, so the backend's own code (layouts, block
tables, scale repetition, index conventions) runs on CPU.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

from . import attention, graphs, moe

FAMILIES = (attention, moe)


def build_module() -> types.ModuleType:
    """A ``torch_npu`` stand-in holding every family's emulated functions."""
    module = types.ModuleType("torch_npu")
    module.__doc__ = "EMULATOR of torch_npu's documented operator semantics (DeepInfer tests)"
    for family in FAMILIES:
        for name, fn in family.FUNCTIONS.items():
            assert not hasattr(module, name), f"{name} emulated twice"
            setattr(module, name, fn)
    module.npu = graphs.NAMESPACE  # torch_npu.npu's graph API
    return module


@contextlib.contextmanager
def installed() -> Iterator[types.ModuleType]:
    """Install the emulator as ``torch_npu`` (restoring whatever was there on exit)."""
    saved = sys.modules.get("torch_npu")
    module = sys.modules["torch_npu"] = build_module()
    try:
        yield module
    finally:
        if saved is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = saved
