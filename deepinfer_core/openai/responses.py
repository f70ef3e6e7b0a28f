"""Engine outputs -> OpenAI response bodies: ``chat.completion`` and ``text_completion``
objects with ``choices``, ``usage`` and, when asked, ``logprobs``; and the OpenAI error object."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_core.openai.params import OpenAIError, ParsedRequest
from deepinfer_core.outputs import CompletionOutput, RequestOutput

TokenText = Callable[[int], str]
"""A token id's text (special tokens included), as the logprobs show it."""

_FLOOR = -9999.0  # OpenAI's logprob of a token the model cannot pick


def error_object(error: OpenAIError) -> dict[str, Any]:
    """The ``error`` object of an OpenAI error response."""
    return {
        "message": error.message,
        "type": "invalid_request_error",
        "param": error.param,
        "code": error.code,
    }


def response_body(
    req: ParsedRequest,
    outputs: Sequence[RequestOutput],
    *,
    response_id: str,
    created: int,
    model: str,
    token_text: TokenText,
) -> dict[str, Any]:
    """The response body of ``req`` from its outputs: one :class:`RequestOutput` per prompt
    (a chat request has one), each holding its ``n`` completions in order.

    Choices are numbered prompt by prompt (``index = prompt * n + sample``), as OpenAI numbers
    a multi-prompt completion; ``usage`` counts every prompt's tokens and every generated one
    (a final EOS / stop token included)."""
    chat = req.kind == "chat"
    choices = []
    prompt_tokens = completion_tokens = 0
    for p, out in enumerate(outputs):
        prompt_tokens += len(out.prompt_token_ids)
        for k, comp in enumerate(out.outputs):
            completion_tokens += len(comp.token_ids)
            choices.append(_choice(req, comp, p * req.n + k, token_text, chat))
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": req.model or model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _choice(
    req: ParsedRequest, comp: CompletionOutput, index: int, token_text: TokenText, chat: bool
) -> dict:
    logprobs = None
    if req.logprobs is not None and comp.logprobs is not None:
        if chat:
            logprobs = chat_logprobs(comp.token_ids, comp.logprobs, req.logprobs, token_text)
        else:
            logprobs = completion_logprobs(comp.token_ids, comp.logprobs, req.logprobs, token_text)
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["message"] = {"role": "assistant", "content": comp.text}
    else:
        choice["text"] = comp.text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = comp.finish_reason
    choice["stop_reason"] = comp.stop_reason  # vLLM's extension: the stop string or token id
    return choice


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely entries of one position, most likely first."""
    return sorted(lp.items(), key=lambda item: -item[1])[:k]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], k: int, token_text: TokenText
) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``,
    one entry per token of ``token_ids`` (``logprobs`` holds each one's ``{token_id: logprob}``)
    with its ``k`` most likely alternatives."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        item = entry(token_id, lp[token_id])
        item["top_logprobs"] = [entry(t, v) for t, v in _top(lp, k)]
        content.append(item)
    return {"content": content}


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, float]],
    k: int,
    token_text: TokenText,
    offset: int = 0,
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` in the legacy layout: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one ``{token: logprob}`` of the ``k`` most likely per position) and
    ``text_offset`` (each token's offset in the concatenated token texts, the first at ``offset``)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        values.append(_finite(lp[token_id]))
        tops.append({token_text(t): _finite(v) for t, v in _top(lp, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
