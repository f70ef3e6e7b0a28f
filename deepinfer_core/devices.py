"""Checking a torch device string before anything is allocated on it.

``torch.device("foo")`` raises a bare ``RuntimeError`` and ``torch.zeros(1, device="cuda")``
on a CPU-only build an ``AssertionError`` deep inside torch; the engine calls
:func:`check_device` first so the user gets one :class:`~deepinfer_core.errors.ConfigError`
naming the field and what to do instead.
"""

from __future__ import annotations

import torch

from deepinfer_core.errors import ConfigError


def device_count(device_type: str) -> int | None:
    """Devices of ``device_type`` torch can use (``None`` when torch cannot tell, e.g. a type
    served by an out-of-tree extension that is not loaded)."""
    if device_type == "cpu":
        return 1
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "is_available"):
        return None
    try:
        if not module.is_available():
            return 0
        return int(module.device_count()) if hasattr(module, "device_count") else 1
    except Exception:  # a broken driver counts as no device
        return 0


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (``torch.<type>.synchronize``; nothing on the CPU
    or for a device type whose module has none)."""
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(module, "synchronize"):
        module.synchronize(device)


def check_device(device: str, field: str = "device") -> torch.device:
    """Parse ``device`` and check that torch can use it.

    Raises:
        ConfigError: the string is not a torch device, or no such device is available here
            (naming the field, the value and the devices that are).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"{field}={device!r} is not a torch device; use e.g. 'cpu', 'cuda' or 'cuda:1' (other "
            "device types need their torch extension loaded, e.g. torch_npu for 'npu')"
        ) from None
    if dev.type == "meta":
        raise ConfigError(f"{field}={device!r}: the meta device holds no data; use e.g. 'cpu' or 'cuda'")
    count = device_count(dev.type)
    if count == 0:
        build = f"torch {torch.__version__}"
        if dev.type == "cuda" and torch.version.cuda is None:
            why = f"{build} was built without CUDA (a CPU build)"
        else:
            why = f"{build} sees no {dev.type} device"
        raise ConfigError(
            f"{field}={device!r}: {why}; use device='cpu' or install a {dev.type} build of torch"
        )
    if count is not None and dev.index is not None and dev.index >= count:
        raise ConfigError(
            f"{field}={device!r}: only {count} {dev.type} device(s) are visible (0..{count - 1})"
        )
    return dev
