"""Fixtures of the ascend950 tests: the operator emulator installed as ``torch_npu``, and a
backend ``ascend950_emulated`` (CPU device, the ascend950 backend's own ops) for the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from deepinfer_ascend950 import backend
from deepinfer_ascend950.quant_mx import declared_formats
from npu_emulator import installed

from deepinfer_core.backends import BackendSpec
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.testing import manager_with_plugin


@pytest.fixture(scope="session")
def tiny_v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny DeepSeek-V4 checkpoint, written once."""
    return tiny.make_tiny(tmp_path_factory.mktemp("tiny_v4"))


@pytest.fixture
def npu_emulator():
    """The emulator installed as ``torch_npu`` for the test."""
    with installed() as module:
        yield module


class EmulatedBackend:
    """Registers ``ascend950_emulated``: the ascend950 ops, run on CPU through the emulator."""

    @hookimpl
    def deepinfer_register_backends(self, register):
        register(
            BackendSpec(
                name="ascend950_emulated",
                device_type="cpu",
                priority=1,
                ops=backend.load_ops,
                quantized_weights=declared_formats(),
                kv_formats=backend.KV_FORMATS,
                description="EMULATOR: the ascend950 backend's ops on CPU (tests only)",
            )
        )


@pytest.fixture
def emulated_manager(npu_emulator):
    """A plugin manager with the ``ascend950_emulated`` backend (emulator installed)."""
    return manager_with_plugin(EmulatedBackend(), "ascend950_emulated")
