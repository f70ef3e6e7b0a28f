"""Side-stream overlap: a block's independent chains of ops run side by side on two CUDA streams.

At decode sizes a kernel fills a few of the GPU's SMs and takes about its launch-to-finish
latency whatever its work, so a block made of two chains that do not read each other's results
(DeepSeek-V4's MoE: the shared expert's projections and the router with the routed experts; its
attention: the compressors' cache updates and the query path) takes the sum of the chains'
latencies on one stream and about the longer one's on two.  :func:`fork` runs a chain (a function
of no arguments) on the device's *side stream* (one per device, made at first use); the block's
other chain continues on the current stream, and :meth:`Branch.join` makes the current stream
wait for the branch and returns the chain's result.  Inside a CUDA-graph capture the fork and the
join become branches of the graph, so a replay overlaps them too.

Only the stream a kernel runs on changes, not the kernels, their inputs or the order of any sum:
the results are bitwise those of one stream.  The caching allocator could hand the memory of a
tensor the current stream drops to the current stream's next allocation while the branch still
reads it, so :func:`fork` holds the tensors it is given (every tensor the chain reads that the
current stream made) until the join.

When it applies (:func:`overlap_applies`): tensors on a CUDA device, at most
:data:`OVERLAP_ENV` rows (default :data:`DEFAULT_MAX_ROWS`, decode and small verify steps; ``0``
turns it off).  Elsewhere (CPU, other devices, larger steps) the chain runs at the fork, inline,
and :meth:`Branch.join` returns its result.  The rule depends on shapes and the device only, so
an eager step and its graph replay take the same path.  :data:`DEFER_ENV` (tests) runs each chain
at its join instead, on any device: the other order two streams may take, so a block that reads
what its branch writes (or changes what it reads) before the join gives other results.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

logger = logging.getLogger("deepinfer.ops")

T = TypeVar("T")

OVERLAP_ENV = "DEEPINFER_STREAM_OVERLAP"
"""The most rows (tokens) of a call whose independent chains run on two CUDA streams (``0``:
never); read at each call."""
DEFAULT_MAX_ROWS = 256
"""Rows up to which the chains overlap when :data:`OVERLAP_ENV` is unset: the decode graphs'
buckets, where kernels leave SMs idle."""
DEFER_ENV = "DEEPINFER_TEST_DEFER_BRANCHES"
"""Test-only: ``1`` runs every chain that would overlap (on any device, within the row limit) at
its join rather than at its fork."""

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_OBSERVERS: list[Callable[[str, object], None]] = []
_TURNED_OFF: list[str] = []  # why overlap is off in this process (set once)


def max_overlap_rows() -> int:
    """:data:`OVERLAP_ENV` as a row count (:data:`DEFAULT_MAX_ROWS` when unset); a value that is
    not a count >= 0 raises ``ValueError`` naming it."""
    text = os.environ.get(OVERLAP_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_ROWS
    if not text.isdigit():
        raise ValueError(f"{OVERLAP_ENV}={text!r}: give the most rows to overlap, an integer >= 0 (0 = off)")
    return int(text)


def _deferred() -> bool:
    return os.environ.get(DEFER_ENV, "0") not in ("", "0")


def turn_off(reason: str) -> None:
    """Every chain inline from now on, in this process (the engine's answer to a graph capture that
    failed with two streams); logs ``reason`` once."""
    if not _TURNED_OFF:
        _TURNED_OFF.append(reason)
        logger.warning("stream overlap off: %s; the blocks' chains run on one stream", reason)


def overlap_applies(x: torch.Tensor) -> bool:
    """Whether a block whose input is ``x`` ``[rows, ...]`` runs its chains on two streams (or,
    under :data:`DEFER_ENV`, defers them)."""
    if _TURNED_OFF or (x.device.type != "cuda" and not _deferred()):
        return False
    return x.shape[0] <= max_overlap_rows()


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """``device``'s side stream, made at first use outside a graph capture; ``None`` while a capture
    runs before it exists (the chain then runs inline, logged once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        if torch.cuda.is_current_stream_capturing():
            _warn_capture_without_stream()
            return None
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def on_side_stream(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is its side stream (a kernel holding per-stream
    scratch picks its share by this)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    return stream is not None and torch.cuda.current_stream(index) == stream


@contextlib.contextmanager
def observe_branches(observer: Callable[[str, object], None]) -> Iterator[None]:
    """Within the block ``observer(event, branch)`` hears every overlapped branch's events in
    order: ``"fork"``, ``"chain"`` and ``"end"`` around the run of its chain (at the fork on a GPU,
    at the join when deferred), ``"join"``.  The graph manager learns from it whether a capture that
    failed had overlapped a chain; ``count_launches.py`` tells a step's launches on its critical
    path from those beside it."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def _emit(event: str, branch: object) -> None:
    for observer in _OBSERVERS:
        observer(event, branch)


def _run(chain: Callable[[], T], branch: object) -> T:
    _emit("chain", branch)
    try:
        return chain()
    finally:
        _emit("end", branch)


class Branch(Generic[T]):
    """A chain forked by :func:`fork`: :meth:`join` before using what it computed or wrote.

    Attributes:
        overlapped: the chain runs apart from the block's other chain (on the side stream, or
            deferred to the join); ``False``: it ran inline at the fork.
    """

    def __init__(self, chain: Callable[[], T] | None, result: T | None, overlapped: bool,
                 stream: torch.cuda.Stream | None = None, main: torch.cuda.Stream | None = None,
                 keep: tuple = ()):  # fmt: skip
        self._chain, self._result, self.overlapped = chain, result, overlapped
        self._stream, self._main, self._keep = stream, main, keep
        self._joined = False

    def join(self) -> T:
        """The chain's result, once the current stream waits for its work (a deferred chain runs
        now; a second call returns the same result and waits for nothing more)."""
        if self._chain is not None:
            self._result, self._chain = _run(self._chain, self), None
        if self._stream is not None and self._main is not None:
            self._main.wait_stream(self._stream)
        if self.overlapped and not self._joined:
            _emit("join", self)
        self._stream = self._main = None
        self._keep, self._joined = (), True
        return self._result  # type: ignore[return-value]


def fork(x: torch.Tensor, chain: Callable[[], T], *keep: torch.Tensor, enabled: bool = True) -> Branch[T]:
    """Run ``chain()`` on the side stream of ``x``'s device after the work queued so far on the
    current stream, when ``enabled`` and :func:`overlap_applies` ``(x)``; else now, inline (under
    :data:`DEFER_ENV`: at the join).  ``x`` and ``keep`` (every other tensor the chain reads that
    the current stream made) stay referenced until the join."""
    if not enabled or not overlap_applies(x):
        return Branch(None, chain(), False)
    if _deferred():
        branch: Branch[T] = Branch(chain, None, True)
        _emit("fork", branch)
        return branch
    stream = side_stream(x.device)
    if stream is None:
        return Branch(None, chain(), False)
    main = torch.cuda.current_stream(x.device)
    stream.wait_stream(main)
    branch = Branch(None, None, True, stream, main, (x, *keep))
    _emit("fork", branch)
    with torch.cuda.stream(stream):
        branch._result = _run(chain, branch)
    return branch


@functools.cache
def _warn_capture_without_stream() -> None:
    logger.warning(
        "stream overlap: a CUDA graph is captured before any eager step made the side stream; the "
        "captured blocks run their chains on one stream"
    )
