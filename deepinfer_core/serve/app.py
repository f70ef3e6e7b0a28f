"""The OpenAI-compatible HTTP application (FastAPI) of ``deepinfer serve``.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or
server-sent events with ``stream: true``: ``data: {chunk}`` lines, then ``data: [DONE]``),
``GET /health`` and ``GET /metrics`` (Prometheus text).  With an API key every ``/v1/`` route
needs ``Authorization: Bearer <key>`` (401 otherwise).  Errors are OpenAI error objects with
their status: 400 bad request, 401 bad key, 404 unknown model or route.  See ``docs/serve.md``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer_core.openai import CHAT_URL, COMPLETIONS_URL, OpenAIError, error_object
from deepinfer_core.serve.completions import Completions
from deepinfer_core.serve.engine_loop import EngineLoop


def error_response(error: OpenAIError) -> JSONResponse:
    """The OpenAI error response of ``error`` (its status; ``type`` by status)."""
    body = error_object(error)
    if error.status == 401:
        body["type"] = "authentication_error"
    elif error.status >= 500:
        body["type"] = "server_error"
    return JSONResponse({"error": body}, status_code=error.status)


def build_app(loop: EngineLoop, model: str, api_key: str | None = None) -> FastAPI:
    """The application over a started or unstarted ``loop`` (started with the app, stopped after).

    Args:
        loop: the engine loop.
        model: the model name listed by ``/v1/models`` and accepted as ``model``.
        api_key: the key ``/v1/`` routes require, or ``None`` for none.
    """
    completions = Completions(loop, model)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not loop.alive:
            loop.start()
        yield
        loop.stop()

    app = FastAPI(title="DeepInfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    if api_key is not None:
        app.add_middleware(_KeyCheck, key=api_key)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(OpenAIError(message, code, status=exc.status_code))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        scheduler = getattr(loop.client, "scheduler", None)
        waiting = len(scheduler.waiting) if scheduler is not None else None
        return PlainTextResponse(loop.metrics.render(waiting), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model, "object": "model", "created": created, "owned_by": "deepinfer"}
        card["max_model_len"] = loop.client.config.max_model_len
        return {"object": "list", "data": [card]}

    async def answer(url: str, request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError as e:
            return error_response(OpenAIError(f"the body is not valid JSON ({e})", "invalid_json", "body"))
        try:
            req, stream, usage = completions.parse(url, body)
            if not stream:
                watch = asyncio.ensure_future(_disconnect(request))
                try:
                    answer = await completions.complete(req, watch.done)
                finally:
                    watch.cancel()
                return Response(status_code=499) if answer is None else answer  # nobody reads it
            chunks = completions.stream(req, usage)
            first = await anext(chunks)  # a refused request fails here, before the 200
        except OpenAIError as e:
            return error_response(e)

        async def events() -> AsyncIterator[str]:
            try:
                yield _event(first)
                async for chunk in chunks:
                    yield _event(chunk)
                yield "data: [DONE]\n\n"
            finally:
                await chunks.aclose()  # a closed connection: abort what is left

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post(CHAT_URL)
    async def chat(request: Request) -> Any:
        return await answer(CHAT_URL, request)

    @app.post(COMPLETIONS_URL)
    async def complete(request: Request) -> Any:
        return await answer(COMPLETIONS_URL, request)

    return app


class _KeyCheck:
    """ASGI middleware: ``/v1/`` routes need ``Authorization: Bearer <key>`` (401 otherwise).
    Plain ASGI, so that a handler still sees its client disconnect."""

    def __init__(self, app: Any, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "invalid or missing API key (Authorization: Bearer <key>)"
                response = error_response(OpenAIError(message, "invalid_api_key", status=401))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _disconnect(request: Request) -> None:
    """Return once the client of ``request`` (its body read) closes the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False, allow_nan=False)}\n\n"
