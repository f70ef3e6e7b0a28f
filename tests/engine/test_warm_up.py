"""A backend that compiles its kernels at their first call (``BackendSpec.compiles_kernels``)
gets warm-up steps at engine build, eager ones included, so that no request pays a compilation:
its ops are called before any request arrives (and not for a backend that does not ask), with
the token counts the warm-up promises, and the first request's tokens are those of a reference
engine (the warm-up touches no request's cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_core import SamplingParams
from deepinfer_core.backends import BackendSpec
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.ops.norm import rms_norm
from deepinfer_core.testing.managers import manager_with_plugin


def _engine(tiny_dir: Path, compiles: bool, calls: list[int], **config) -> LLMEngine:
    def counting(x, weight, eps):
        calls.append(x.shape[0])  # the rows of this call: the step's tokens
        return rms_norm(x, weight, eps)

    class Plugin:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(
                BackendSpec(
                    name="jit",
                    device_type="cpu",
                    priority=5,
                    ops={"rms_norm": counting},
                    compiles_kernels=compiles,
                )
            )

    manager = manager_with_plugin(Plugin(), "jit_test")
    return LLMEngine(
        EngineConfig(
            model=str(tiny_dir), backend="jit", **({"max_num_seqs": 4, "max_num_batched_tokens": 32} | config)
        ),
        plugins=manager,
    )


def _generate(engine: LLMEngine) -> list[int]:
    engine.add_request("r", list(range(5, 25)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    return list(finished[0].outputs[0].token_ids)


@pytest.mark.parametrize("compiles", [True, False])
def test_a_compiling_backend_runs_its_ops_at_build_before_any_request(tiny_dir: Path, compiles: bool):
    calls: list[int] = []
    engine = _engine(tiny_dir, compiles, calls)
    if not compiles:
        assert calls == []
        return
    # one decode token, a full decode batch (max_num_seqs), a full step (the step's token budget)
    assert {1, 4} <= set(calls) and max(calls) >= 32
    calls.clear()
    reference = LLMEngine(EngineConfig(model=str(tiny_dir), backend="reference", max_num_seqs=4))
    assert _generate(engine) == _generate(reference)
    assert calls  # the backend's op serves the request too


def test_the_warm_up_of_a_step_budget_past_max_model_len_stays_in_the_block_table(tiny_dir: Path):
    """A full step of padding holds positions up to the step's token budget, which may pass
    ``max_model_len``: its pages are the trash slot's (no out-of-bounds column), and the first
    request still gets the reference's tokens."""
    calls: list[int] = []
    engine = _engine(tiny_dir, True, calls, max_model_len=40, max_num_batched_tokens=96)
    assert max(calls) >= 96
    reference = LLMEngine(
        EngineConfig(model=str(tiny_dir), backend="reference", max_num_seqs=4, max_model_len=40)
    )
    assert _generate(engine) == _generate(reference)
