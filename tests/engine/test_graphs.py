"""Decode steps through captured graphs (emulated on CPU): bucketing, padding to the bucket
on the trash slot / page, persistent inputs and the previous step's tokens on the device give
the same results as eager steps."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.graphs import EmulatedGraph, batch_buckets
from deepinfer_core.testing.observe import record_replays


def _llm(**kw) -> LLM:
    return LLM(**{"backend": "reference", "max_num_seqs": 8, "enforce_eager": True, **kw})


def _with_graphs(llm: LLM) -> LLM:
    assert llm.engine.runner.capture_graphs(EmulatedGraph) is None
    assert sorted(llm.engine.runner.graph_manager.graphs("decode")) == [1, 2, 4, 8]
    return llm


def _record_replays(llm: LLM) -> list[int]:
    """The batch buckets of the graphs ``llm`` replays from now on, in order (filled as it runs)."""
    replays: list[int] = []
    for b, graph in llm.engine.runner.graph_manager.graphs("decode").items():
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


@pytest.mark.slow
def test_released_graphs_are_gone_and_the_runner_runs_eagerly():
    """``release_graphs`` (a distributed run's shutdown) drops every graph; the engine then
    steps eagerly with the same results."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=2, ignore_eos=True)
    llm, replays = _mixed_llm(batch_invariant=True, **MIXED)
    want = llm.generate(MANY, params, use_tqdm=False)
    assert "decode" in replays and "mixed" in replays
    runner = llm.engine.runner
    runner.release_graphs()
    assert runner.graph_manager.summary() == {}
    for name in ("decode", "verify", "mixed"):
        assert runner.graph_manager.graphs(name) == {}, name
    replays.clear()
    got = llm.generate(MANY, params, use_tqdm=False)
    assert replays == []
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


@pytest.mark.slow
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


def _mixed_llm(**kw) -> tuple[LLM, list[str]]:
    """An engine with emulated decode and mixed-step graphs, and the kinds it replays."""
    llm = _llm(**kw)
    runner = llm.engine.runner
    assert runner.capture_graphs(EmulatedGraph) is None
    assert runner.graph_manager.graphs("mixed"), "no mixed-step graph captured"
    replays: list[str] = []
    record_replays(
        {
            "decode": runner.graph_manager.graphs("decode"),
            "verify": runner.graph_manager.graphs("verify"),
            "mixed": runner.graph_manager.graphs("mixed"),
        },
        replays,
    )
    return llm, replays


MIXED = {"max_num_seqs": 4, "max_num_batched_tokens": 48, "mixed_graph_max_tokens": 64}
"""Twelve prompts through four slots, chunks of at most 48 tokens: successors are prefilled
beside the others' decodes (mixed steps of at most 52 tokens: the 52-token mixed graph)."""
MANY = [{"prompt_token_ids": list(range(3 + i, 3 + i + n))} for i, n in enumerate((5, 30, 70, 12) * 3)]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_step_graphs_equal_eager_bitwise_in_batch_invariant_mode(async_scheduling):
    """Steps that prefill a request beside the others' decodes replay the mixed-step graph of
    their token bucket (padded to every slot, the pad rows on the trash slot) and give the
    eager steps' tokens and logprobs bit for bit, with async scheduling (decodes taking the
    previous step's tokens on the device) and without."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=2, ignore_eos=True)
    kw = {**MIXED, "batch_invariant": True, "async_scheduling": async_scheduling}
    want = _llm(**kw).generate(MANY, params, use_tqdm=False)
    llm, replays = _mixed_llm(**kw)
    assert sorted(llm.engine.runner.graph_manager.graphs("mixed")) == [52]
    got = llm.generate(MANY, params, use_tqdm=False)
    assert replays.count("mixed") >= 8 and "decode" in replays, replays
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


@pytest.mark.slow
def test_mixed_step_graphs_with_prefix_hits_preemption_and_speculation():
    """Greedy tokens through mixed-step graphs equal eager steps' with prefix-cache hits (SWA
    replay chunks), preemption, and n-gram speculation (verify rows in mixed steps); prompt
    logprobs (every row's logits) stay eager."""
    # a negative presence penalty makes the random model repeat itself: n-gram drafts then pass
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=-2.0)
    shared = list(range(100, 150))
    prompts = MANY[:6] + [{"prompt_token_ids": shared + [7, 8]}, {"prompt_token_ids": shared + [1]}]
    for extra in ({"num_cache_pages": 12, "page_size": 16}, {"speculative": {"method": "fixed"}}):
        kw = {**MIXED, **extra}
        want = _llm(**kw).generate(prompts, params, use_tqdm=False)
        llm, replays = _mixed_llm(**kw)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert "mixed" in replays, (extra, replays)
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want], extra
        m = llm.get_metrics()
        if "num_cache_pages" in extra:
            assert m["num_preemptions"] > 0 and m["num_prefix_hit_tokens"] > 0, m
        else:
            assert m["speculative"]["num_accepted_tokens"] > 0, m
    with_logprobs = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    llm, replays = _mixed_llm(**MIXED)
    llm.generate(MANY[:2], with_logprobs, use_tqdm=False)
    assert "mixed" not in replays, replays


def test_mixed_graph_max_tokens_is_checked():
    from deepinfer_core.config import EngineConfig

    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        EngineConfig(mixed_graph_max_tokens=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_mixed_step_graphs_equal_eager_bitwise(dtype):
    """On the GPU (``cuda_sm100``, real CUDA graphs, batch invariant): mixed steps replay the
    captured mixed-step graphs, and every request's tokens and logprobs are bitwise those of
    an engine that runs them eagerly."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=2, ignore_eos=True)
    kw = {"backend": "cuda_sm100", "device": "cuda", "dtype": dtype, "batch_invariant": True, **MIXED}
    want = LLM(**{**kw, "mixed_graph_max_tokens": 0}).generate(MANY, params, use_tqdm=False)
    llm = LLM(**kw)
    runner = llm.engine.runner
    assert runner.graph_manager.graphs("decode") and runner.graph_manager.graphs("mixed"), (
        "CUDA graphs were not captured"
    )
    replays: list[str] = []
    record_replays({"mixed": runner.graph_manager.graphs("mixed")}, replays)
    got = llm.generate(MANY, params, use_tqdm=False)
    assert replays, "no mixed step replayed a CUDA graph"
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["plain", "fp8_fp4"])
def test_cuda_graphs_with_overlapped_chains_give_one_streams_tokens_bitwise(weights, monkeypatch, tmp_path):
    """On the GPU (``cuda_sm100``, CUDA graphs): the blocks' independent chains on two streams
    (:mod:`deepinfer_core.ops.overlap`: the shared expert beside the routed experts, the
    compressors beside the query path) give the tokens and logprobs of one stream bit for bit,
    with the tiny model's plain weights (one input matmul a block) and kept FP8 / FP4 weights
    (the router's and the compressors' matmuls apart)."""
    from deepinfer_core.models.deepseek_v4 import tiny
    from deepinfer_core.ops.overlap import OVERLAP_ENV

    model = None
    if weights == "fp8_fp4":
        model = str(
            tiny.make_tiny(
                tmp_path / "q", names="native", fp8_linear=True, fp4_experts=True, fp8_block=(32, 32)
            )
        )
    kw = {"backend": "cuda_sm100", "device": "cuda", "max_num_seqs": 4}
    if model is not None:
        kw |= {"model": model, "keep_quantized": True}
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = ["The lighthouse keeper woke before the gulls.", "Once upon a time", "A"]
    monkeypatch.setenv(OVERLAP_ENV, "0")
    want = LLM(**kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.delenv(OVERLAP_ENV)
    llm = LLM(**kw)
    assert llm.engine.runner.graph_manager.graphs("decode"), "CUDA graphs were not captured"
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
