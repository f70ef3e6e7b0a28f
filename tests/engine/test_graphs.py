"""Decode steps through captured graphs (emulated on CPU): bucketing, padding to the bucket
on the trash slot / page, persistent inputs and the previous step's tokens on the device give
the same results as eager steps."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.graphs import EmulatedGraph, batch_buckets


def _llm(**kw) -> LLM:
    return LLM(backend="reference", max_num_seqs=8, enforce_eager=True, **kw)


def _with_graphs(llm: LLM) -> LLM:
    assert llm.engine.runner.capture_graphs(EmulatedGraph) is None
    assert sorted(llm.engine.runner.graphs) == [1, 2, 4, 8]
    return llm


def _record_replays(llm: LLM) -> list[int]:
    """The batch buckets of the graphs ``llm`` replays from now on, in order (filled as it runs)."""
    replays: list[int] = []
    for b, graph in llm.engine.runner.graphs.items():
        inner = graph.replay
        graph.replay = lambda inner=inner, b=b: replays.append(b) or inner()
    return replays


PROMPTS = [
    {"prompt_token_ids": list(range(5 + 7 * i, 5 + 7 * i + n))} for i, n in enumerate((3, 17, 40, 9, 70))
]


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_graph_decode_equals_eager_bitwise_in_batch_invariant_mode(async_scheduling):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, logprobs=2, ignore_eos=True)
    kw = {"batch_invariant": True, "async_scheduling": async_scheduling}
    want = _llm(**kw).generate(PROMPTS, params, use_tqdm=False)
    llm = _with_graphs(_llm(**kw))
    replays = _record_replays(llm)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert replays and set(replays) <= {4, 8}  # 5 requests pad to 8; 4 or fewer to 4
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs  # bitwise equal floats


def test_graph_decode_equals_eager_bitwise_with_the_fp8_kv_cache():
    """The packed FP8 window ring and compressed entries (``kv_cache_dtype="fp8"``) under the
    fixed-shape graph path: padding rows write the trash rows of the packed pools too."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, logprobs=2, ignore_eos=True)
    kw = {"batch_invariant": True, "kv_cache_dtype": "fp8"}
    want = _llm(**kw).generate(PROMPTS, params, use_tqdm=False)
    llm = _with_graphs(_llm(**kw))
    replays = _record_replays(llm)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert replays
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("fp8", marks=pytest.mark.slow)])
def test_graph_decode_greedy_equals_eager_with_prefix_hits_and_preemption(kv_cache_dtype):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    shared = list(range(100, 164))
    prompts = PROMPTS + [{"prompt_token_ids": shared + [7, 8, 9]}, {"prompt_token_ids": shared + [1, 2]}]
    cfg = {
        "num_cache_pages": 14,
        "page_size": 16,
        "max_num_batched_tokens": 32,
        "kv_cache_dtype": kv_cache_dtype,
    }
    want = _llm(**cfg).generate(prompts, params, use_tqdm=False)
    llm = _with_graphs(_llm(**cfg))
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["num_prefix_hit_tokens"] > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_pad_rows_write_only_the_trash_slot(kv_cache_dtype):
    llm = _with_graphs(_llm(kv_cache_dtype=kv_cache_dtype))
    cache = llm.engine.runner.cache
    w = llm.engine.runner.model_config.sliding_window

    def rows(t):  # the packed bytes of an FP8 pool
        return t if isinstance(t, torch.Tensor) else t.data

    before = {k: rows(t).clone() for k, t in cache._tensors.items()}
    # one request decoding in a bucket of 2 after its prefill: the pad row must not touch slot 1
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    for (layer, name), t in cache._tensors.items():
        if name.endswith(("buf_kv", "buf_gate", "carry_kv", "carry_gate")):
            assert torch.equal(t[1:-1], before[(layer, name)][1:-1]), (layer, name)
        if name == "window":  # ring rows of slots 1 .. num_slots-1
            assert torch.equal(rows(t)[w:-w], before[(layer, name)][w:-w]), (layer, name)
            assert not torch.equal(rows(t)[:w], before[(layer, name)][:w]), (layer, name)
