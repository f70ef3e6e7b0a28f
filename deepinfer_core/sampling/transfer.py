"""Host values to the device in one copy: pinned, non-blocking on CUDA, no copy on CPU
(:func:`host_to_device`, :func:`tensor_to_device`), the packer that sends several tensors'
values as one float64 buffer (:class:`Packer`), and a device tensor's copy back started early
and waited for late (:class:`HostCopy`)."""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable, Iterable, Sequence

import torch

from deepinfer_core.errors import DeviceTimeoutError

SPIN_S = 0.01
"""How long :func:`wait_until` polls without pause before it polls once a millisecond."""


class Packer:
    """Host values of several tensors in one float64 buffer (exact for fp32 values and for
    integers below 2**53), sent to the device in one copy; there each dtype's values are
    converted at once and cut into views."""

    def __init__(self) -> None:
        self._groups: dict[torch.dtype, tuple[array, list[tuple[int, int, tuple[int, ...]]]]] = {}
        self._where: list[tuple[torch.dtype, int]] = []

    def add(self, values: Iterable[float], shape: tuple[int, ...], dtype: torch.dtype) -> int:
        data, segments = self._groups.setdefault(dtype, (array("d"), []))
        start = len(data)
        data.extend(values)
        segments.append((start, len(data), shape))
        self._where.append((dtype, len(segments) - 1))
        return len(self._where) - 1

    def add_rows(self, rows: list[list[int]] | list[list[float]], dtype: torch.dtype) -> int:
        shape = (len(rows), len(rows[0]) if rows else 0)
        return self.add(itertools.chain.from_iterable(rows), shape, dtype)

    def to(self, device: torch.device) -> list[torch.Tensor]:
        if not self._where:
            return []
        data = array("d")
        for group, _ in self._groups.values():
            data.extend(group)
        flat = host_to_device(data, device)
        views: dict[torch.dtype, list[torch.Tensor]] = {}
        offset = 0
        for dtype, (group, segments) in self._groups.items():
            typed = flat[offset : offset + len(group)].to(dtype)
            offset += len(group)
            views[dtype] = [typed[a:b].view(shape) for a, b, shape in segments]
        return [views[dtype][i] for dtype, i in self._where]


def host_to_device(values: array | Sequence[float], device: torch.device | str) -> torch.Tensor:
    """Host values as a float64 tensor on ``device``: on CUDA by a non-blocking copy from pinned
    memory (no host sync; the caching host allocator keeps the buffer until the copy is done),
    on CPU without a copy."""
    data = values if isinstance(values, array) and values.typecode == "d" else array("d", values)
    host = torch.frombuffer(data, dtype=torch.float64) if len(data) else torch.empty(0, dtype=torch.float64)
    return tensor_to_device(host, device)


def tensor_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on ``device``, as :func:`host_to_device` (pinned, non-blocking on CUDA)."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        return pinned.copy_(host).to(device, non_blocking=True)
    return host.to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on the host, the copy started when this is made and waited for
    when :meth:`get` is first called.

    On CUDA the copy goes to pinned memory without blocking, with an event recorded right after
    it: :meth:`get` waits for that event only, not for work queued on the stream later (the next
    step's graph), so the host can read a step's results while the device runs the next one.
    Elsewhere the tensor is kept and :meth:`get` returns it on the CPU (a blocking copy where
    it is not already there).

    Args:
        tensor: the device tensor to copy.
        timeout_s: seconds :meth:`get` waits for the copy before it raises
            :class:`~deepinfer_core.errors.DeviceTimeoutError` (the engine's
            ``device_timeout_s``); ``0`` waits as long as it takes.

    Attributes:
        waited_s: seconds the first :meth:`get` blocked on the copy (0 until then, and where
            there is no event to wait for): near 0 when the host, not the device, is behind.
    """

    def __init__(self, tensor: torch.Tensor, timeout_s: float = 0.0) -> None:
        self.waited_s = 0.0
        self._timeout_s = timeout_s
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._tensor = host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._tensor = tensor

    def get(self) -> torch.Tensor:
        """The values in host memory (waits for the copy the first time)."""
        if self._event is not None:
            start = time.perf_counter()
            if self._timeout_s > 0:
                wait_until(self._event.query, self._timeout_s, "a step's results (its sampled tokens)")
            else:
                self._event.synchronize()
            self.waited_s = time.perf_counter() - start
            self._event = None
        return self._tensor.cpu()


def wait_until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Return once ``done()`` is true; raise :class:`~deepinfer_core.errors.DeviceTimeoutError`
    naming ``what`` when it is still false after ``timeout_s`` seconds.  Polls without pause for
    the first :data:`SPIN_S` seconds (a wait for a step's tokens is usually shorter: no latency
    added), then once a millisecond; a device event has no timed wait."""
    start = time.perf_counter()
    while not done():
        waited = time.perf_counter() - start
        if waited > timeout_s:
            raise DeviceTimeoutError(
                f"the device has not delivered {what} after {waited:.3g} s (device_timeout_s={timeout_s:g}): "
                "a kernel or the device may be hung (raise device_timeout_s if steps this long are expected)"
            )
        if waited > SPIN_S:
            time.sleep(0.001)
