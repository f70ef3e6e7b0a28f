"""``linear`` over an FP8 block weight by the fastest path measured at its shape.

Two paths compute the contract's arithmetic (a quantised weight counts as its dequantised
value, :func:`deepinfer_core.ops.linear.linear`):

- ``"triton"``: the FP8 block GEMM (:mod:`deepinfer_cuda_sm100.kernels.fp8_gemm`), which reads
  the e4m3 tiles and scales them in registers: fewest bytes, the decode path;
- ``"cublas"``: the weight dequantised by one kernel into a scratch tensor
  (:mod:`deepinfer_cuda_sm100.kernels.fp8_dequant`, bitwise the reference's dequantisation),
  then cuBLAS's ``F.linear``: the reference op's own computation, at cuBLAS's tensor-core rate
  (prefill shapes, where the GEMM is compute-bound and the extra weight pass is small).

A call takes the path the measured table of this GPU's architecture
(:mod:`deepinfer_cuda_sm100.kernel_choice`, op ``"linear_fp8"``, keyed by the weight's ``N x K``
and the call's rows ``M``; re-measured by ``python plugins/cuda_sm100/scripts/bench_fp8_gemm.py
--write-choices``) found fastest at the nearest measured ``M``, Triton where no point was
measured.  Batch-invariant mode and the W8A8 prefill (``DEEPINFER_FP8_PREFILL=w8a8``) always
take Triton (cuBLAS picks kernels by the whole shape; the W8A8 math is Triton's).  The choice
depends on static shapes only, so a captured graph replays what it captured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from deepinfer_core.ops.modes import batch_invariant_enabled
from deepinfer_cuda_sm100 import kernel_choice

OP = "linear_fp8"
"""The op name of the GEMM points in the measured table."""
PATHS = frozenset({"triton", "cublas"})
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def choose_path(x: torch.Tensor, weight) -> str:
    """``"triton"`` or ``"cublas"`` for ``linear(x, weight)`` (see the module docstring)."""
    from deepinfer_cuda_sm100.kernels import fp8_gemm

    if batch_invariant_enabled() or x.device.type != "cuda" or fp8_gemm._prefill_w8a8(x):
        return "triton"
    n, k = weight.data.shape
    m = x.numel() // max(k, 1)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    choice = kernel_choice.choose(OP, "w8a16", _DTYPES[x.dtype], n, k, m, k, _arch(index), PATHS)
    return choice if choice in PATHS else "triton"


def cublas_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """The ``"cublas"`` path: dequantise (bitwise the reference's), then ``F.linear``."""
    from deepinfer_cuda_sm100.kernels.fp8_dequant import dequantize_fp8

    return F.linear(x, dequantize_fp8(weight.data, weight.scale, tuple(weight.block), x.dtype))


def make_linear(triton_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The op: the path :func:`choose_path` picks, ``triton_fn`` for ``"triton"``."""

    def linear(x, weight) -> torch.Tensor:
        if choose_path(x, weight) == "cublas":
            return cublas_linear(x, weight)
        return triton_fn(x, weight)

    linear.__doc__ = f"Dispatcher over the FP8 block GEMM and dequantise + cuBLAS.\n\n{__doc__}"
    return linear
