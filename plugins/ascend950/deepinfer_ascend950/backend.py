"""The ``ascend950`` backend: availability probe (torch_npu + a visible NPU) and ops."""

from __future__ import annotations

import importlib
import importlib.util

NOT_INSTALLED = (
    "torch_npu is not installed (on a machine with the CANN toolkit: pip install torch_npu, the "
    "build matching your torch and CANN; or from the root of a DeepInfer checkout: "
    "pip install -e 'plugins/ascend950[npu]')"
)

KV_FORMATS = {"fp8": "fp8_tile128"}
"""The backend's packed KV format substitutes (``BackendSpec.kv_formats``): the caches a model
packs as ``fp8`` are stored in the per-tile rows ``npu_kv_quant_sparse_flash_attention`` reads
(:class:`~deepinfer_core.ops.kv_tile.TileFp8KVPool`)."""


def is_available() -> tuple[bool, str | None]:
    """``(True, None)`` when an Ascend NPU is usable here, else ``(False, reason)``.

    ``torch_npu`` is imported only when :func:`importlib.util.find_spec` finds it: importing
    it registers the ``npu`` device with torch and fails without the CANN runtime.
    """
    if importlib.util.find_spec("torch_npu") is None:
        return False, NOT_INSTALLED
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # typically a missing or mismatched CANN runtime
        return False, f"torch_npu is installed but failed to import ({type(exc).__name__}: {exc}); check CANN"
    import torch

    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return False, "torch_npu imported but torch.npu.is_available() is False: no NPU is visible"
    return True, None


def load_ops() -> dict:
    """The op implementations: each family module's ``OPS`` (op name -> ``OpImpl``); every op
    not listed falls back to the reference (logged by the engine)."""
    from deepinfer_ascend950 import ops_attention, ops_moe

    ops: dict = {}
    for module in (ops_attention, ops_moe):
        clash = ops.keys() & module.OPS.keys()
        assert not clash, f"ops defined twice: {sorted(clash)}"
        ops.update(module.OPS)
    return ops
