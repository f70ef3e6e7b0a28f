"""The cuda_sm100 plugin registers its backend and explains why it is unavailable."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_cuda_sm100 import backend, plugin

from deepinfer_core.backends import resolve_backend
from deepinfer_core.errors import BackendError
from deepinfer_core.plugins import get_plugins
from deepinfer_core.testing import manager_with_plugin


def test_plugin_registers_cuda_sm100_backend():
    manager = manager_with_plugin(plugin, "cuda_sm100")
    spec = manager.get_backend("cuda_sm100")
    assert (spec.device_type, spec.priority, spec.supports_graph_capture, spec.plugin) == (
        "cuda",
        100,
        True,
        "cuda_sm100",
    )


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_load_ops_provides_the_kernels():
    from deepinfer_cuda_sm100.ops import PROVIDED_OPS

    spec = manager_with_plugin(plugin, "cuda_sm100").get_backend("cuda_sm100")
    ops = spec.load_ops()
    assert sorted(ops) == sorted(PROVIDED_OPS)
    assert all(impl.supports is not None and impl.sample_cases is not None for impl in ops.values())


def test_entry_point_is_installed():
    row = next((r for r in get_plugins().report() if r["name"] == "cuda_sm100"), None)
    assert row is not None, "install the plugin: pip install -e plugins/cuda_sm100"
    assert row["status"] == "loaded" and row["dist"] == "deepinfer-cuda-sm100"
    assert [b["name"] for b in row["backends"]] == ["cuda_sm100"]


def expected_reason() -> str | None:
    if not torch.cuda.is_available():
        return "torch" if torch.version.cuda is None else "torch.cuda.is_available() is False"
    if torch.cuda.get_device_capability() < (9, 0):
        return "compute capability"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


def test_probe_reports_the_missing_requirement_precisely():
    ok, reason = backend.is_available()
    expected = expected_reason()
    if expected is None:
        assert ok and reason is None
    else:
        assert not ok and expected in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_selecting_it_without_cuda_is_refused_with_the_reason():
    with pytest.raises(BackendError, match=r"'cuda_sm100' .*not available: .*CUDA"):
        resolve_backend("cuda_sm100")
