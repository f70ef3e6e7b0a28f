"""Structured outputs (choice / regex / JSON schema) through the llguidance backend, end to end
on the built-in tiny model."""

from __future__ import annotations

import json
import re

import pytest

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_core.errors import SamplingParamsError
from deepinfer_core.plugins import get_plugins

pytest.importorskip("llguidance")

CHOICES = ["yes", "no", "maybe"]
PATTERN = r"[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request) -> LLM:
    return LLM(async_scheduling=request.param)


def _params(structured: StructuredOutputsParams | None, greedy: bool, seed: int = 0, **kw) -> SamplingParams:
    temp = {"temperature": 0} if greedy else {"temperature": 1.0, "seed": seed}
    return SamplingParams(max_tokens=kw.pop("max_tokens", 24), structured_outputs=structured, **temp, **kw)


def test_llguidance_backend_is_registered_and_available():
    spec = get_plugins().components["structured_backends"]["llguidance"]
    assert spec.availability() == (True, None)


@pytest.mark.parametrize("greedy", [True, False])
def test_choice_and_regex_mixed_with_unconstrained_requests(llm, greedy):
    params = [
        _params(StructuredOutputsParams(choice=CHOICES), greedy, seed=1),
        _params(None, greedy, seed=2, max_tokens=6),
        _params(StructuredOutputsParams(regex=PATTERN), greedy, seed=3),
        _params(StructuredOutputsParams(choice=CHOICES), greedy, seed=4),
        _params(StructuredOutputsParams(regex=PATTERN), greedy, seed=5),
    ]
    outs = llm.generate(["Hello", "Hello", "The code is", "Hi", "x"], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in CHOICES and texts[3] in CHOICES
    assert re.fullmatch(PATTERN, texts[2]) and re.fullmatch(PATTERN, texts[4]), texts
    for i in (0, 2, 3, 4):
        assert outs[i].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6
    # the unconstrained request is the same as when it runs alone
    alone = llm.generate(["Hello"], [params[1]], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_seeded_choices_vary_and_stay_valid(llm):
    params = [_params(StructuredOutputsParams(choice=CHOICES), False, seed=s) for s in range(12)]
    texts = [o.outputs[0].text for o in llm.generate(["Hello"] * 12, params, use_tqdm=False)]
    assert set(texts) <= set(CHOICES)


def test_json_schema(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out = llm.generate(
        ["Hello"], _params(StructuredOutputsParams(json=schema), False, seed=1, max_tokens=64), use_tqdm=False
    )[0]
    assert out.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(out.outputs[0].text)["a"], int)


def test_invalid_regex_fails_only_that_request(llm):
    params = [
        _params(StructuredOutputsParams(regex="[0-9"), True),
        _params(StructuredOutputsParams(choice=CHOICES), True),
        _params(None, True, max_tokens=4),
    ]
    outs = llm.generate(["Hello"] * 3, params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "invalid regex" in outs[0].error
    assert outs[1].outputs[0].text in CHOICES and outs[1].error is None
    assert len(outs[2].outputs[0].token_ids) == 4


def test_unknown_backend_fails_at_submission_naming_what_to_install(llm):
    params = [
        _params(StructuredOutputsParams(choice=CHOICES, backend="nope"), True),
        _params(StructuredOutputsParams(choice=CHOICES), True),
    ]
    outs = llm.generate(["Hello"] * 2, params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "'nope' is not registered" in outs[0].error and "deepinfer-samplers[structured]" in outs[0].error
    assert outs[1].outputs[0].text in CHOICES


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"choice": ["a"], "regex": "a"}, {"choice": []}, {"choice": [""]}, {"regex": 3}, {"json": 1}],
)
def test_structured_outputs_params_validation(kwargs):
    with pytest.raises(SamplingParamsError, match="StructuredOutputsParams"):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_rejects_a_non_structured_outputs_value():
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs={"choice": ["a"]})


def test_cli_choice_and_regex(capsys):
    from deepinfer_core.cli import main

    argv = ["generate", "--prompt", "Hi", "--prompt", "Yo", "--temperature", "0", "--max-tokens", "8"]
    assert main([*argv, "--choice", "A", "--choice", "B", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] in ("A", "B") for r in records] == [True, True]
    assert main([*argv, "--regex", "[0-9]{2}x", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(re.fullmatch("[0-9]{2}x", r["text"]) for r in records)
    assert main([*argv, "--choice", "A", "--regex", "a"]) != 0
    assert "exactly one of choice / regex / json" in capsys.readouterr().err
