"""Where a decode step's time goes: device kernels by kind, and the gaps between them.

Builds an engine on ``--model`` (default: the built-in tiny model), admits ``--batch``
requests of ``--prompt-len`` random ids (greedy, ``ignore_eos``), steps until every request
decodes, runs ``--warmup`` more steps, then profiles ``--steps`` steps with
``torch.profiler`` (CUDA graphs stay on: CUPTI records the kernels a graph replays).  Reports
per step:

* wall time (``LLMEngine.step`` calls, the device synchronised before and after);
* device busy time: the sum of the kernels' durations; device active time: the union of the
  kernels' intervals (kernels launched with programmatic dependent launch start before the
  previous one ends and wait inside, so their durations overlap and busy time exceeds active
  time); ``idle = wall - active`` is what the device waits for (launches, host work not hidden
  by async scheduling, syncs);
* busy time by kind of kernel (attention, indexer, MoE, FP8 GEMM, cuBLAS, mHC / norm / RoPE,
  PyTorch's own kernels: the ops still on the reference, ...), and the top kernels by name;
* per CUDA stream, its activities and active time (``streams``; printed when the step used
  more than one: a block's independent chains on the side stream, ``DEEPINFER_STREAM_OVERLAP``).

On a CPU the profiler sees operators, not kernels: the same table over the operators' own CPU
time (``self``), so the script runs anywhere.  Prints the tables and writes JSON (``--out``).

``--host N`` then times the same number of steps without the profiler (CUDA graphs on) and
once more under :mod:`cProfile`: the host's own time per step (the wall time less the time the
host waits on the device: ``tolist``, ``item``, synchronisations) and the ``N`` DeepInfer
functions taking the most host time per step (cumulative; :mod:`cProfile` slows Python down,
so these are upper bounds).  When the host's own time exceeds the device's busy time, async
scheduling cannot hide it and the device idles.

``--gaps N`` lists where the device idles: each idle interval (no activity on any stream) is
charged to the pair of activities around it (the last to finish before it, the first to start
after it; ``stream:kernel``), summed per step over the profiled steps, the ``N`` largest pairs
printed (JSON: ``idle_gaps``).  A pair that recurs once a layer points at a launch or a
cross-stream dependency (a fork or a join of a block's chains) the step waits on.

On a GPU with three or more profiled steps it also reports the steady state: the median
period between consecutive steps' first once-a-step kernel and the device's active and idle
time in it (JSON: ``steady_state``), which leaves out a first step that starts behind.

``--prefill N`` profiles prefill instead: each profiled step admits ``--batch`` requests of ``N``
tokens (prefix caching off, so every prompt is computed), prefills them in one chunk
(``max_num_batched_tokens`` = batch x N) and samples their first tokens; the tables are then
per prefill of ``batch x N`` tokens, with its tokens/s (``1 x 8192`` and ``16 x 512`` are
``gpu_e2e.py``'s prefill shapes; ``--keep-quantized on`` / ``off`` compares the weights' formats
kernel by kernel).

``--trace PATH`` writes the profiled steps as a Chrome trace (``chrome://tracing``, Perfetto):
every kernel with its stream, start and end, and the host's operators and CUDA API calls.

``--sites N`` then runs the same number of steps once more without the profiler and lists the
``N`` source lines of DeepInfer that call the most PyTorch operators per step (views and
allocations left out): each such operator is a kernel launch on a GPU, the launches a fused op
would save.  A captured CUDA graph replays its kernels without calling the operators, so
the engine of that pass is built with ``enforce_eager=True`` (same model, same steps).

    python plugins/cuda_sm100/scripts/profile_step.py --model /tmp/m --backend cuda_sm100 --batch 1
    python plugins/cuda_sm100/scripts/profile_step.py --steps 2          # the tiny model, here
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_core import LLM
from deepinfer_core.benchmarking.harness import run_main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_workloads import workload  # noqa: E402

KINDS: tuple[tuple[str, str], ...] = (
    ("attention", r"sparse_attention|attention|_attn|flash"),
    ("moe", r"moe|gate_up|_down_kernel|grouped|route|expert"),
    ("indexer", r"indexer|topk|radix|_select"),
    ("compressor", r"compress"),
    ("fp8 gemm", r"fp8|scaled_mm|dequant|w8a"),
    ("dense gemm", r"gemm|cutlass|xmma|nvjet|cublas|addmm|::mm\b|::bmm\b|matmul|linear"),
    ("mhc / norm / rope", r"hc_|sinkhorn|rms|norm|rope|rotary"),
    ("sampling", r"sample|softmax|argmax|logits|multinomial"),
    ("torch (reference ops)", r"elementwise|vectorized|reduce|index|scatter|gather|copy|cat|fill|aten::"),
)
"""Kinds of kernels (or CPU operators) by a regular expression on the name; first match wins."""


def kind_of(name: str) -> str:
    """The kind of a kernel or operator name (``"other"`` when no pattern matches)."""
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the built-in tiny model)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument(
        "--steps", type=int, default=10, help="profiled decode steps, or prefills with --prefill (default 10)"
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="profile prefills of --batch requests of N tokens each instead of decode steps",
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="decode steps (or prefills) before profiling (default 3)"
    )
    p.add_argument("--keep-quantized", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's format (e.g. fp8)")
    p.add_argument("--top", type=int, default=15, help="kernels listed by name (default 15)")
    p.add_argument(
        "--sites", type=int, default=0, help="also list the N source lines calling the most operators"
    )
    p.add_argument("--host", type=int, default=0, help="also list the N functions taking the most host time")
    p.add_argument(
        "--gaps",
        type=int,
        default=0,
        help="also list the N pairs of kernels around the most device idle time",
    )
    p.add_argument("--trace", type=Path, help="also write the profiled steps as a Chrome trace (JSON)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/profile_step.json"))
    a = p.parse_args(argv)
    if a.prefill < 0:
        p.error(f"--prefill {a.prefill}: give a prompt length >= 1 (0: profile decode steps)")
    for flag, what in (("sites", "source lines"), ("host", "functions"), ("gaps", "pairs")):
        if getattr(a, flag) < 0:
            p.error(f"--{flag} {getattr(a, flag)}: give a count of {what} >= 0")
    return a


def profile_steps(llm: LLM, step: Callable[[], object], steps: int) -> tuple[float, profile]:
    """Wall seconds per step over ``steps`` profiled calls of ``step``, and the profile."""
    cuda = torch.cuda.is_available() and llm.config.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    return wall, prof


_NO_KERNEL_NAMES = (
    "view as_strided slice select t transpose unsqueeze squeeze narrow expand reshape permute "
    "_unsafe_view alias detach unbind split split_with_sizes chunk unflatten flatten lift_fresh "
    "empty empty_strided empty_like new_empty _local_scalar_dense"
)
NO_KERNEL = frozenset(_NO_KERNEL_NAMES.split())
"""Operators that launch no kernel: views, allocations, reading a scalar back."""


PACKAGE_DIR = "/deepinfer_"
"""What the path of a DeepInfer package's source file holds (``deepinfer_core/``, a plugin's)."""


class _SiteCounter(TorchDispatchMode):
    """Counts operators (:data:`NO_KERNEL` left out) by the innermost DeepInfer source line."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in NO_KERNEL:
            frame = sys._getframe(1)
            while frame is not None and PACKAGE_DIR not in frame.f_code.co_filename:
                frame = frame.f_back
            site = "?"
            if frame is not None:
                path = frame.f_code.co_filename
                short = path[path.rfind(PACKAGE_DIR) + 1 :]
                site = f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
            self.calls[site] += 1
        return func(*args, **(kwargs or {}))


WAITS = ("tolist", "item", "synchronize", "cpu", "wait")
"""Built-in methods in which the host waits on the device (their time is not the host's own)."""


def host_profile(
    llm: LLM, step: Callable[[], object], steps: int
) -> tuple[float, float, list[tuple[str, float]]]:
    """Over ``steps`` engine steps: wall ms per step without a profiler, the host's waits on the
    device per step under :mod:`cProfile` (ms), and DeepInfer's functions by cumulative ms per
    step under :mod:`cProfile`, most first."""
    cuda = torch.cuda.is_available() and llm.config.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = (time.perf_counter() - t0) / steps * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    waits = sum(v[3] for (file, _, name), v in stats.items() if file == "~" and any(w in name for w in WAITS))
    funcs = [
        (f"{file[file.rfind(PACKAGE_DIR) + 1 :]}:{line} {name}", v[3] / steps * 1e3)
        for (file, line, name), v in stats.items()
        if PACKAGE_DIR in file
    ]
    return wall, waits / steps * 1e3, sorted(funcs, key=lambda kv: -kv[1])


def operator_sites(step: Callable[[], object], steps: int) -> list[tuple[str, float]]:
    """Operators per step by calling source line over ``steps`` calls of ``step``, most first."""
    with _SiteCounter() as counter:
        for _ in range(steps):
            step()
    return sorted(((k, v / steps) for k, v in counter.calls.items()), key=lambda kv: -kv[1])


def union_length(intervals) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlapping ones count once)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def device_intervals(prof: profile, kind=torch.autograd.DeviceType.CUDA) -> list[tuple[float, float]]:
    """Start and end (microseconds) of every activity of device type ``kind`` the profile
    recorded (on CUDA: kernels, copies, fills)."""
    return [
        (e.start_ns() / 1e3, e.end_ns() / 1e3)
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == kind
    ]


def device_events(prof: profile) -> list[tuple[float, float, str, str]]:
    """Every CUDA activity of the profile: ``(start us, end us, stream, name)``, by start."""
    return sorted(
        (e.start_ns() / 1e3, e.end_ns() / 1e3, str(e.device_resource_id()), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA
    )


def stream_activity(events: list[tuple[float, float, str, str]], steps: int) -> dict[str, dict[str, float]]:
    """Per CUDA stream (the profiler's resource id) of :func:`device_events`: activities and the
    union of their intervals (ms) per step; with two streams (a block's chains overlapped,
    ``DEEPINFER_STREAM_OVERLAP``) the streams' active times add up to more than the device's."""
    per: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for start, end, stream, _ in events:
        per[stream].append((start, end))
    return {
        stream: {"activities": len(iv) / steps, "active_ms": union_length(iv) / steps / 1e3}
        for stream, iv in sorted(per.items(), key=lambda kv: -len(kv[1]))
    }


def steady_period(events: list[tuple[float, float, str, str]], steps: int) -> dict | None:
    """The step's period in steady state: the median interval between consecutive starts of the
    first kernel that runs once a step (its first call starts at or before every other
    once-a-step kernel's), with the device's active time in that median interval.  The
    profile's mean (``wall``) also counts a first step that starts behind (the profile begins
    after a device synchronisation, so the host's work of that step shows as device idle).
    ``{"kernel", "period_ms", "active_ms", "idle_ms"}``, or ``None`` with fewer than three
    steps or no kernel run once a step."""
    starts: dict[str, list[float]] = defaultdict(list)
    for start, _, _, name in events:
        starts[name].append(start)
    once = {name: sorted(times) for name, times in starts.items() if len(times) == steps}
    if steps < 3 or not once:
        return None
    name = min(once, key=lambda n: once[n][0])
    marks = once[name]
    spans = sorted(zip(marks, marks[1:], strict=False), key=lambda ab: ab[1] - ab[0])
    a, b = spans[len(spans) // 2]  # the median interval
    inside = [(max(s, a), min(e, b)) for s, e, _, _ in events if e > a and s < b]
    active = union_length(inside)
    return {
        "kernel": name,
        "period_ms": (b - a) / 1e3,
        "active_ms": active / 1e3,
        "idle_ms": (b - a - active) / 1e3,
    }


def idle_gaps(events: list[tuple[float, float, str, str]], steps: int) -> list[dict]:
    """The device's idle time (no activity on any stream) per step, by the pair of activities
    around each idle interval: the one whose end it follows (the last to finish) and the one
    whose start ends it; largest total first, each ``{"after", "before", "us_per_step",
    "gaps_per_step"}`` (names as ``stream:kernel``)."""
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    reach, last = None, None
    for start, end, stream, name in sorted(events):
        if reach is not None and start > reach:
            pairs[(last, f"{stream}:{name}")].append(start - reach)
        if reach is None or end > reach:
            reach, last = end, f"{stream}:{name}"
    rows = [
        {"after": a, "before": b, "us_per_step": sum(g) / steps, "gaps_per_step": len(g) / steps}
        for (a, b), g in pairs.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def breakdown(
    prof: profile, steps: int, device: bool
) -> tuple[dict[str, float], list[tuple[str, float]], dict[str, float]]:
    """Microseconds per step by kind and by name (kernels' device time, or operators' own CPU
    time), and launches (or operator calls) per step by name."""
    by_name: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        us = ev.self_device_time_total if device else ev.self_cpu_time_total
        if us > 0 and (not device or ev.device_type == torch.autograd.DeviceType.CUDA):
            by_name[ev.key] += us / steps
            calls[ev.key] += ev.count / steps
    by_kind: dict[str, float] = defaultdict(float)
    for name, us in by_name.items():
        by_kind[kind_of(name)] += us
    return dict(by_kind), sorted(by_name.items(), key=lambda kv: -kv[1]), dict(calls)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    llm, step, left = workload(a)
    steps = min(a.steps, left)
    wall, prof = profile_steps(llm, step, steps)
    device = llm.config.device.startswith("cuda") and torch.cuda.is_available()
    by_kind, by_name, calls = breakdown(prof, steps, device)
    busy = sum(by_kind.values())
    active = union_length(device_intervals(prof)) / steps if device else None
    what = "device kernels" if device else "CPU operators (self time)"
    launches = sum(calls.values())
    unit = f"prefill of {a.batch} x {a.prefill} tokens" if a.prefill else "step"
    rate = f" ({a.batch * a.prefill / wall:,.0f} tok/s)" if a.prefill else ""
    where = f"{llm.engine.backend.name} on {llm.config.device}, batch {a.batch}"
    print(f"{where}: {wall * 1e3:.3f} ms per {unit}{rate}")
    print(
        f"{what}: {busy / 1e3:.3f} ms per step"
        + (f", active {active / 1e3:.3f} ms, idle {wall * 1e3 - active / 1e3:.3f} ms" if device else "")
        + f"; {launches:.0f} {'launches' if device else 'operator calls'} per step"
    )
    if a.trace:
        a.trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(a.trace))
        print(f"wrote the trace to {a.trace}")
    events = device_events(prof) if device else []
    streams = stream_activity(events, steps)
    if len(streams) > 1:
        print(
            "streams (activities, active ms per step): "
            + "; ".join(f"{k}: {v['activities']:.0f}, {v['active_ms']:.3f}" for k, v in streams.items())
        )
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<24} {us / 1e3:8.3f} ms  {100 * us / busy:5.1f} %")
    print(f"top {a.top} by name (time, calls per step):")
    for name, us in by_name[: a.top]:
        print(f"  {us / 1e3:8.3f} ms  {calls[name]:6.1f}  {name[:90]}")
    report = {
        "backend": llm.engine.backend.name,
        "device": llm.config.device,
        "batch": a.batch,
        "prefill": a.prefill,
        "unit": unit,
        "steps": steps,
        "measured": what,
        "wall_ms_per_step": wall * 1e3,
        "busy_ms_per_step": busy / 1e3,
        "active_ms_per_step": active / 1e3 if device else None,
        "idle_ms_per_step": (wall * 1e3 - active / 1e3) if device else None,
        "streams": streams,
        "ms_by_kind": {k: v / 1e3 for k, v in by_kind.items()},
        "calls_per_step": launches,
        "ms_by_name": {k: v / 1e3 for k, v in by_name[: a.top]},
        "calls_by_name": {k: calls[k] for k, _ in by_name},
    }
    steady = steady_period(events, steps) if device else None
    if steady:
        print(
            f"steady state (median period of {steady['kernel'][:40]}): {steady['period_ms']:.3f} ms a step, "
            f"active {steady['active_ms']:.3f} ms, idle {steady['idle_ms']:.3f} ms"
        )
        report["steady_state"] = steady
    if a.gaps and device:
        gaps = idle_gaps(events, steps)
        print(f"device idle per step by the kernels around it (the {a.gaps} largest of {len(gaps)} pairs):")
        for g in gaps[: a.gaps]:
            pair = f"{g['after'][:60]}  ->  {g['before'][:60]}"
            print(f"  {g['us_per_step']:7.2f} us  x{g['gaps_per_step']:4.1f}  {pair}")
        report["idle_gaps"] = gaps[: max(a.gaps, 50)]
    if a.host:
        left -= steps
        host_steps = min(a.steps, left // 2)  # the plain pass, then the profiled one
        plain, waits, funcs = host_profile(llm, step, host_steps)
        print(
            f"without the profiler: {plain:.3f} ms per step; under cProfile the host waits on the "
            f"device {waits:.3f} ms per step; the {a.host} DeepInfer functions with the most host time:"
        )
        for func, ms in funcs[: a.host]:
            print(f"  {ms:8.3f} ms  {func}")
        report["host"] = {
            "wall_ms_per_step": plain,
            "wait_ms_per_step": waits,
            "ms_by_function": dict(funcs[: a.host]),
        }
    llm.shutdown()
    if a.sites:
        eager, eager_step, left = workload(a, eager=True)
        sites = operator_sites(eager_step, min(a.steps, left))
        eager.shutdown()
        total = sum(n for _, n in sites)
        print(f"operators per step without graphs: {total:.0f}; the {a.sites} busiest source lines:")
        for site, n in sites[: a.sites]:
            print(f"  {n:6.1f}  {site}")
        report["operators_per_step_eager"] = total
        report["operators_by_site"] = dict(sites)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")
    return report


if __name__ == "__main__":
    run_main(main)
