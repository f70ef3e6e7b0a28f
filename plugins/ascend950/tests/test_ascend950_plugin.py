"""The ascend950 plugin registers its backend without importing torch_npu."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from deepinfer_ascend950 import backend, plugin

from deepinfer_core.plugins import get_plugins
from deepinfer_core.testing import manager_with_plugin

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def test_plugin_registers_ascend950_backend():
    manager = manager_with_plugin(plugin, "ascend950")
    spec = manager.get_backend("ascend950")
    assert (spec.device_type, spec.priority, spec.plugin) == ("npu", 100, "ascend950")
    assert isinstance(spec.load_ops(), dict)


def test_entry_point_is_installed():
    row = next((r for r in get_plugins().report() if r["name"] == "ascend950"), None)
    assert row is not None, "install the plugin: pip install -e plugins/ascend950"
    assert row["status"] == "loaded" and row["dist"] == "deepinfer-ascend950"


@pytest.mark.slow  # a fresh interpreter
def test_importing_the_plugin_and_listing_plugins_does_not_import_torch_npu():
    code = (
        "import sys, deepinfer_ascend950.plugin\n"
        "from deepinfer_core.plugins import plugins_report\n"
        "plugins_report()\n"
        "print('torch_npu' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # the report runs the probe, which imports torch_npu only when it is installed
    assert done.stdout.strip() == str(HAS_TORCH_NPU)


def test_probe_without_torch_npu_says_how_to_install_it():
    ok, reason = backend.is_available()
    if HAS_TORCH_NPU:
        assert ok or "torch_npu" in reason
    else:
        assert not ok
        assert reason == backend.NOT_INSTALLED and "pip install torch_npu" in reason


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    from deepinfer_core import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step()}
    return [done[str(i)] for i in range(len(prompts))]


def test_the_emulated_backend_serves_the_tiny_model_like_the_reference(emulated_manager, tiny_v4_dir):
    """The engine runs the tiny model through the ascend950 ops on the emulator: greedy tokens
    equal the reference backend's."""
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine

    prompts = [[5, 6, 7, 8], list(range(10, 30))]
    cfg = {"model": str(tiny_v4_dir), "max_num_seqs": 4}
    emulated = LLMEngine(EngineConfig(backend="ascend950_emulated", **cfg), plugins=emulated_manager)
    reference = LLMEngine(EngineConfig(backend="reference", **cfg))
    assert _greedy(emulated, prompts) == _greedy(reference, prompts)


def test_quantised_formats_are_declared_only_with_the_mx_switch(monkeypatch):
    """Without ``DEEPINFER_ASCEND950_MX_ACTIVATIONS`` no op reads quantised weights, so none are
    declared (the engine dequantises at load); with it, FP8 linears and FP4 experts are."""
    from deepinfer_ascend950 import quant_mx

    monkeypatch.delenv(quant_mx.MX_ACTIVATIONS_ENV, raising=False)
    assert manager_with_plugin(plugin, "ascend950").get_backend("ascend950").quantized_weights == ()
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")
    spec = manager_with_plugin(plugin, "ascend950").get_backend("ascend950")
    assert spec.quantized_weights == ("fp8_block", "fp4_experts")
