"""One ``/v1/completions`` or ``/v1/chat/completions`` request through the :class:`EngineLoop`.

:class:`Completions` turns a checked body (:func:`deepinfer_core.openai.parse_request`) into
engine requests (one per prompt and sample), then either waits for all of them and builds the
response body (:func:`deepinfer_core.openai.response_body`) or yields the OpenAI stream chunks
(``chat.completion.chunk`` / ``text_completion`` objects) as the text comes.  A request given
up by its caller (a closed connection, a cancelled task) aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from deepinfer_core.errors import DeepInferError
from deepinfer_core.openai import (
    OpenAIError,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    parse_request,
    response_body,
)
from deepinfer_core.openai.token_texts import TokenTexts
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.serve.engine_loop import Delta, EngineLoop

_ids = itertools.count()

POLL_S = 0.25
"""How often a non-streamed request checks that its caller is still connected."""


class Completions:
    """Serves completion requests of one model.

    Args:
        loop: the engine loop.
        model: the model name the server answers to (``/v1/models``).
    """

    def __init__(self, loop: EngineLoop, model: str):
        self.loop = loop
        self.model = model
        self.client = loop.client
        self.tokenizer = loop.client.tokenizer
        self._token_text = TokenTexts(self.tokenizer)

    # ---- parsing ---------------------------------------------------------------------------------
    def parse(self, url: str, body: Any) -> tuple[ParsedRequest, bool, bool]:
        """The checked request, whether it streams, and whether the stream ends with usage.

        Raises:
            OpenAIError: a bad body (400) or a model other than the served one (404).
        """
        stream = False
        usage = False
        if isinstance(body, dict):
            body = dict(body)
            stream = body.pop("stream", False)
            if not isinstance(stream, bool):
                raise OpenAIError(f"stream must be true or false, got {stream!r}", param="stream")
            options = body.pop("stream_options", None)
            if options is not None:
                if not stream:
                    raise OpenAIError("stream_options needs stream=true", param="stream_options")
                if not isinstance(options, dict) or set(options) - {"include_usage"}:
                    raise OpenAIError(
                        'stream_options must be {"include_usage": bool}', param="stream_options"
                    )
                usage = bool(options.get("include_usage"))
            model = body.get("model")
            if model is not None and model != self.model:
                raise OpenAIError(
                    f"the model {model!r} does not exist; this server serves {self.model!r}",
                    "model_not_found",
                    "model",
                    status=404,
                )
        req = parse_request(url, body)
        return req, stream, usage

    def _engine_requests(self, req: ParsedRequest) -> list[tuple[str | None, list[int], Any]]:
        """Each prompt's text, token ids and sampling parameters."""
        try:
            if req.kind == "chat":
                if self.tokenizer is None:
                    raise OpenAIError(
                        "chat completions need a tokenizer with a chat template; the model has none"
                    )
                text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
                prompts = [(text, self.tokenizer.encode(text, add_bos=False))]
            else:
                prompts = [
                    (p, self.client.encode(p)) if isinstance(p, str) else (None, p) for p in req.prompts
                ]
            out = []
            for text, ids in prompts:
                params = req.sampling_params(len(ids), self.client.config.max_model_len)
                self.client.check_params(params)
                out.append((text, ids, params))
            return out
        except DeepInferError as e:  # the engine's checks (vocabulary, tokenizer), the chat template
            raise OpenAIError(str(e)) from None

    def _submit(self, req: ParsedRequest) -> tuple[str, list[str], asyncio.Queue[Delta], list[RequestOutput]]:
        """Add the request's engine requests; their events arrive on the returned queue."""
        prompts = self._engine_requests(req)
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{next(_ids)}-{int(time.time() * 1000)}"
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        aio = asyncio.get_running_loop()

        def sink(delta: Delta) -> None:
            aio.call_soon_threadsafe(queue.put_nowait, delta)

        ids = []
        outputs = []
        for p, (text, prompt_ids, params) in enumerate(prompts):
            outputs.append(RequestOutput(str(p), text, list(prompt_ids), outputs=[None] * req.n))  # type: ignore[list-item]
            for k in range(req.n):
                engine_id = f"{rid}/{p}/{k}"
                ids.append(engine_id)
                self.loop.add(engine_id, prompt_ids, params, sink, prompt=text, sample_index=k)
        return rid, ids, queue, outputs

    # ---- answers ---------------------------------------------------------------------------------
    async def complete(
        self, req: ParsedRequest, disconnected: Callable[[], bool] | None = None
    ) -> dict[str, Any] | None:
        """The response body once every engine request finished; ``None`` (the engine
        requests aborted) when ``disconnected()``, checked at every event and every :data:`POLL_S` s, says
        the caller went away.

        Raises:
            OpenAIError: a bad request, or an engine request that failed (its message).
        """
        rid, ids, queue, outputs = self._submit(req)
        left = set(ids)
        try:
            while left:
                if disconnected is not None and disconnected():
                    return None
                try:
                    delta = await asyncio.wait_for(queue.get(), POLL_S)
                except TimeoutError:
                    continue
                if delta.output is not None:
                    left.discard(delta.engine_id)
                    self._file(outputs, req, delta)
        finally:
            if left:
                self.loop.abort(sorted(left))
        self._raise_failure(outputs)
        return response_body(
            req,
            outputs,
            response_id=rid,
            created=int(time.time()),
            model=self.model,
            token_text=self._token_text,
        )

    async def stream(self, req: ParsedRequest, usage: bool) -> AsyncIterator[dict[str, Any]]:
        """The stream's chunks, then (``usage``) one chunk with the usage and no choices.

        A failed engine request ends the stream with an ``{"error": ...}`` object."""
        rid, ids, queue, outputs = self._submit(req)
        chat = req.kind == "chat"
        created = int(time.time())
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
        }
        base["model"] = req.model or self.model
        index = {engine_id: i for i, engine_id in enumerate(ids)}
        left = set(ids)
        offsets = dict.fromkeys(ids, 0)  # each choice's text_offset so far (completions' logprobs)
        try:
            if chat:
                for i in range(len(ids)):
                    choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                    yield {**base, "choices": [{**choice, "finish_reason": None}]}
            while left:
                delta = await queue.get()
                out = delta.output
                if out is not None:
                    left.discard(delta.engine_id)
                    self._file(outputs, req, delta)
                    if out.error is not None:
                        yield {
                            "error": {"message": out.error, "type": "server_error", "code": "request_failed"}
                        }
                        return
                if not delta.text and not delta.token_ids and out is None:
                    continue
                choice: dict[str, Any] = {"index": index[delta.engine_id], "logprobs": None}
                if req.logprobs is not None and delta.logprobs is not None:
                    choice["logprobs"] = self._logprobs(req, delta, offsets, chat)
                if chat:
                    choice["delta"] = {"content": delta.text} if delta.text else {}
                else:
                    choice["text"] = delta.text
                choice["finish_reason"] = out.outputs[0].finish_reason if out is not None else None
                yield {**base, "choices": [choice]}
        finally:
            if left:
                self.loop.abort(sorted(left))
        if usage:
            body = response_body(
                req, outputs, response_id=rid, created=created, model=self.model, token_text=str
            )
            yield {**base, "choices": [], "usage": body["usage"]}

    def _logprobs(self, req: ParsedRequest, delta: Delta, offsets: dict[str, int], chat: bool) -> dict:
        """A chunk's ``logprobs``: those of the tokens the chunk covers."""
        assert req.logprobs is not None and delta.logprobs is not None
        if chat:
            return chat_logprobs(delta.token_ids, delta.logprobs, req.logprobs, self._token_text)
        offset = offsets[delta.engine_id]
        body = completion_logprobs(delta.token_ids, delta.logprobs, req.logprobs, self._token_text, offset)
        offsets[delta.engine_id] = offset + sum(len(t) for t in body["tokens"])
        return body

    @staticmethod
    def _file(outputs: list[RequestOutput], req: ParsedRequest, delta: Delta) -> None:
        """Put a finished sample into its prompt's output."""
        assert delta.output is not None
        _, p, k = delta.engine_id.rsplit("/", 2)
        comp = delta.output.outputs[0]
        comp.index = int(k)
        target = outputs[int(p)]
        target.outputs[int(k)] = comp
        if delta.output.error and target.error is None:
            target.error = delta.output.error

    @staticmethod
    def _raise_failure(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.error is not None:
                message = out.error.split(": ", 1)[1] if out.error.startswith("request ") else out.error
                raise OpenAIError(message, "request_failed")
