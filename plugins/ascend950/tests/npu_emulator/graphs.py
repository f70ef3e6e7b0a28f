"""EMULATOR: ``torch_npu.npu``'s graph API (``NPUGraph``, ``graph``, ``graph_pool_handle``) on
any device, with a graph's semantics rather than a re-run of Python code.

Followed: Ascend/pytorch ``torch_npu/npu/graphs.py`` (the names and arguments mirror
``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` / ``torch.cuda.graph_pool_handle``) and
PyTorch's CUDA-graph documentation for what a graph is: the device work issued during capture,
replayed later on the same memory -- every tensor keeps its address, new input values are
read from the captured buffers, and nothing that ran on the host during capture runs again.

So capture records every ATen op issued inside the ``graph`` context (a ``TorchDispatchMode``),
and :meth:`NPUGraph.replay` re-issues them in order on the same tensor objects, copying each
op's new result into the tensor the capture returned (in-place ops and ``out=`` ops write
their own arguments again).  A host read of a device value during capture
(``Tensor.item()``, ``tolist``, a data-dependent shape) has no place in a graph and raises
here as a real capture fails.  Silent in the documents, chosen here: the pool handle is an
opaque token that only ``graph(..., pool=)`` receives; ``stream`` is accepted and ignored.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}


class _Recorder(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(f"EMULATOR: {func} reads a device value on the host during NPU graph capture")
        out = func(*args, **kwargs)
        self.log.append((func, args, kwargs, out))
        return out


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


class NPUGraph:
    """EMULATOR of ``torch_npu.npu.NPUGraph``: the recorded ops, re-issued by :meth:`replay`."""

    replays = 0
    """Replays of every emulated graph (tests read it)."""

    def __init__(self):
        self.log: list = []

    def replay(self) -> None:
        NPUGraph.replays += 1
        with torch.inference_mode():  # a device graph records no autograd: nor does its replay
            for func, args, kwargs, out in self.log:
                new = func(*args, **kwargs)
                for old, fresh in zip(_outputs(out), _outputs(new), strict=True):
                    if fresh is not old and fresh.data_ptr() != old.data_ptr():
                        old.copy_(fresh)


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool: object | None = None, stream: object | None = None) -> Iterator[None]:
    """EMULATOR of ``torch_npu.npu.graph``: record the enclosed ops into ``npu_graph``."""
    with _Recorder(npu_graph.log):
        yield


def graph_pool_handle() -> object:
    """EMULATOR of ``torch_npu.npu.graph_pool_handle``: an opaque token."""
    return object()


NAMESPACE = types.SimpleNamespace(NPUGraph=NPUGraph, graph=graph, graph_pool_handle=graph_pool_handle)
"""What the emulated ``torch_npu`` module exposes as ``torch_npu.npu``."""
