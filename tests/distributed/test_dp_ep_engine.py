"""Attention DP + MoE expert parallelism end to end on the tiny model in fp32 on CPU (gloo):
``LLM(data_parallel_size=N, enable_expert_parallel=True)`` with N = 2 and 4 gives the greedy
tokens and logprobs of a single process: bitwise with ``batch_invariant=True``, within 1e-5
otherwise (each DP rank batches other requests than the single process does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepinfer_core import LLM, SamplingParams
from tests.distributed.outputs import assert_same_completions

PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 2 for j in range(5 + 9 * i)]} for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def _run(model_dir: Path, **options: Any) -> list[Any]:
    with LLM(model=str(model_dir), backend="reference", dtype="float32", **options) as llm:
        world = options.get("data_parallel_size", 1)
        moe = llm.engine.runner.model.layers[0].moe  # rank 0's: it holds 1 / world of the experts
        assert moe.gate_up.shape[0] * world == llm.engine.runner.model.cfg.n_routed_experts
        assert (moe.placement is not None) == (world > 1)
        return [out.outputs[0] for out in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_dp2_ep_matches_single_process(tiny_dir: Path, batch_invariant: bool) -> None:
    want = _run(tiny_dir, batch_invariant=batch_invariant)
    got = _run(tiny_dir, batch_invariant=batch_invariant, data_parallel_size=2, enable_expert_parallel=True)
    assert_same_completions(got, want, exact=batch_invariant)


@pytest.mark.slow
def test_dp4_ep_matches_single_process_bitwise(tiny_dir: Path) -> None:
    want = _run(tiny_dir, batch_invariant=True)
    got = _run(tiny_dir, batch_invariant=True, data_parallel_size=4, enable_expert_parallel=True)
    assert_same_completions(got, want, exact=True)
