""":class:`~deepinfer_core.sampling.transfer.HostCopy`: a step's sampled tokens reach the host
without waiting for the work queued after them (the next step's graph), which is what lets
async scheduling overlap the host's bookkeeping of step N with the device's step N + 1."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.sampling.transfer import HostCopy

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
    ids = torch.arange(8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s (at ~2 GHz) queued before the copy
    copy = HostCopy(ids + 1)
    assert copy.get().tolist() == [i + 1 for i in range(8)]
    assert copy.waited_s > 0.05
    first = copy.waited_s
    copy.get()
    assert copy.waited_s == first
