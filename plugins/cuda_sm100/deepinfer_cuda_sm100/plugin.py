"""DeepInfer hooks of the ``cuda_sm100`` plugin (hooks only; the code lives beside it)."""

from collections.abc import Callable

from deepinfer_core.backends import BackendSpec
from deepinfer_core.hookspecs import hookimpl
from deepinfer_cuda_sm100 import backend

DEEPINFER_API = ">=1.0,<2"


@hookimpl
def deepinfer_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register the ``cuda_sm100`` backend (CUDA, priority 100)."""
    register(
        BackendSpec(
            name="cuda_sm100",
            device_type="cuda",
            priority=100,
            ops=backend.load_ops,
            is_available=backend.is_available,
            supports_graph_capture=True,
            compiles_kernels=True,  # Triton and TileLang compile at the first call of each configuration
            # the kernels, and the reference ops left to fall back with the mode's GEMM on this
            # backend's tile_matmul: tested bitwise on the GPU (tests/ops/test_batch_invariance.py,
            # plugins/cuda_sm100/tests/test_gpu_batch_invariance.py)
            batch_invariant_devices=("cuda",),
            description="NVIDIA GPUs of compute capability >= 9.0 (Triton kernels)",
        )
    )
