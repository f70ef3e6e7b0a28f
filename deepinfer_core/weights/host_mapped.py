"""Host tensors a device reads in place (zero copy).

A table too large for device memory — DeepSeek-V4.1's Engram tables are ~98 GB each — stays
in host memory (memory-mapped from the checkpoint), page-locked and mapped into the device's
address space; the device's gathers then read the rows a step needs over the interconnect,
inside captured graphs too, and device memory holds none of it.  On CUDA the host range is
registered with ``cudaHostRegister`` (mapped; read-only for a read-only file mapping) and,
with unified virtual addressing, the host pointer is the device pointer: a CUDA tensor over
it comes from the ``__cuda_array_interface__`` protocol.  Other device types (and a failed
registration: e.g. ``RLIMIT_MEMLOCK``, a driver without read-only registration) return
``None`` with the reason, and the caller copies the tensor to the device instead.
"""

from __future__ import annotations

from typing import Any

import torch

CUDA_HOST_REGISTER_MAPPED = 0x02
CUDA_HOST_REGISTER_READ_ONLY = 0x08

_KEPT: list[tuple[torch.Tensor, torch.Tensor]] = []
"""(host tensor, device view) of every registration: the host memory (a file mapping) must
outlive the views, which live as long as the model (a process's lifetime)."""


class _DeviceArray:
    """A raw device pointer and length, for ``torch.as_tensor`` (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),  # torch refuses read-only views; the caller never writes
            "strides": None,
            "version": 3,
        }


def device_view_of_host(
    t: torch.Tensor, device: str | torch.device, read_only: bool = True
) -> tuple[torch.Tensor | None, str | None]:
    """A ``device`` tensor reading ``t``'s host memory in place, or ``None`` and why not.

    Args:
        t: a contiguous CPU tensor (e.g. a memory-mapped checkpoint tensor).
        device: where the view lives; only ``cuda`` devices map host memory here.
        read_only: ``t``'s pages are read-only (a read-only file mapping): registered so.

    Returns:
        ``(view, None)``: ``view`` has ``t``'s dtype and shape on ``device`` and aliases its
        memory (never write through it); or ``(None, reason)``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"{device.type} devices do not read host memory in place here"
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None, "not a contiguous, non-empty CPU tensor"
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    flags = CUDA_HOST_REGISTER_MAPPED | (CUDA_HOST_REGISTER_READ_ONLY if read_only else 0)
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags)
    except Exception as e:  # no CUDA runtime bindings in this build
        return None, f"cudaHostRegister unavailable ({type(e).__name__}: {e})"
    code = int(getattr(err, "value", err))
    if code != 0:
        return None, f"cudaHostRegister of {nbytes} bytes failed (cudaError {code}: {err})"
    try:
        with torch.cuda.device(device):
            flat = torch.as_tensor(_DeviceArray(ptr, nbytes), device=device)
    except Exception as e:
        torch.cuda.cudart().cudaHostUnregister(ptr)
        return None, f"no device view of the registered memory ({type(e).__name__}: {e})"
    view = flat.view(t.dtype).view(t.shape)
    _KEPT.append((t, view))
    return view, None
