"""``device_view_of_host``: where a device cannot read host memory in place it says why (the
caller copies); on CUDA see ``tests/models/v41/test_v41_cuda.py``."""

from __future__ import annotations

import torch

from deepinfer_core.weights.host_mapped import device_view_of_host


def test_devices_without_in_place_reads_say_why():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    view, why = device_view_of_host(t, "cpu")
    assert view is None and "cpu devices do not read host memory in place" in why
    view, why = device_view_of_host(t.t(), "cuda")
    assert view is None and "contiguous" in why
    if not torch.cuda.is_available():
        view, why = device_view_of_host(t, "cuda")
        assert view is None and "cudaHostRegister unavailable" in why
