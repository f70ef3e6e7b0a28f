"""NPU graphs for the engine's fixed-shape steps (``BackendSpec.graph_runtime``).

``torch_npu.npu`` has CUDA's graph API under NPU names (Ascend/pytorch
``torch_npu/npu/graphs.py``: ``NPUGraph``, the ``graph(npu_graph, pool=None, stream=None)``
capture context and ``graph_pool_handle()`` for a memory pool shared by several graphs), so a
step is captured and replayed exactly as the core's CUDA graphs do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_ascend950.npu import torch_npu


class NpuGraph:
    """One ``NPUGraph`` sharing the runner's memory pool (the core's ``DeviceGraph`` protocol)."""

    def __init__(self, pool: object | None):
        self.npu = torch_npu().npu
        self.graph = self.npu.NPUGraph()
        self.pool = pool
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``fn`` (after the caller's warm-up); its output buffer."""
        with self.npu.graph(self.graph, pool=self.pool):
            self.out = fn()
        return self.out

    def replay(self) -> torch.Tensor:
        """Re-run the recorded work on the current contents of its input buffers."""
        self.graph.replay()
        assert self.out is not None
        return self.out


def graph_runtime(device: torch.device) -> tuple[type[NpuGraph] | None, object | None, str]:
    """``(NpuGraph, a shared pool, "")`` on an NPU, else ``(None, None, why)``."""
    if device.type != "npu":
        return None, None, f"NPU graphs capture work on an NPU, not on device type {device.type!r}"
    return NpuGraph, torch_npu().npu.graph_pool_handle(), ""
