"""Attention data parallelism end to end on the built-in tiny model in fp32 on CPU (gloo):
``LLM(data_parallel_size=N)`` (N = 2, 4: the ranks are worker processes the LLM starts) gives
the outputs of a single-process ``LLM()`` on the same prompts — greedy tokens and logprobs
bitwise with ``batch_invariant=True``, within 1e-5 otherwise — and for seeded and unseeded
sampled requests and ``n > 1``; an invalid request fails alone; the metrics add up over ranks."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import DistributedError
from tests.distributed.outputs import assert_same_completions

OPTIONS: dict[str, Any] = {"backend": "reference", "max_num_seqs": 4, "max_model_len": 256}
# 14 prompts of 1 .. 92 tokens: every rank of 4 gets several, some prefill in two chunks
PROMPTS: list[Any] = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 200 + 2 for j in range(1 + 7 * i)]} for i in range(14)
]
GREEDY = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
SAMPLED = [
    SamplingParams(temperature=0.8, max_tokens=5, seed=1234, ignore_eos=True),  # seeded
    SamplingParams(temperature=1.0, top_k=20, max_tokens=5, ignore_eos=True),  # from the engine seed
    SamplingParams(temperature=0.9, max_tokens=4, n=3, ignore_eos=True),  # n > 1
]
TOO_LONG = {"prompt_token_ids": [5] * 300}  # longer than max_model_len: fails alone


def _workload() -> tuple[list[Any], list[SamplingParams]]:
    prompts = [*PROMPTS, PROMPTS[3], PROMPTS[5], PROMPTS[7], TOO_LONG, PROMPTS[2]]
    params = [GREEDY] * len(PROMPTS) + [*SAMPLED, GREEDY, GREEDY]
    return prompts, params


def _generate(**options: Any) -> tuple[list[Any], dict[str, Any]]:
    prompts, params = _workload()
    with LLM(**OPTIONS, **options) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, llm.get_metrics()


def _check(got: list[Any], want: list[Any], exact: bool) -> None:
    assert [o.request_id for o in got] == [o.request_id for o in want]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.error == w.error, f"prompt {i}"
        assert len(g.outputs) == len(w.outputs), f"prompt {i}"
        for k, (a, b) in enumerate(zip(g.outputs, w.outputs, strict=True)):
            assert a.finish_reason == b.finish_reason, f"prompt {i} sample {k}"
        assert_same_completions(g.outputs, w.outputs, exact)


def _check_metrics(metrics: dict[str, Any], want: dict[str, Any], world: int) -> None:
    per_rank = metrics["per_rank"]
    assert len(per_rank) == world
    assert all(m["num_finished_requests"] >= 3 for m in per_rank), "every rank serves several requests"
    for key in ("num_finished_requests", "num_generated_tokens", "num_prompt_tokens"):
        assert metrics[key] == sum(m[key] for m in per_rank) == want[key], key


def test_dp2_equals_single_process_bitwise() -> None:
    want, want_metrics = _generate(batch_invariant=True)
    got, metrics = _generate(batch_invariant=True, data_parallel_size=2)
    _check(got, want, exact=True)
    assert got[-2].error is not None and "max_model_len" in got[-2].error  # the invalid one
    assert got[-2].outputs[0].finish_reason == "error"
    _check_metrics(metrics, want_metrics, 2)


@pytest.mark.slow
def test_dp4_equals_single_process() -> None:
    want, want_metrics = _generate()
    got, metrics = _generate(data_parallel_size=4)
    _check(got, want, exact=False)
    _check_metrics(metrics, want_metrics, 4)


def test_dummy_forward_touches_no_request() -> None:
    """``ModelRunner.execute_dummy`` (the step of an expert-parallel rank with nothing to do)
    between every step of an engine leaves its outputs bitwise unchanged."""
    llm = LLM(**OPTIONS, batch_invariant=True)
    want = llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)
    engine: LLMEngine = LLM(**OPTIONS, batch_invariant=True).engine
    for i, prompt in enumerate(PROMPTS[:6]):
        engine.add_request(str(i), prompt["prompt_token_ids"], GREEDY)
    done = {}
    while engine.has_unfinished():
        engine.runner.execute_dummy()
        done.update({o.request_id: o for o in engine.step()})
    for i, w in enumerate(want):
        assert done[str(i)].outputs[0].token_ids == w.outputs[0].token_ids
        assert done[str(i)].outputs[0].logprobs == w.outputs[0].logprobs


@pytest.mark.slow
def test_abort_reaches_the_replica_holding_the_request() -> None:
    """An abort rank 0 gets applies on whichever rank holds the request; the others finish."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(**OPTIONS, data_parallel_size=2) as llm:
        coordinator = llm.client
        for i in range(4):  # replicas 0, 1, 0, 1 (fewest outstanding, ties to the lower)
            coordinator.add_request(str(i), PROMPTS[i + 1]["prompt_token_ids"], params)
        done = {o.request_id: o for _ in range(3) for o in coordinator.step()}
        coordinator.abort_request(["1", "2"])  # one on each replica
        while coordinator.has_unfinished():
            done.update({o.request_id: o for o in coordinator.step()})
        reasons = {rid: out.outputs[0].finish_reason for rid, out in done.items()}
        assert reasons == {"0": "length", "1": "abort", "2": "abort", "3": "length"}
        assert 0 < len(done["1"].outputs[0].token_ids) < 30
        assert llm.kv_cache_capacity_tokens == 2 * llm.engine.runner.capacity_tokens
        with pytest.raises(DistributedError, match="already initialized in this process"):
            LLM(**OPTIONS, data_parallel_size=2)  # one run at a time in a process


@pytest.mark.slow
def test_reset_metrics_zeroes_every_rank() -> None:
    """``LLM.reset_metrics()`` on DP 2 zeroes every rank's totals (no step runs); the totals of
    the next ``generate`` then equal a single process's for that call alone."""
    warm, prompts = PROMPTS[:4], PROMPTS[4:10]
    with LLM(**OPTIONS) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        want = llm.get_metrics()
    with LLM(**OPTIONS, data_parallel_size=2) as llm:
        llm.generate(warm, GREEDY, use_tqdm=False)
        assert all(m["num_generated_tokens"] > 0 for m in llm.get_metrics()["per_rank"])
        llm.reset_metrics()
        zeroed = llm.get_metrics()
        for key in ("num_steps", "num_finished_requests", "num_generated_tokens", "num_prompt_tokens"):
            assert zeroed[key] == 0 and all(m[key] == 0 for m in zeroed["per_rank"]), key
        llm.generate(prompts, GREEDY, use_tqdm=False)
        _check_metrics_of(llm.get_metrics(), want)


def _check_metrics_of(metrics: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("num_finished_requests", "num_generated_tokens", "num_prompt_tokens"):
        assert metrics[key] == sum(m[key] for m in metrics["per_rank"]) == want[key], key


@pytest.mark.slow
def test_run_batch_over_dp2_equals_a_single_process_run(tmp_path) -> None:
    """``run_batch`` drives a distributed run through the same client as ``LLM.generate``: the
    results file of DP2 equals the single-process one line for line (greedy, batch invariant;
    ``created`` is the only field that differs between runs)."""
    import json

    from deepinfer_core.batch import run_batch

    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": p["prompt_token_ids"], "max_tokens": 4, "temperature": 0},
        }
        for i, p in enumerate(PROMPTS[:8])
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))

    def results(**options: Any) -> dict[str, Any]:
        out = tmp_path / f"out-{len(options)}.jsonl"
        with LLM(**OPTIONS, batch_invariant=True, **options) as llm:
            summary = run_batch(src, out, llm=llm, progress=False)
        assert summary.completed == len(lines) and summary.failed == 0
        got = {}
        for text in out.read_text().splitlines():
            record = json.loads(text)
            record["response"]["body"].pop("created")
            got[record["custom_id"]] = record
        return got

    assert results(data_parallel_size=2) == results()
