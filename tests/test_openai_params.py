"""OpenAI request bodies -> SamplingParams, and the refusals (the OpenAI API reference is the oracle)."""

from __future__ import annotations

import pytest

from deepinfer_core.openai import CHAT_URL, COMPLETIONS_URL, OpenAIError, parse_request
from deepinfer_core.sampling.params import StructuredOutputsParams

USER = [{"role": "user", "content": "hi"}]


def test_chat_parameters_map_to_sampling_params():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        "max_completion_tokens": 7,
        "max_tokens": 99,  # max_completion_tokens wins, as in the OpenAI API
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "stop": "\n",
        "n": 2,
        "presence_penalty": 0.1,
        "frequency_penalty": -0.2,
        "logit_bias": {"5": 1.5},
        "logprobs": True,
        "top_logprobs": 3,
        "top_k": 4,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "min_tokens": 2,
        "stop_token_ids": [9],
    }
    req = parse_request(CHAT_URL, body)
    assert req.kind == "chat" and req.model == "m" and req.n == 2
    assert req.messages[1]["content"] == "a\nb"  # text parts joined by newlines
    p = req.sampling_params(prompt_len=10, max_model_len=100)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.n) == (7, 0.5, 0.9, 3, ["\n"], 2)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.1, -0.2, {5: 1.5})
    assert (p.logprobs, p.top_k, p.min_p, p.repetition_penalty) == (3, 4, 0.05, 1.1)
    assert (p.ignore_eos, p.min_tokens, p.stop_token_ids) == (True, 2, [9])


def test_chat_without_max_tokens_may_use_the_rest_of_the_context_and_logprobs_default_off():
    req = parse_request(CHAT_URL, {"messages": USER})
    p = req.sampling_params(prompt_len=30, max_model_len=100)
    assert p.max_tokens == 70 and p.logprobs is None
    assert parse_request(CHAT_URL, {"messages": USER, "logprobs": True}).logprobs == 0


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a b", ["a b"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    req = parse_request(COMPLETIONS_URL, {"prompt": prompt, "logprobs": 2})
    assert req.prompts == expected and req.logprobs == 2
    assert req.sampling_params(3, 100).max_tokens == 16  # the OpenAI completions default


def test_response_format_becomes_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    p = parse_request(CHAT_URL, {"messages": USER, "response_format": fmt}).sampling_params(1, 10)
    assert p.structured_outputs == StructuredOutputsParams(json=schema)
    p = parse_request(
        CHAT_URL, {"messages": USER, "response_format": {"type": "json_object"}}
    ).sampling_params(1, 10)
    assert p.structured_outputs == StructuredOutputsParams(json={"type": "object"})
    p = parse_request(CHAT_URL, {"messages": USER, "response_format": {"type": "text"}}).sampling_params(
        1, 10
    )
    assert p.structured_outputs is None
    p = parse_request(
        COMPLETIONS_URL, {"prompt": "x", "structured_outputs": {"regex": "[ab]+"}}
    ).sampling_params(1, 9)
    assert p.structured_outputs == StructuredOutputsParams(regex="[ab]+")


@pytest.mark.parametrize(
    ("url", "body", "code", "param"),
    [
        ("/v1/embeddings", {"input": "x"}, "invalid_url", "url"),
        (CHAT_URL, [], "invalid_parameter", "body"),
        (CHAT_URL, {}, "missing_parameter", "messages"),
        (COMPLETIONS_URL, {}, "missing_parameter", "prompt"),
        (CHAT_URL, {"messages": USER, "foo": 1}, "unknown_parameter", "foo"),
        (CHAT_URL, {"messages": USER, "tools": []}, "unsupported_parameter", "tools"),
        (CHAT_URL, {"messages": USER, "stream": True}, "unsupported_parameter", "stream"),
        (COMPLETIONS_URL, {"prompt": "x", "echo": True}, "unsupported_parameter", "echo"),
        (COMPLETIONS_URL, {"prompt": "x", "best_of": 3}, "unsupported_parameter", "best_of"),
        (COMPLETIONS_URL, {"prompt": "x", "top_logprobs": 2}, "unknown_parameter", "top_logprobs"),
        (CHAT_URL, {"messages": USER, "top_logprobs": 2}, "invalid_parameter", "top_logprobs"),
        (CHAT_URL, {"messages": USER, "logprobs": 2}, "invalid_parameter", "logprobs"),
        (CHAT_URL, {"messages": USER, "temperature": -1}, "invalid_parameter", "temperature"),
        (CHAT_URL, {"messages": USER, "top_p": "high"}, "invalid_parameter", "top_p"),
        (CHAT_URL, {"messages": USER, "n": 0}, "invalid_parameter", "n"),
        (CHAT_URL, {"messages": USER, "min_tokens": 5, "max_tokens": 2}, "invalid_parameter", "min_tokens"),
        (
            CHAT_URL,
            {"messages": USER, "response_format": {"type": "xml"}},
            "invalid_parameter",
            "response_format",
        ),
        (
            CHAT_URL,
            {"messages": USER, "response_format": {"type": "json_schema"}},
            "invalid_parameter",
            "response_format",
        ),
        (
            CHAT_URL,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "unsupported_parameter",
            "messages",
        ),
        (COMPLETIONS_URL, {"prompt": [1, "a"]}, "invalid_parameter", "prompt"),
        (
            COMPLETIONS_URL,
            {"prompt": "x", "structured_outputs": {"json": {}, "regex": "a"}},
            "invalid_parameter",
            "structured_outputs",
        ),
    ],
)
def test_refusals_name_the_parameter(url, body, code, param):
    with pytest.raises(OpenAIError) as info:
        parse_request(url, body)
    assert (info.value.code, info.value.param, info.value.status) == (code, param, 400)
    assert "\n" not in info.value.message and info.value.message
