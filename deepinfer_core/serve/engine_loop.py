"""``EngineLoop``: one background thread that owns an :class:`EngineClient` and steps it.

Requests join between two steps (continuous batching: a request added while others run is
scheduled at the next step); each request's progress goes to the ``sink`` it was added with,
as :class:`Delta` events, called on the loop thread (an asyncio caller passes a sink that hands
the event to its event loop with ``call_soon_threadsafe``).

Incremental text: the single-process engine's ``add_request`` returns its
:class:`~deepinfer_core.engine.request.Request`, whose ``output_token_ids`` and
``output_text`` the loop reads between steps (on its own thread, so never while the engine
writes them).  The text of an unfinished request is final except for a stop string that may
still complete: with stop strings the last ``max(len(stop)) - 1`` characters are held back
until the request finishes, so the streamed pieces always add up to the final text.  With
``params.logprobs`` set, each event also carries the ``Request.logprobs`` entries of the
tokens whose text it completes (a token whose text is held back goes with the event that sends
that text), so the events' entries add up to the final output's ``logprobs``.  A client
whose ``add_request`` returns no request (the distributed coordinator) streams each request's
text in one piece when it finishes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.engine.client import EngineClient
from deepinfer_core.errors import DeepInferError
from deepinfer_core.outputs import CompletionOutput, RequestOutput
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.serve.metrics import ServerMetrics

logger = logging.getLogger("deepinfer.serve")


@dataclass
class Delta:
    """One request's progress since its previous event.

    Attributes:
        engine_id: the request's engine id.
        text: the text added since the previous event (may be empty).
        num_tokens: tokens generated so far.
        output: the finished request's output (its last event), else ``None``.
        token_ids: the generated tokens this event's ``logprobs`` cover (empty without logprobs).
        logprobs: one ``{token_id: logprob}`` per token of ``token_ids`` when the request asked
            for logprobs, else ``None``.
    """

    engine_id: str
    text: str
    num_tokens: int
    output: RequestOutput | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None


Sink = Callable[[Delta], None]


@dataclass
class _Add:
    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    sample_index: int
    sink: Sink


class _Stream:
    """A request in the engine: what was sent of it so far."""

    def __init__(self, add: _Add, handle: Any, metrics: ServerMetrics):
        self.add = add
        self.handle = handle if hasattr(handle, "output_token_ids") else None
        self.metrics = metrics
        self.sent_chars = 0
        self.tokens = 0
        self.start = time.monotonic()
        self.last = self.start
        stops = add.params.stop or []
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.want_logprobs = add.params.logprobs is not None
        self.sent_tokens = 0  # tokens whose logprobs were sent
        self.marks: deque[tuple[int, int]] = deque()  # (tokens, text length) seen between steps

    def _count(self, n: int) -> None:
        """Record ``n`` generated tokens in the latency histograms."""
        if n <= self.tokens:
            return
        now = time.monotonic()
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.start)
            if n > 1:
                self.metrics.itl.observe((now - self.start) / n, n - 1)
        else:
            self.metrics.itl.observe((now - self.last) / (n - self.tokens), n - self.tokens)
        self.last = now
        self.tokens = n

    def progress(self) -> None:
        """Send the text generated since the previous event (nothing when no token came)."""
        if self.handle is None:
            return
        n = len(self.handle.output_token_ids)
        if n <= self.tokens:
            return
        self._count(n)
        text = self.handle.output_text
        safe = len(text) - self.hold
        delta = text[self.sent_chars : safe] if safe > self.sent_chars else ""
        self.sent_chars += len(delta)
        token_ids: list[int] = []
        logprobs = None
        if self.want_logprobs:  # the tokens whose text is now all sent
            self.marks.append((n, len(text)))
            done = self.sent_tokens
            while self.marks and self.marks[0][1] <= self.sent_chars:
                done = self.marks.popleft()[0]
            token_ids = self.handle.output_token_ids[self.sent_tokens : done]
            logprobs = self.handle.logprobs[self.sent_tokens : done]
            self.sent_tokens = done
        self.add.sink(Delta(self.add.engine_id, delta, n, token_ids=token_ids, logprobs=logprobs))

    def finish(self, out: RequestOutput) -> None:
        """Send the rest of the final text (and logprobs) with the finished output."""
        comp = out.outputs[0]
        self._count(len(comp.token_ids))
        self.metrics.finished(comp.finish_reason, len(out.prompt_token_ids), len(comp.token_ids))
        rest = comp.text[self.sent_chars :]
        token_ids = comp.token_ids[self.sent_tokens :]
        logprobs = comp.logprobs[self.sent_tokens :] if comp.logprobs is not None else None
        delta = Delta(self.add.engine_id, rest, len(comp.token_ids), out, token_ids, logprobs)
        self.add.sink(delta)


class EngineLoop:
    """Steps an :class:`EngineClient` on a background thread while requests are unfinished.

    Args:
        client: the engine; only the loop thread calls it after :meth:`start` (except
            :meth:`abort`, which uses the client's thread-safe ``abort_request``).
        metrics: the server's counters and histograms.
    """

    def __init__(self, client: EngineClient, metrics: ServerMetrics | None = None):
        self.client = client
        self.metrics = metrics or ServerMetrics()
        self._cond = threading.Condition()
        self._adds: list[_Add] = []
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine-loop", daemon=True)
        self.error: str | None = None  # the last step failure, for /health

    def start(self) -> None:
        """Start the loop thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop thread (unfinished requests are aborted) and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def alive(self) -> bool:
        """Whether the loop thread runs."""
        return self._thread.is_alive()

    @property
    def num_requests(self) -> int:
        """Requests added and not finished (queued for the loop or in the engine)."""
        with self._cond:
            return len(self._adds) + len(self._streams)

    def add(
        self,
        engine_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        prompt: str | None = None,
        sample_index: int = 0,
    ) -> None:
        """Queue a request for the next step; its events go to ``sink`` (on the loop thread).
        A request the engine refuses gets one finished event with ``finish_reason="error"``."""
        with self._cond:
            self._adds.append(_Add(engine_id, list(prompt_token_ids), params, prompt, sample_index, sink))
            self._cond.notify()

    def abort(self, engine_ids: list[str]) -> None:
        """Abort requests (their last event comes with ``finish_reason="abort"``); unknown or
        finished ids are ignored."""
        if not engine_ids:
            return
        gone = set(engine_ids)
        with self._cond:  # not admitted yet: dropped here, never reaching the engine
            dropped = [a for a in self._adds if a.engine_id in gone]
            self._adds = [a for a in self._adds if a.engine_id not in gone]
            self._cond.notify()
        self.client.abort_request(engine_ids)
        for add in dropped:
            self.metrics.finished("abort", len(add.prompt_token_ids), 0)
            out = RequestOutput(
                add.engine_id, add.prompt, add.prompt_token_ids, [CompletionOutput(0, "", [], "abort")]
            )
            out.finished = True
            add.sink(Delta(add.engine_id, "", 0, out))

    # ---- the loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._adds and not self._streams and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                adds, self._adds = self._adds, []
            for add in adds:
                self._admit(add)
            try:
                outputs = self.client.step() if self.client.has_unfinished() else []
            except Exception as e:  # a failed step: fail its requests, keep serving
                logger.exception("engine step failed")
                self.error = f"{type(e).__name__}: {e}"
                outputs = self.client.abort_all(f"engine step failed: {self.error}")
            for out in outputs:
                stream = self._streams.pop(out.request_id, None)
                if stream is not None:
                    stream.finish(out)
            for stream in self._streams.values():
                stream.progress()
            if self._streams and not self.client.has_unfinished():  # the engine lost them
                for engine_id in list(self._streams):
                    self._fail(self._streams.pop(engine_id), "the engine dropped the request")
            self.metrics.in_flight = len(self._streams)
        self.client.abort_all("the server is shutting down")
        for stream in self._streams.values():
            self._fail(stream, "the server is shutting down")
        self._streams.clear()

    def _admit(self, add: _Add) -> None:
        try:
            handle = self.client.add_request(
                add.engine_id,
                add.prompt_token_ids,
                add.params,
                prompt=add.prompt,
                sample_index=add.sample_index,
            )
        except DeepInferError as e:
            self._fail(_Stream(add, None, self.metrics), str(e))
            return
        self._streams[add.engine_id] = _Stream(add, handle, self.metrics)

    @staticmethod
    def _fail(stream: _Stream, message: str) -> None:
        add = stream.add
        comp = CompletionOutput(0, "", [], "error")
        out = RequestOutput(add.engine_id, add.prompt, add.prompt_token_ids, [comp], finished=True)
        out.error = message
        add.sink(Delta(add.engine_id, "", 0, out))
