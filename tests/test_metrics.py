"""Engine metrics: StepStats per step, their totals in LLM.get_metrics(), per-request timestamps."""

from __future__ import annotations

import logging
import types

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine.metrics import Metrics, StepStats
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
from deepinfer_core.testing.managers import manager_with_plugin

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "A", "Once upon a time"]
MAX_TOKENS = [3, 5, 1, 4]


def params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def test_totals_equal_direct_counts():
    llm = LLM(backend="reference", enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    m = llm.get_metrics()
    num_prompt = sum(len(o.prompt_token_ids) for o in outs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert num_out == sum(MAX_TOKENS)
    assert m["num_prompt_tokens"] == num_prompt and m["num_generated_tokens"] == num_out
    # without prefix hits or preemption every prompt token and every fed-back output token runs once
    assert m["num_scheduled_tokens"] == num_prompt + num_out - len(PROMPTS)
    assert m["num_finished_requests"] == len(PROMPTS) and m["num_preemptions"] == 0
    assert m["num_prefix_hit_tokens"] == 0 and m["num_replayed_tokens"] == 0
    assert m["num_steps"] >= max(MAX_TOKENS) and m["elapsed_s"] > 0
    assert m["generation_tokens_per_s"] == pytest.approx(num_out / m["elapsed_s"])
    assert m["generation_tokens_per_s"] > 0 and m["tokens_per_s"] > 0
    assert 0 < m["peak_cache_usage"] <= 1 and m["cache_usage"] == 0  # everything freed at the end
    # a second call accumulates
    llm.generate(PROMPTS[0], params()[0], use_tqdm=False)
    assert llm.get_metrics()["num_generated_tokens"] == num_out + MAX_TOKENS[0]


def test_preemptions_are_counted_and_do_not_inflate_prompt_tokens():
    llm = LLM(
        model=str(builtin_tiny_model_dir()),  # the random tiny model's cache layout preempts here
        backend="reference",
        max_num_seqs=2,
        max_num_batched_tokens=5,
        num_cache_pages=3,
        page_size=16,
        enable_prefix_caching=False,
    )
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)  # 2 sequences need > 3 pages
    outs = llm.generate(PROMPTS, p, use_tqdm=False)
    m = llm.get_metrics()
    assert m["num_preemptions"] == llm.engine.scheduler.num_preemptions > 0
    assert m["num_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert m["num_generated_tokens"] == 10 * len(PROMPTS)


def test_capacity_is_reported(caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = LLM(backend="reference", num_cache_pages=7, log_level="info")
    kv = llm.engine.runner.kv_cache
    assert llm.kv_cache_capacity_tokens == 7 * kv.page_size == llm.get_metrics()["kv_cache_capacity_tokens"]
    assert f"= {7 * kv.page_size} token capacity" in caplog.text


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_stats_hook_gets_one_consistent_record_per_step(async_scheduling):
    received: list[StepStats] = []
    plugin = types.SimpleNamespace(deepinfer_step_stats=hookimpl(lambda stats: received.append(stats)))
    engine = LLMEngine(
        EngineConfig.load(
            backend="reference", enable_prefix_caching=False, async_scheduling=async_scheduling
        ),
        plugins=manager_with_plugin(plugin, "stats-recorder"),
    )
    tok = engine.tokenizer
    for i, (prompt, p) in enumerate(zip(PROMPTS, params(), strict=True)):
        engine.add_request(str(i), tok.encode(prompt), p)
    outputs = []
    num_steps = 0
    while engine.has_unfinished():
        outputs += engine.step()
        num_steps += 1
    # one record per executed step; async mode needs one more call to process the last one
    executed = num_steps - 1 if async_scheduling else num_steps
    assert [s.step for s in received] == list(range(1, executed + 1))
    assert sum(s.num_finished for s in received) == len(outputs) == len(PROMPTS)
    assert sum(s.num_generated_tokens for s in received) == sum(MAX_TOKENS)
    assert sum(s.num_prompt_tokens for s in received) == sum(len(tok.encode(p)) for p in PROMPTS)
    assert all(s.num_decode_seqs <= s.num_seqs and s.step_time_s > 0 for s in received)
    assert received[0].num_tokens == sum(len(tok.encode(p)) for p in PROMPTS)  # all prefill at once
    assert received[-1].num_running == received[-1].num_waiting == 0
    assert engine.metrics.num_steps == executed
    assert engine.metrics.num_scheduled_tokens == sum(s.num_tokens for s in received)


def test_request_timestamps_are_ordered():
    llm = LLM(backend="reference")
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
        assert m.last_token_time <= m.finished_time and 0 <= m.ttft <= m.latency
    n2 = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=1.0, max_tokens=3), use_tqdm=False)[0]
    assert n2.metrics is not None and n2.metrics.latency >= n2.metrics.ttft >= 0


def test_metrics_accumulator_rates_and_peak():
    def stats(step, tokens, gen, usage, t):
        return StepStats(step, 1, tokens, 0, 0, 0, usage, t, num_generated_tokens=gen, num_replayed_tokens=2)

    m = Metrics(kv_cache_capacity_tokens=64)
    assert m.as_dict()["generation_tokens_per_s"] == 0.0 and m.as_dict()["last_step"] is None
    for s in (stats(1, 10, 1, 0.5, 0.5), stats(2, 3, 3, 0.75, 1.5), stats(3, 1, 1, 0.25, 2.0)):
        m.update(s)
    d = m.as_dict()
    assert d["generation_tokens_per_s"] == pytest.approx(5 / 4.0)
    assert d["tokens_per_s"] == pytest.approx(14 / 4.0)
    assert d["peak_cache_usage"] == 0.75 and d["cache_usage"] == 0.25 and d["num_replayed_tokens"] == 6
    assert d["last_step"]["step"] == 3 and d["kv_cache_capacity_tokens"] == 64
    m.reset()
    assert m.as_dict()["num_steps"] == 0 and m.kv_cache_capacity_tokens == 64


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_unpredictable_stops_are_counted_once(async_scheduling):
    """A stop token cannot be foreseen: in async mode the request already ran one more step,
    whose token is discarded and must not count as generated (nor its prompt twice)."""
    llm = LLM(backend="reference", enable_prefix_caching=False, async_scheduling=async_scheduling)
    greedy = llm.generate(PROMPTS, params(), use_tqdm=False)
    llm.engine.metrics.reset()
    stopping = [
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[g.outputs[0].token_ids[0]])
        for g in greedy
    ]
    outs = llm.generate(PROMPTS, stopping, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) == 1 for o in outs)
    m = llm.get_metrics()
    assert m["num_generated_tokens"] == len(PROMPTS)
    assert m["num_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)


def test_finished_requests_count_rejected_and_aborted_prompts():
    """``num_finished_requests`` counts completed, failed (rejected at submission included) and
    aborted requests: every output the engine returns."""
    llm = LLM(backend="reference", max_model_len=32)
    outs = llm.generate(
        [{"prompt_token_ids": [1] * 40}, {"prompt_token_ids": []}, "Hi"],
        SamplingParams(max_tokens=2),
        use_tqdm=False,
    )
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length"]
    assert llm.get_metrics()["num_finished_requests"] == 3
