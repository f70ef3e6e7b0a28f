"""DeepInfer hooks of the ``ascend950`` plugin (hooks only; the code lives beside it)."""

from collections.abc import Callable

from deepinfer_ascend950 import backend
from deepinfer_ascend950.npu_graph import graph_runtime
from deepinfer_ascend950.quant_mx import declared_formats
from deepinfer_core.backends import BackendSpec
from deepinfer_core.hookspecs import hookimpl

DEEPINFER_API = ">=1.0,<2"


@hookimpl
def deepinfer_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register the ``ascend950`` backend (NPU, priority 100); it keeps FP8 / FP4 checkpoint
    weights quantised only with ``DEEPINFER_ASCEND950_MX_ACTIVATIONS=1`` (see
    :func:`~deepinfer_ascend950.quant_mx.declared_formats`)."""
    register(
        BackendSpec(
            name="ascend950",
            device_type="npu",
            priority=100,
            ops=backend.load_ops,
            is_available=backend.is_available,
            supports_graph_capture=True,
            graph_runtime=graph_runtime,  # torch_npu's NPUGraph
            quantized_weights=declared_formats(),
            kv_formats=backend.KV_FORMATS,
            description="Huawei Ascend 950 NPUs via torch_npu fused operators (never run on an NPU)",
        )
    )
