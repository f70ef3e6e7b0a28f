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
    with pytest.raises(SamplingParamsError, match=r"\['min_p'\] are not supported yet"):
        SamplingParams(min_p=0.1)


def test_replace_validates_and_keeps_other_fields():
    p = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[3])
    q = p.replace(seed=9)
    assert q.seed == 9 and q.max_tokens == 5 and q.stop_token_ids == [3] and q.greedy
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        p.replace(max_tokens=-4)
    assert p.seed is None
