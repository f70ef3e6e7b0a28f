"""Side-stream overlap: a block's independent chains of ops run side by side on two CUDA streams.

At decode sizes a kernel fills a few of the GPU's SMs and takes about its launch-to-finish
latency whatever its work, so a block made of two chains that do not read each other's results
(DeepSeek-V4's MoE: the shared expert's projections and the router with the routed experts; its
attention: the compressors' cache updates and the query path) takes the sum of the chains' latencies
on one stream and about the longer one's on two.  :func:`side_branch` runs its body on the device's
*side stream* (one per device, made at first use); the block's other chain continues on the current
stream, and :meth:`SideBranch.join` makes the current stream wait for the branch before anything
reads its results.  Inside a CUDA-graph capture the fork and the join become branches of the graph,
so a replay overlaps them too.

Only the stream a kernel runs on changes, not the kernels, their inputs or the order of any sum:
the results are bitwise those of one stream.  A block that overlaps must keep every tensor the
branch reads alive until :meth:`SideBranch.join` (the caching allocator would otherwise hand its
memory to the current stream while the branch still reads it); :func:`side_branch` holds the
tensors it is given.

When it applies (:func:`overlap_applies`): tensors on a CUDA device, at most
:data:`OVERLAP_ENV` rows (default :data:`DEFAULT_MAX_ROWS`, decode and small verify steps; ``0``
turns it off), outside :func:`no_overlap`.  Elsewhere (CPU, other devices, larger steps) the body
runs inline and :meth:`SideBranch.join` does nothing.  The rule depends on shapes and the device
only, so an eager step and its graph replay take the same path.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from collections.abc import Iterator

import torch

logger = logging.getLogger("deepinfer.ops")

OVERLAP_ENV = "DEEPINFER_STREAM_OVERLAP"
"""The most rows (tokens) of a call whose independent chains run on two CUDA streams (``0``:
never); read at each call."""
DEFAULT_MAX_ROWS = 256
"""Rows up to which the chains overlap when :data:`OVERLAP_ENV` is unset: the decode graphs'
buckets, where kernels leave SMs idle."""

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("no_overlap", default=False)


def max_overlap_rows() -> int:
    """:data:`OVERLAP_ENV` as a row count (:data:`DEFAULT_MAX_ROWS` when unset); a value that is
    not a count >= 0 raises ``ValueError`` naming it."""
    text = os.environ.get(OVERLAP_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_ROWS
    if not text.isdigit():
        raise ValueError(f"{OVERLAP_ENV}={text!r}: give the most rows to overlap, an integer >= 0 (0 = off)")
    return int(text)


@contextlib.contextmanager
def no_overlap() -> Iterator[None]:
    """Within the block every :func:`side_branch` runs inline (e.g. around collectives, whose
    order across ranks must not depend on two streams)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def overlap_applies(x: torch.Tensor) -> bool:
    """Whether a block whose input is ``x`` ``[rows, ...]`` runs its chains on two streams."""
    if _OFF.get() or x.device.type != "cuda":
        return False
    return x.shape[0] <= max_overlap_rows()


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """``device``'s side stream, made at first use outside a graph capture; ``None`` while a capture
    runs before it exists (the branch then runs inline, logged once)."""
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


class SideBranch:
    """A block's branch: :meth:`join` before reading what it computed."""

    def __init__(self, stream: torch.cuda.Stream | None, main: torch.cuda.Stream | None, keep: tuple):
        self.stream, self.main = stream, main
        self._keep: tuple | None = keep  # the branch's inputs, alive until the join
        self.overlapped = stream is not None

    def join(self) -> None:
        """The current stream waits for the branch's work (nothing to wait for when it ran inline;
        a second call waits for nothing more)."""
        if self.stream is not None and self.main is not None:
            self.main.wait_stream(self.stream)
        self.stream = self.main = None
        self._keep = None


@contextlib.contextmanager
def side_branch(x: torch.Tensor, *keep: torch.Tensor, enabled: bool = True) -> Iterator[SideBranch]:
    """Run the body on the side stream of ``x``'s device after the work queued so far on the current
    stream, when ``enabled`` and :func:`overlap_applies` ``(x)``; else inline.  ``x`` and ``keep``
    (every other tensor the body reads that the current stream made) stay referenced until the
    join."""
    stream = side_stream(x.device) if enabled and overlap_applies(x) else None
    if stream is None:
        yield SideBranch(None, None, ())
        return
    main = torch.cuda.current_stream(x.device)
    stream.wait_stream(main)
    branch = SideBranch(stream, main, (x, *keep))
    with torch.cuda.stream(stream):
        yield branch


@functools.cache
def _warn_capture_without_stream() -> None:
    logger.warning(
        "stream overlap: a CUDA graph is captured before any eager step made the side stream; the "
        "captured blocks run their chains on one stream"
    )
