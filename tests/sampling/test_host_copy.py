""":class:`~deepinfer_core.sampling.transfer.HostCopy`: a step's sampled tokens reach the host
without waiting for the work queued after them (the next step's graph), which is what lets
async scheduling overlap the host's bookkeeping of step N with the device's step N + 1."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from deepinfer_core.errors import DeviceTimeoutError
from deepinfer_core.sampling.transfer import HostCopy, wait_until

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


def test_the_values_and_dtype_come_back_on_the_cpu():
    ids = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64)
    copy = HostCopy(ids)
    got = copy.get()
    assert got.device.type == "cpu" and got.dtype == torch.int64 and got.tolist() == [3, 1, 4, 1, 5]
    assert copy.get().tolist() == got.tolist()  # a second read returns the same values


def test_the_copy_is_taken_when_made_not_when_read():
    """On the host the copy holds the tensor as it was handed over (on CUDA the values are
    copied in stream order before any later write)."""
    ids = torch.arange(4)
    copy = HostCopy(ids.clone())
    ids.add_(10)
    assert copy.get().tolist() == [0, 1, 2, 3]


@needs_cuda
def test_reading_does_not_wait_for_work_queued_after_the_copy():
    """A copy started before a long kernel is read while that kernel still runs: ``get`` waits
    for the copy's event, not for the stream (a plain ``.tolist()`` would wait for the kernel)."""
    ids = torch.arange(8, device="cuda")
    torch.cuda.synchronize()
    copy = HostCopy(ids * 2)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning queued behind the copy
    got = copy.get().tolist()
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert got == [2 * i for i in range(8)]
    assert still_running, "get() waited for the kernel queued after the copy"


def test_waited_is_zero_where_there_is_nothing_to_wait_for():
    copy = HostCopy(torch.arange(3))
    assert copy.waited_s == 0.0
    copy.get()
    assert copy.waited_s == 0.0


@needs_cuda
def test_waited_counts_the_time_get_blocked_on_work_queued_before_the_copy():
    """A copy queued behind ~0.2 s of spinning: the first ``get`` blocks until it lands and says
    how long (``waited_s``, what the engine reports as a step's host wait); a second read does
    not wait again."""
    # The values are computed before the spin: a kernel's first launch may load its module,
    # which waits for the device (CUDA's lazy loading), and the copy would land before get()
    values = torch.arange(8, device="cuda") + 1
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s (at ~2 GHz) queued before the copy
    copy = HostCopy(values)
    assert copy.get().tolist() == [i + 1 for i in range(8)]
    assert copy.waited_s > 0.05
    first = copy.waited_s
    copy.get()
    assert copy.waited_s == first


def test_wait_until_returns_once_the_condition_holds():
    """The poll returns soon after the condition turns true (here set by another thread after
    0.05 s, past the first 10 ms of polling without sleeping), well before the limit."""
    done = threading.Event()
    timer = threading.Timer(0.05, done.set)
    start = time.perf_counter()
    timer.start()
    wait_until(done.is_set, 30.0, "the flag")
    waited = time.perf_counter() - start
    timer.join()
    assert done.is_set() and 0.04 < waited < 5.0


def test_wait_until_raises_one_line_naming_what_it_waited_for_and_the_limit():
    start = time.perf_counter()
    with pytest.raises(DeviceTimeoutError) as info:
        wait_until(lambda: False, 0.05, "a step's results (its sampled tokens)")
    assert time.perf_counter() - start >= 0.05
    message = str(info.value)
    assert "\n" not in message and "a step's results (its sampled tokens)" in message
    assert "device_timeout_s=0.05" in message and "hung" in message


@needs_cuda
def test_a_copy_behind_a_stalled_device_ends_in_a_timeout_error_not_a_hang():
    """A copy queued behind ~1 s of device work, read with a 0.1 s limit: ``get`` raises
    :class:`DeviceTimeoutError` after about the limit instead of waiting; with a limit longer
    than the work, the values arrive and the wait is reported."""
    ids = torch.arange(8, device="cuda")
    first, second = ids + 1, ids + 2  # before the spins: no module loads behind them
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning queued before the copy
    copy = HostCopy(first, timeout_s=0.1)
    start = time.perf_counter()
    with pytest.raises(DeviceTimeoutError, match="device_timeout_s=0.1"):
        copy.get()
    assert time.perf_counter() - start < 0.9
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s
    patient = HostCopy(second, timeout_s=30.0)
    assert patient.get().tolist() == [i + 2 for i in range(8)] and patient.waited_s > 0.05
