"""SamplingParams validation."""

from __future__ import annotations

import pytest

from deepinfer_core.errors import SamplingParamsError
from deepinfer_core.sampling.params import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (1, 1.0, 1.0, 0, None, 16)
    assert p.stop_token_ids == [] and p.ignore_eos is False and p.logprobs is None


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("seed", -1),
        ("logprobs", -1),
        ("stop_token_ids", [1, -3]),
        ("ignore_eos", "yes"),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -3),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", float("inf")),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("logit_bias", [1, 2]),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {5: "big"}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", "3"),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", 42),
        ("stop", ["a", 1]),
        ("include_stop_str_in_output", 1),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", 1.5),
        ("skip_special_tokens", None),
    ],
)
def test_invalid_value_names_field_and_value(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}" in str(e.value)
    assert repr(value) in str(e.value)


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_accepts_off_values_and_positive(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k


def test_unknown_argument_is_named_and_future_fields_are_flagged():
    with pytest.raises(SamplingParamsError, match="'temprature'"):
        SamplingParams(temprature=0.5)
    with pytest.raises(SamplingParamsError, match="best_of"):
        SamplingParams(best_of=2)


def test_replace_validates_and_keeps_other_fields():
    p = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[3])
    q = p.replace(seed=9)
    assert q.seed == 9 and q.max_tokens == 5 and q.stop_token_ids == [3] and q.greedy
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        p.replace(max_tokens=-4)
    assert p.seed is None


def test_new_fields_default_to_off_as_in_vllm():
    p = SamplingParams()
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 0.0, 1.0)
    assert p.logit_bias is None and p.allowed_token_ids is None and p.stop == []
    assert p.min_tokens == 0 and p.prompt_logprobs is None
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.has_penalties and SamplingParams(repetition_penalty=1.2).has_penalties


def test_stop_string_is_normalised_to_a_list_and_bias_is_clamped():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    # JSON-style string keys become ints; biases are clamped to [-100, 100] as in vLLM
    bias = SamplingParams(logit_bias={"7": 250, 3: -1e9, 4: 0.5}).logit_bias
    assert bias == {7: 100.0, 3: -100.0, 4: 0.5}


def test_min_tokens_may_equal_max_tokens_and_replace_keeps_new_fields():
    p = SamplingParams(min_tokens=5, max_tokens=5, stop=["x"], logit_bias={1: 2.0}, prompt_logprobs=2)
    q = p.replace(seed=3)
    assert (q.min_tokens, q.stop, q.logit_bias, q.prompt_logprobs) == (5, ["x"], {1: 2.0}, 2)


@pytest.mark.parametrize(
    "field,value,bad_id",
    [
        ("logit_bias", {3: 1.0, 600: 2.0}, 600),
        ("allowed_token_ids", [1, 512], 512),
        ("stop_token_ids", [9999], 9999),
    ],
)
def test_verify_vocab_names_field_and_out_of_range_id(field, value, bad_id):
    p = SamplingParams(**{field: value})
    with pytest.raises(SamplingParamsError) as e:
        p.verify_vocab(512)
    assert f"SamplingParams.{field}" in str(e.value) and str(bad_id) in str(e.value)
    SamplingParams(**{field: [0] if field != "logit_bias" else {0: 1.0}}).verify_vocab(512)
