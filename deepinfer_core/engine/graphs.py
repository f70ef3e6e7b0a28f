"""Device graphs: decode steps captured once per batch-size bucket and replayed.

A step is *graphable* when every request runs ``tokens_per_req`` tokens (1 for decode; a few
for speculative verify steps later) and wants only its last row's logits.  For each bucket
of ``b`` requests the runner captures, once at start, the whole forward (device-side
metadata derivation included) over persistent input buffers padded to ``b`` requests; a step
of ``n <= b`` requests fills the buffers (real requests first, the rest on the cache's trash
slot) and replays the smallest bucket that fits, as nano-vllm and SGLang do.

The graph mechanism itself is per device type (:func:`device_graph_factory`): CUDA graphs on
``cuda``; an Ascend backend adds ``npu`` (``torch_npu``'s ``NPUGraph`` has the same shape).
:class:`EmulatedGraph` replays by re-running the captured function; it exercises the whole
fixed-shape path (buckets, padding, trash rows) on machines without a graph runtime (tests);
:data:`EMULATE_GRAPHS_ENV` makes :func:`device_graph_factory` hand it out for every device
(so an engine built in another process, a distributed worker, captures emulated graphs).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

import torch

logger = logging.getLogger("deepinfer.engine")


class DeviceGraph(Protocol):
    """One captured computation."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``fn`` (after the caller's warm-up) and return its output buffer."""

    def replay(self) -> torch.Tensor:
        """Re-run the recorded work on the current contents of its input buffers; returns the
        same output buffer as :meth:`capture`."""


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` sharing one memory pool with the runner's other graphs.

    ``graph`` / ``capturing``: another runtime's graph object and capture context of the same
    API (``torch_npu.npu``'s ``NPUGraph`` and ``graph``), for a backend's ``graph_runtime``.
    """

    def __init__(self, pool: object | None, graph: object | None = None, capturing: Callable | None = None):
        self.graph = torch.cuda.CUDAGraph() if graph is None else graph
        self.capturing = torch.cuda.graph if capturing is None else capturing
        self.pool = pool
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self.capturing(self.graph, pool=self.pool):
            self.out = fn()
        return self.out

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        assert self.out is not None
        return self.out


class EmulatedGraph:
    """Replays by calling the captured function again (no graph runtime needed)."""

    def __init__(self, pool: object | None = None):
        self.fn: Callable[[], torch.Tensor] | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        return fn()

    def replay(self) -> torch.Tensor:
        assert self.fn is not None
        return self.fn()


GraphFactory = Callable[[object | None], DeviceGraph]

EMULATE_GRAPHS_ENV = "DEEPINFER_TEST_EMULATE_GRAPHS"
"""Test-only: ``1`` makes :func:`device_graph_factory` return :class:`EmulatedGraph` on every
device (the engine then runs the padded fixed-shape graph path without a graph runtime)."""


def device_graph_factory(device: torch.device) -> tuple[GraphFactory | None, object | None, str]:
    """``(factory, shared memory pool, reason)`` for ``device``; factory ``None`` when the
    device type has no graph runtime here (``reason`` says why)."""
    if os.environ.get(EMULATE_GRAPHS_ENV, "0") not in ("", "0"):
        return EmulatedGraph, None, ""
    if device.type == "cuda":
        return CudaGraph, torch.cuda.graph_pool_handle(), ""
    return None, None, f"no device-graph runtime for device type {device.type!r}"


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs``
    (and ``max_num_seqs`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))
