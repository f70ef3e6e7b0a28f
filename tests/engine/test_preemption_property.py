"""Preemption and resumption through SWA bounded replay, driven by random workloads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
from deepinfer_core.sampling.params import SamplingParams

PAGE = 16
MAX_LEN = 120


def _engine(num_pages: int, budget: int, max_seqs: int = 4) -> LLMEngine:
    """The tiny model on the reference backend in batch-invariant mode: a request's tokens then
    may not depend on what it was batched with (in the default mode a routing near-tie can flip
    with the rounding of a differently batched GEMM), so a preempted, replayed run must give
    exactly an unconstrained run's tokens."""
    cfg = EngineConfig(
        model=str(builtin_tiny_model_dir()),
        backend="reference",
        dtype="float32",
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        page_size=PAGE,
        num_cache_pages=num_pages,
        max_model_len=min(MAX_LEN, num_pages * PAGE),  # a longer one could never be served
        batch_invariant=True,
    )
    return LLMEngine(cfg)


def _run(engine: LLMEngine, requests: dict, aborts: dict[int, list[str]], max_steps: int) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs, step = {}, 0
    while engine.has_unfinished():
        for rid in aborts.get(step, []):
            engine.abort_request(rid)
        for out in engine.step():
            outs[out.request_id] = out
        step += 1
        assert step <= max_steps, f"no progress after {max_steps} steps: starvation or livelock"
    return outs


@st.composite
def workloads(draw):
    n = draw(st.integers(2, 6))
    requests = {}
    for i in range(n):
        length = draw(st.integers(1, 70))
        prompt = draw(st.lists(st.integers(4, 500), min_size=length, max_size=length))
        max_tokens = draw(st.integers(1, 24))
        if draw(st.booleans()):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(
                temperature=draw(st.sampled_from([0.7, 1.0])),
                top_p=draw(st.sampled_from([0.9, 1.0])),
                seed=draw(st.integers(0, 2**31)),
                max_tokens=max_tokens,
                ignore_eos=True,
            )
        requests[f"r{i}"] = (prompt, params)
    aborts: dict[int, list[str]] = {}
    for rid in draw(st.lists(st.sampled_from(sorted(requests)), max_size=2, unique=True)):
        aborts.setdefault(draw(st.integers(0, 12)), []).append(rid)
    longest = max(len(p) + sp.max_tokens for p, sp in requests.values())
    num_pages = draw(st.integers(-(-longest // PAGE), -(-longest // PAGE) + 4))  # each fits alone
    budget = draw(st.sampled_from([8, 16, 48]))
    return requests, aborts, num_pages, budget


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(workloads())
def test_random_workloads_finish_without_leaks_and_match_an_unconstrained_run(workload):
    requests, aborts, num_pages, budget = workload
    want = _run(_engine(num_pages=64, budget=256), {f"u{k}": v for k, v in requests.items()}, {}, 10_000)
    engine = _engine(num_pages, budget)
    total = sum(len(p) + sp.max_tokens for p, sp in requests.values())
    got = _run(engine, requests, aborts, max_steps=50 * total)
    aborted = {rid for rids in aborts.values() for rid in rids}
    assert set(got) == set(requests)  # every request finishes or is reported
    for rid, out in got.items():
        ref = want[f"u{rid}"].outputs[0]
        completion = out.outputs[0]
        if completion.finish_reason == "abort":
            assert rid in aborted
            assert completion.token_ids == ref.token_ids[: len(completion.token_ids)]
        else:
            assert completion.finish_reason == ref.finish_reason == "length"
            assert completion.token_ids == ref.token_ids, rid
    kv = engine.runner.kv_cache
    assert kv.num_free_pages == kv.num_pages  # no page leaks
    assert kv.num_free_slots == kv.num_slots


def test_preempted_request_resumes_through_replay_and_matches():
    prompts = [
        torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (60, 55)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _run(_engine(64, 256), {f"r{i}": (p, params) for i, p in enumerate(prompts)}, {}, 10_000)
    engine = _engine(num_pages=7, budget=32)  # 112 positions for two requests of ~90: must preempt
    stats = []
    inner = engine.scheduler.schedule

    def schedule():
        stats.append(inner())
        return stats[-1]

    engine.scheduler.schedule = schedule
    got = _run(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)}, {}, 10_000)
    assert sum(len(s.preempted) for s in stats) > 0
    assert sum(s.num_replayed_tokens for s in stats) > 0  # resumed by replay, not from scratch
    for rid in got:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
