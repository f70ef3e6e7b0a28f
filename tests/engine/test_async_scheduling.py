"""Async zero-overhead scheduling gives exactly the outputs of synchronous scheduling."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 66, 25)]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            seed=5,
            max_tokens=18,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.8, top_k=20, min_p=0.05, seed=9, max_tokens=25, min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=12, stop=["e", "a "], prompt_logprobs=2),
        SamplingParams(temperature=1.0, seed=1, max_tokens=30, logit_bias={7: 3.0}, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]


def _run(async_scheduling: bool, **kw) -> tuple[list, list]:
    llm = LLM(
        backend="reference",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
        **kw,
    )
    seen = []
    execute = llm.engine.runner.execute

    def observe(chunks, prev_tokens=None):
        seen.extend(chunks)
        return execute(chunks, prev_tokens)

    llm.engine.runner.execute = observe
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], _params(), use_tqdm=False)
    return outs, seen


def _summary(outs, with_logprobs: bool = True) -> list:
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
        + ((o.outputs[0].logprobs, o.prompt_logprobs) if with_logprobs else ())
        for o in outs
    ]


def _max_logprob_gap(a, b) -> float:
    gap = 0.0
    for x, y in zip(a, b, strict=True):
        for d1, d2 in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or [], strict=True):
            assert d1.keys() == d2.keys()
            gap = max(gap, *(abs(d1[k] - d2[k]) for k in d1))
    return gap


@pytest.mark.parametrize(
    "cache",
    [{}, pytest.param({"num_cache_pages": 8, "page_size": 16}, marks=pytest.mark.slow)],
    ids=["roomy", "preempting"],
)
def test_async_outputs_equal_sync_outputs(cache):
    """Same tokens, texts and finish reasons; logprobs equal up to the batch composition (an
    async step also runs requests whose finish is only known one step later)."""
    sync, sync_chunks = _run(False, **cache)
    asyn, async_chunks = _run(True, **cache)
    assert _summary(asyn, with_logprobs=False) == _summary(sync, with_logprobs=False)
    assert _max_logprob_gap(asyn, sync) < 1e-5
    assert not any(c.prev_row >= 0 for c in sync_chunks)
    # async decode steps took their input token from the previous step's device tensor
    assert sum(c.prev_row >= 0 for c in async_chunks) > 20


@pytest.mark.slow
def test_async_is_bitwise_equal_to_sync_with_batch_invariance():
    sync, _ = _run(False, batch_invariant=True)
    asyn, _ = _run(True, batch_invariant=True)
    assert _summary(asyn) == _summary(sync)
