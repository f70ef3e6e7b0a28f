"""Programmatic dependent launch (PDL) for the Triton kernels on SM90 and later.

A kernel launched with PDL may be scheduled while the kernel before it in the stream still
runs, so its launch latency hides behind that kernel's tail instead of leaving the GPU idle
between the two (a decode step launches ~190 kernels).  To keep every result the same, each
kernel that takes part starts with :func:`pdl_enter`: it first waits until the kernel before
it has finished and its writes are visible (``griddepcontrol.wait``), then lets the kernel
after it be scheduled (``griddepcontrol.launch_dependents``).  No kernel reads or writes
global memory before that wait, so the order of every memory access is the order without
PDL; the next kernel's early start only overlaps its launch.  Inside a CUDA graph the
launches become programmatic edges.

:func:`pdl_args` gives a launch's keywords: PDL on for a CUDA device of compute capability 9
or more, outside Triton's interpreter, unless ``DEEPINFER_CUDA_PDL=0`` is set (then, and
everywhere else, the kernels compile without the two instructions and launch as before).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED

ENV = "DEEPINFER_CUDA_PDL"
"""Set to ``0`` to launch the Triton kernels without PDL."""


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """A kernel's first statement: with ``USE_PDL``, wait for the previous kernel in the stream
    to finish (its writes visible), then allow the next one to be scheduled."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _enabled(device_index: int) -> bool:
    if INTERPRETED or os.environ.get(ENV, "1") == "0" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled() -> bool:
    """Whether Triton kernels launched now on the current CUDA device use PDL."""
    if INTERPRETED or not torch.cuda.is_available():
        return False
    return _enabled(torch.cuda.current_device())


def pdl_args() -> dict:
    """Keywords for a launch of a kernel that starts with :func:`pdl_enter`:
    ``{"USE_PDL": True, "launch_pdl": True}`` where :func:`pdl_enabled`, else none (the
    kernel's ``USE_PDL`` defaults to ``False``)."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled() else {}
