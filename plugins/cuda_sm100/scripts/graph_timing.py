"""CUDA-graph timing shared by the kernel benchmark scripts of this folder."""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_graph(fn: Callable[[int], object], calls: int, replays: int) -> float | None:
    """Microseconds per call, replaying a CUDA graph of ``fn(0) ... fn(calls - 1)`` (each also run
    once eagerly first, which compiles); ``None``, with the reason printed, if that fails."""
    try:
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # report, keep going
        print(f"  ({getattr(fn, '__name__', 'call')} failed: {type(exc).__name__}: {str(exc)[:160]})")
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def gpu_run_header(benchmark: str, *, local_time: bool = False) -> dict:
    """The leading fields of a GPU benchmark's JSON: what it measured, when (``date``, UTC), on
    which device and software (torch, Triton, Python).  ``local_time``: also ``time``, the local
    wall-clock time without a zone (``%Y-%m-%dT%H:%M:%S``), which the attention and TileKernels
    benchmarks' JSON has always carried."""
    import datetime
    import platform
    import time

    import triton

    header = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if local_time:
        header["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return header
