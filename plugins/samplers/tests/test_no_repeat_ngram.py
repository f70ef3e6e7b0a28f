"""The ``no_repeat_ngram`` logits processor on the tiny model: no n-gram of prompt + output
occurs twice, where the plain run repeats them."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams


def _ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8)


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(4, 60, (n,), generator=g).tolist()} for n in (3, 9, 20)]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_ngram_repeats_across_prompt_and_output(llm, size, temperature):
    base = {"temperature": temperature, "seed": 4, "max_tokens": 40, "ignore_eos": True}
    plain = llm.generate(_prompts(), SamplingParams(**base), use_tqdm=False)
    params = SamplingParams(**base, logits_processors={"no_repeat_ngram": {"size": size}})
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    repeated_before = 0
    for p, o, prompt in zip(plain, outs, _prompts(), strict=True):
        ids = prompt["prompt_token_ids"]
        # every n-gram ending in the output is new: not in the prompt, not earlier in the output
        new = _ngrams(
            ids[-(size - 1) :] + o.outputs[0].token_ids if size > 1 else o.outputs[0].token_ids, size
        )
        assert not set(new) & set(_ngrams(ids, size)) and len(new) == len(set(new))
        plain_grams = _ngrams(ids + p.outputs[0].token_ids, size)
        repeated_before += len(plain_grams) - len(set(plain_grams))
    if temperature == 0:  # the test can fail: greedy, the tiny model repeats itself without it
        assert repeated_before > 0


def test_bad_size_fails_the_request(llm):
    out = llm.generate(
        ["hi"],
        SamplingParams(max_tokens=3, logits_processors={"no_repeat_ngram": {"size": 0}}),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].finish_reason == "error" and "'size' must be an int >= 1" in out.error
