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
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.outputs[0] for o in engine.step()}
    return [done[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.slow  # two engines on the tiny model
def test_quantised_weights_through_the_mx_ops_follow_the_reference(
    npu_emulator, emulated_manager, quantized_dir, monkeypatch
):
    """With MX activations on, every FP8 linear whose K is a multiple of 32 and every FP4 expert
    runs through ``npu_quant_matmul`` / ``npu_grouped_matmul`` (emulated) on the checkpoint's own
    bytes; every prompt's greedy continuation starts with the reference's token, whose
    log-probability is the reference's within 0.3 (measured: 0.15; MXFP8 activations in every
    linear and expert of a random tiny model; later tokens may part: measured, 22 of 24 equal)."""
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")
    cfg = {"model": str(quantized_dir), "max_num_seqs": 4, "enforce_eager": True}
    emulated = LLMEngine(
        EngineConfig(backend="ascend950_emulated", keep_quantized=True, **cfg), plugins=emulated_manager
    )
    model = emulated.runner.model
    assert isinstance(model.layers[0].moe.gate_up, QuantizedTensor)
    calls = {"npu_quant_matmul": 0, "npu_grouped_matmul": 0, "npu_moe_gating_top_k": 0}
    for name in calls:
        monkeypatch.setattr(npu_emulator, name, _counted(getattr(npu_emulator, name), name, calls))
    reference = LLMEngine(EngineConfig(backend="reference", keep_quantized=False, **cfg))
    got, want = _run(emulated), _run(reference)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids[0] == w.token_ids[0]
        first = w.token_ids[0]
        assert abs(g.logprobs[0][first] - w.logprobs[0][first]) < 0.3
    assert all(calls.values()), calls
