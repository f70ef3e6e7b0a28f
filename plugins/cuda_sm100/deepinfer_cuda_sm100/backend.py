"""The ``cuda_sm100`` backend: availability probe (CUDA GPU of capability >= 9.0, Triton) and ops."""

from __future__ import annotations

import importlib.util

from deepinfer_cuda_sm100 import MIN_COMPUTE_CAPABILITY


def is_available() -> tuple[bool, str | None]:
    """``(True, None)`` when the backend can run here, else ``(False, reason)``."""
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} was built without CUDA; install a CUDA build of torch"
        return False, "torch.cuda.is_available() is False: no CUDA GPU or driver is visible to this process"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return False, (
            f"GPU {torch.cuda.get_device_name()} has compute capability {major}.{minor}; "
            f"cuda_sm100 needs >= {need}"
        )
    if importlib.util.find_spec("triton") is None:
        return False, (
            "triton is not installed (pip install 'triton>=3.0', or from the root of a DeepInfer "
            "checkout: pip install -e 'plugins/cuda_sm100[triton]')"
        )
    return True, None


def load_ops() -> dict:
    """The op implementations: Triton kernels (:mod:`deepinfer_cuda_sm100.ops`; imports Triton),
    and on a GPU, where TileKernels is installed, dispatchers for the ops it was measured faster
    at (:func:`deepinfer_cuda_sm100.tk_dispatch.tilekernels_ops`).

    The ops it does not list fall back to the core's reference implementations.
    """
    import torch

    from deepinfer_cuda_sm100.kernels import _common
    from deepinfer_cuda_sm100.ops import load_ops as triton_ops

    ops = triton_ops()
    if not _common.INTERPRETED and torch.cuda.is_available():
        from deepinfer_cuda_sm100 import kernel_choice, tk_dispatch

        ops.update(tk_dispatch.tilekernels_ops(ops, kernel_choice.device_arch(torch.device("cuda"))))
    return ops
