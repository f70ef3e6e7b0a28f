"""Decode graphs under expert parallelism (emulated graphs on CPU, gloo): the EP ranks agree on
one bucket a step (or on running eagerly), replay it with the fixed-shape dispatch
(``capacity = bucket * k``), idle ranks replaying it on padding rows; the greedy tokens and
logprobs equal an eager single process bitwise with ``batch_invariant=True``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.graphs import EMULATE_GRAPHS_ENV
from tests.distributed.outputs import assert_same_completions

# replica 0 gets prompts 0, 2, 4, replica 1 prompts 1, 3 (fewest outstanding, ties to replica 0);
# replica 0's requests finish one by one while replica 1 keeps two: its buckets fall under the
# other's (padded to the peer's bucket) and then it idles (dummy replays)
PROMPTS = [{"prompt_token_ids": [(5 * i + 3 * j) % 190 + 2 for j in range(4 + 7 * i)]} for i in range(5)]
MAX_TOKENS = [3, 14, 5, 14, 7]


def _run(model_dir: Path, **options: Any) -> tuple[list[Any], dict[str, int], list[int]]:
    """The first completions of :data:`PROMPTS`, rank 0's graph statistics and graph buckets."""
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=3, ignore_eos=True) for n in MAX_TOKENS]
    with LLM(model=str(model_dir), backend="reference", dtype="float32", max_num_seqs=4, **options) as llm:
        outputs = [out.outputs[0] for out in llm.generate(PROMPTS, params, use_tqdm=False)]
        runner = llm.engine.runner
        return outputs, dict(runner.ep_graph_stats), sorted(runner.graph_manager.graphs("decode"))


@pytest.mark.slow
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_dp2_ep_decode_graphs_match_eager_single_process(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, batch_invariant: bool
) -> None:
    want, _, no_graphs = _run(tiny_dir, batch_invariant=batch_invariant, enforce_eager=True)
    assert no_graphs == []
    monkeypatch.setenv(EMULATE_GRAPHS_ENV, "1")  # the workers inherit it: every rank captures
    got, stats, buckets = _run(
        tiny_dir, batch_invariant=batch_invariant, data_parallel_size=2, enable_expert_parallel=True
    )
    assert buckets == [1, 2, 4]
    # rank 0 replayed graphs, some padded to rank 1's larger bucket, some on padding rows only,
    # and ran the prefill step eagerly (agreed)
    assert stats["replayed"] > 0 and stats["padded_to_peer"] > 0 and stats["dummy"] > 0, stats
    assert stats["eager"] > 0, stats
    assert_same_completions(got, want, exact=batch_invariant)
