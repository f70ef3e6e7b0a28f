"""DeepInfer hooks of the ``cpu`` plugin (hooks only; the code lives beside it)."""

from collections.abc import Callable

from deepinfer_core.backends import BackendSpec
from deepinfer_core.hookspecs import hookimpl
from deepinfer_cpu import backend

DEEPINFER_API = ">=1.0,<2"


@hookimpl
def deepinfer_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register the ``cpu`` backend (CPU, priority 10: above the reference)."""
    register(
        BackendSpec(
            name="cpu",
            device_type="cpu",
            priority=10,
            ops=backend.load_ops,
            is_available=backend.is_available,
            supports_graph_capture=False,
            # the kernels loop token by token (tests/ops/test_batch_invariance.py checks each
            # bitwise); the ops left to the reference are batch invariant on CPU
            batch_invariant_devices=("cpu",),
            description="CPU: fused float32 C++ kernels (mHC, norm, rope, attention, compressor, indexer)",
        )
    )
