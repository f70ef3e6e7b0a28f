"""OpenAI request bodies -> prompts and :class:`SamplingParams`.

:func:`parse_request` checks a ``/v1/chat/completions`` or ``/v1/completions`` body and returns
a :class:`ParsedRequest`; :meth:`ParsedRequest.sampling_params` builds the engine's parameters
once the prompt's length is known (a chat request without ``max_tokens`` may use the rest of
the context).  Every refusal is an :class:`OpenAIError` whose message names the parameter.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.errors import SamplingParamsError
from deepinfer_core.sampling.params import SamplingParams, StructuredOutputsParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` of a ``/v1/completions`` request that gives none (the OpenAI default)."""

MAX_TOP_LOGPROBS = 20

# Parameters read the same way by both endpoints (OpenAI names, then vLLM's extra names).
_COMMON = {
    "model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "logit_bias", "response_format", "user", "stream", "stream_options",
    "metadata", "store", "service_tier",
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids", "structured_outputs",
}  # fmt: skip
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_COMPLETIONS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}

# OpenAI parameters the engine does not implement: named in the refusal.
_UNSUPPORTED = {
    "tools": "tool calling",
    "tool_choice": "tool calling",
    "functions": "function calling",
    "function_call": "function calling",
    "parallel_tool_calls": "tool calling",
    "audio": "audio output",
    "modalities": "output modalities other than text",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning effort",
    "web_search_options": "web search",
}

# vLLM extras passed to SamplingParams under the same name.
_EXTRAS = (
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids",
)  # fmt: skip


class OpenAIError(Exception):
    """A request the engine refuses, as the OpenAI API reports it.

    Attributes:
        message: one line naming the culprit.
        code: a short machine-readable reason (``invalid_parameter``, ``unsupported_parameter``,
            ``missing_parameter``, ``invalid_json``, ``invalid_url``, ...).
        param: the parameter at fault, or ``None``.
        status: the HTTP status the API would answer with (400 for a bad request).
    """

    def __init__(
        self, message: str, code: str = "invalid_parameter", param: str | None = None, status: int = 400
    ):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.status = status


@dataclass
class ParsedRequest:
    """A checked request body.

    Attributes:
        kind: ``"chat"`` or ``"completion"``.
        model: the body's ``model`` (echoed in the response), or ``None``.
        messages: the chat conversation, text contents only (chat).
        prompts: the prompts of a completions request: texts or token-id lists.
        n: completions per prompt.
        max_tokens: the limit asked for, or ``None`` (chat: the rest of the context).
        logprobs: engine logprobs per generated token (top-``k`` alternatives), or ``None``.
        sampling: the other :class:`SamplingParams` keyword arguments.
    """

    kind: str
    model: str | None
    messages: list[dict[str, Any]] | None = None
    prompts: list[str | list[int]] = field(default_factory=list)
    n: int = 1
    max_tokens: int | None = None
    logprobs: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)

    _fixed: SamplingParams | None = field(default=None, repr=False, compare=False)

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """The engine parameters of one prompt of ``prompt_len`` tokens (without ``max_tokens``
        a chat request may generate up to ``max_model_len``).  With ``max_tokens`` given they do
        not depend on the prompt: one object, built once, serves every prompt."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max(1, max_model_len - prompt_len)
        elif self._fixed is not None:
            return self._fixed
        try:
            params = SamplingParams(n=self.n, max_tokens=max_tokens, logprobs=self.logprobs, **self.sampling)
            if self.max_tokens is not None:
                self._fixed = params
            return params
        except SamplingParamsError as e:
            named = re.match(r"SamplingParams\.(\w+)", str(e))
            param = named.group(1) if named else None
            raise OpenAIError(str(e).replace("SamplingParams.", ""), "invalid_parameter", param) from None


def parse_request(url: str, body: Any) -> ParsedRequest:
    """Check an OpenAI request body for ``url`` (:data:`CHAT_URL` or :data:`COMPLETIONS_URL`).

    Raises:
        OpenAIError: unknown URL, a body that is not an object, a missing, unknown, unsupported
            or invalid parameter (the message names it).
    """
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise OpenAIError(
            f"url {url!r} is not supported; use {CHAT_URL!r} or {COMPLETIONS_URL!r}", "invalid_url", "url"
        )
    if not isinstance(body, Mapping):
        raise OpenAIError(f"body must be a JSON object, got {_kind(body)}", "invalid_parameter", "body")
    chat = url == CHAT_URL
    _check_names(body, _CHAT if chat else _COMPLETIONS, url)
    if body.get("stream"):
        raise OpenAIError(
            "stream=true is not supported here; leave it out or false", "unsupported_parameter", "stream"
        )
    req = ParsedRequest(kind="chat" if chat else "completion", model=_opt_str(body, "model"))
    req.n = _int(body, "n", 1, lo=1)
    req.sampling = _sampling(body)
    if chat:
        req.messages = _messages(body)
        limits = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
        req.max_tokens = _int(body, limits[0], None, lo=1) if limits else None
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise OpenAIError(f"logprobs must be true or false, got {body['logprobs']!r}", param="logprobs")
        top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not body.get("logprobs"):
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        req.logprobs = (top or 0) if body.get("logprobs") else None
    else:
        req.prompts = _prompts(body)
        req.max_tokens = _int(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, lo=1)
        req.logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if body.get("echo"):
            raise OpenAIError("echo=true is not supported", "unsupported_parameter", "echo")
        if body.get("suffix") is not None:
            raise OpenAIError("suffix is not supported", "unsupported_parameter", "suffix")
        best_of = _int(body, "best_of", None, lo=1)
        if best_of is not None and best_of != req.n:
            raise OpenAIError(
                f"best_of={best_of} other than n is not supported", "unsupported_parameter", "best_of"
            )
    req.sampling_params(0, 2**31)  # every value checked now, before the prompt is tokenized
    return req


def _check_names(body: Mapping[str, Any], known: set[str], url: str) -> None:
    for name in body:
        if name in _UNSUPPORTED:
            raise OpenAIError(f"{name}: {_UNSUPPORTED[name]} is not supported", "unsupported_parameter", name)
        if name not in known:
            raise OpenAIError(f"unknown parameter {name!r} for {url}", "unknown_parameter", name)


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The SamplingParams keyword arguments of the parameters both endpoints share."""
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        if body.get(name) is not None:
            out[name] = _number(body, name)
    if body.get("seed") is not None:
        out["seed"] = _int(body, "seed", None, lo=0)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise OpenAIError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
        out["stop"] = stop
    if body.get("logit_bias") is not None:
        if not isinstance(body["logit_bias"], Mapping):
            raise OpenAIError("logit_bias must be an object {token_id: bias}", param="logit_bias")
        out["logit_bias"] = dict(body["logit_bias"])
    for name in _EXTRAS:
        if body.get(name) is not None:
            out[name] = body[name]
    structured = _response_format(body.get("response_format"))
    if body.get("structured_outputs") is not None:
        if structured is not None:
            raise OpenAIError(
                "give response_format or structured_outputs, not both", param="structured_outputs"
            )
        structured = _structured_outputs(body["structured_outputs"])
    if structured is not None:
        out["structured_outputs"] = structured
    return out


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    """``response_format`` -> structured outputs: ``json_schema`` (its ``schema``), ``json_object``
    (any JSON object), ``text`` / absent (none)."""
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise OpenAIError('response_format must be an object with a "type"', param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json={"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise OpenAIError(
                'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                param="response_format",
            )
        return StructuredOutputsParams(json=dict(schema))
    raise OpenAIError(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        param="response_format",
    )


def _structured_outputs(spec: Any) -> StructuredOutputsParams:
    """vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice`` or ``grammar``...)."""
    if not isinstance(spec, Mapping):
        raise OpenAIError("structured_outputs must be an object", param="structured_outputs")
    allowed = {"json", "regex", "choice", "grammar", "disable_any_whitespace", "whitespace_pattern"}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise OpenAIError(f"structured_outputs: unknown key(s) {unknown}", param="structured_outputs")
    try:
        return StructuredOutputsParams(**spec)
    except SamplingParamsError as e:
        raise OpenAIError(f"structured_outputs: {e}", param="structured_outputs") from None


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation with every content as plain text (text parts joined by newlines)."""
    messages = body.get("messages")
    if messages is None:
        raise OpenAIError("messages is required", "missing_parameter", "messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise OpenAIError(f'{where} must be an object with a "role"', param="messages")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(
                        f"{where}.content[{j}]: only text parts are supported, got type {kind!r}",
                        "unsupported_parameter",
                        "messages",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise OpenAIError(f"{where}.content must be a string or a list of text parts", param="messages")
        out.append({**msg, "content": content})
    return out


def _prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
    prompt = body.get("prompt")
    if prompt is None:
        raise OpenAIError("prompt is required", "missing_parameter", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise OpenAIError(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        param="prompt",
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(
    body: Mapping[str, Any], name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f" in [{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise OpenAIError(f"{name} must be an integer{bounds}, got {value!r}", param=name)
    return value


def _number(body: Mapping[str, Any], name: str) -> float:
    value = body[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise OpenAIError(f"{name} must be a number, got {value!r}", param=name)
    return value


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(f"{name} must be a string, got {value!r}", param=name)
    return value


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )
