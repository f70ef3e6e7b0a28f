"""The engine serves the tiny model written with FP8 (E8M0 block scales) / FP4 weights through
the ascend950 ops on the operator emulator, weights kept quantised, against the reference on the
dequantised weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from deepinfer_ascend950 import quant_mx

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.weights.quant import QuantizedTensor

PROMPTS = [[5, 6, 7, 8], list(range(10, 40)), [3]]


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a native FP8 (128x128 blocks, ue8m0 scales) / FP4 checkpoint."""
    return tiny.make_tiny(
        tmp_path_factory.mktemp("fp8_fp4_ue8m0"),
        names="native",
        fp8_linear=True,
        fp4_experts=True,
        scale_dtype="ue8m0",
    )


def _counted(fn, name: str, calls: dict):
    def call(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return call


def _run(engine: LLMEngine) -> list:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.outputs[0] for o in engine.step()}
    return [done[str(i)] for i in range(len(PROMPTS))]


@pytest.fixture
def mx_on(monkeypatch):
    """The MX switch on before the backend is registered (its ``quantized_weights`` read it)."""
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")


@pytest.mark.slow  # two engines on the tiny model
def test_quantised_weights_through_the_mx_ops_follow_the_reference(
    mx_on, npu_emulator, emulated_manager, quantized_dir, monkeypatch
):
    """With MX activations on, the backend declares the FP8 / FP4 formats, so the engine keeps
    them quantised without ``keep_quantized``; every FP8 linear whose K is a multiple of 32 and
    every FP4 expert (and the grouped ``o_a`` projection) runs through ``npu_quant_matmul`` /
    ``npu_grouped_matmul`` (emulated) on the checkpoint's own bytes.  MXFP8 activations in every
    linear and expert of a random tiny model, whose next-token distribution is nearly flat: the
    reference's first token is among the five most likely of every prompt, its log-probability
    within 0.3 of the reference's (measured: at most 0.24; two of the three first tokens equal,
    the third a near tie the reference breaks by 0.06)."""
    cfg = {"model": str(quantized_dir), "max_num_seqs": 4, "enforce_eager": True}
    emulated = LLMEngine(EngineConfig(backend="ascend950_emulated", **cfg), plugins=emulated_manager)
    model = emulated.runner.model
    assert isinstance(model.layers[0].moe.gate_up, QuantizedTensor)
    assert isinstance(model.layers[0].attn.wo_a, QuantizedTensor)
    calls = {"npu_quant_matmul": 0, "npu_grouped_matmul": 0, "npu_moe_gating_top_k": 0}
    for name in calls:
        monkeypatch.setattr(npu_emulator, name, _counted(getattr(npu_emulator, name), name, calls))
    reference = LLMEngine(EngineConfig(backend="reference", keep_quantized=False, **cfg))
    got, want = _run(emulated), _run(reference)
    for g, w in zip(got, want, strict=True):
        first = w.token_ids[0]
        assert first in g.logprobs[0]
        assert abs(g.logprobs[0][first] - w.logprobs[0][first]) < 0.3
    assert all(calls.values()), calls


@pytest.mark.slow  # two engines on the tiny model
def test_without_the_mx_switch_weights_are_dequantised_at_load_and_tokens_equal_the_reference(
    npu_emulator, emulated_manager, quantized_dir, monkeypatch
):
    """Without the switch the backend declares no quantised format: the engine dequantises the
    FP8 / FP4 weights at load (no op would read them quantised), so greedy tokens equal the
    reference's."""
    monkeypatch.delenv(quant_mx.MX_ACTIVATIONS_ENV, raising=False)
    assert emulated_manager.get_backend("ascend950_emulated").quantized_weights == ()
    cfg = {"model": str(quantized_dir), "max_num_seqs": 4, "enforce_eager": True}
    emulated = LLMEngine(EngineConfig(backend="ascend950_emulated", **cfg), plugins=emulated_manager)
    model = emulated.runner.model
    assert not isinstance(model.layers[0].moe.gate_up, QuantizedTensor)
    reference = LLMEngine(EngineConfig(backend="reference", **cfg))
    got, want = _run(emulated), _run(reference)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
