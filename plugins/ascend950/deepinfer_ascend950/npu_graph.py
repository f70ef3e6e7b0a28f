"""NPU graphs for the engine's fixed-shape steps (``BackendSpec.graph_runtime``).

``torch_npu.npu`` has CUDA's graph API under NPU names (Ascend/pytorch
``torch_npu/npu/graphs.py``: ``NPUGraph``, the ``graph(npu_graph, pool=None, stream=None)``
capture context and ``graph_pool_handle()`` for a memory pool shared by several graphs), so a
step is captured and replayed exactly as the core's CUDA graphs do.
"""

from __future__ import annotations

import torch

from deepinfer_ascend950.npu import torch_npu
from deepinfer_core.engine.graphs import CudaGraph


class NpuGraph(CudaGraph):
    """One ``NPUGraph`` sharing the runner's memory pool: the core's CUDA-graph wrapper over
    ``torch_npu.npu``'s graph object and capture context."""

    def __init__(self, pool: object | None):
        npu = torch_npu().npu
        super().__init__(pool, npu.NPUGraph(), npu.graph)


def graph_runtime(device: torch.device) -> tuple[type[NpuGraph] | None, object | None, str]:
    """``(NpuGraph, a shared pool, "")`` on an NPU, else ``(None, None, why)``."""
    if device.type != "npu":
        return None, None, f"NPU graphs capture work on an NPU, not on device type {device.type!r}"
    return NpuGraph, torch_npu().npu.graph_pool_handle(), ""
