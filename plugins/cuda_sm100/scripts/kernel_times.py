"""Device time of one call, kernel by kernel, for the benchmarks' ``--tune`` rows."""

from __future__ import annotations

from collections.abc import Callable

import torch


def kernel_split(fn: Callable[[], object], calls: int = 10) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn`` launches (``torch.profiler`` over
    ``calls`` plain launches, L2 warm), slowest first."""
    from profile_step import breakdown
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return dict(breakdown(prof, calls, device=True)[1])
