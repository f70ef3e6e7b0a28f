"""OpenAI API translation: request bodies of ``/v1/chat/completions`` and ``/v1/completions``
to prompts and :class:`~deepinfer_core.SamplingParams` (:mod:`.params`), and engine outputs to
``chat.completion`` / ``text_completion`` response bodies (:mod:`.responses`).

Plain functions over plain data: the batch runner (:mod:`deepinfer_core.batch`) uses them, and
so can a server.  Which parameters are supported is listed in ``docs/run-batch.md``.
"""

from deepinfer_core.openai.params import CHAT_URL, COMPLETIONS_URL, OpenAIError, ParsedRequest, parse_request
from deepinfer_core.openai.responses import (
    chat_logprobs,
    completion_logprobs,
    error_object,
    response_body,
)

__all__ = [
    "CHAT_URL",
    "COMPLETIONS_URL",
    "OpenAIError",
    "ParsedRequest",
    "error_object",
    "parse_request",
    "response_body",
    "chat_logprobs",
    "completion_logprobs",
]
