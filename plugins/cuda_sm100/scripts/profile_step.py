"""Where a decode step's time goes: device kernels by kind, and the gaps between them.

Builds an engine on ``--model`` (default: the built-in tiny model), admits ``--batch``
requests of ``--prompt-len`` random ids (greedy, ``ignore_eos``), steps until every request
decodes, runs ``--warmup`` more steps, then profiles ``--steps`` steps with
``torch.profiler`` (CUDA graphs stay on: CUPTI records the kernels a graph replays).  Reports
per step:

* wall time (``LLMEngine.step`` calls, the device synchronised before and after);
* device busy time: the sum of the kernels' durations; ``idle = wall - busy`` is what the
  device waits for (launches, host work not hidden by async scheduling, syncs);
* busy time by kind of kernel (attention, indexer, MoE, FP8 GEMM, cuBLAS, mHC / norm / RoPE,
  PyTorch's own kernels: the ops still on the reference, ...), and the top kernels by name.

On a CPU the profiler sees operators, not kernels: the same table over the operators' own CPU
time (``self``), so the script runs anywhere.  Prints the tables and writes JSON (``--out``).

    python plugins/cuda_sm100/scripts/profile_step.py --model /tmp/m --backend cuda_sm100 --batch 1
    python plugins/cuda_sm100/scripts/profile_step.py --steps 2          # the tiny model, here
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.benchmarking.harness import run_main

KINDS: tuple[tuple[str, str], ...] = (
    ("attention", r"sparse_attention|attention|_attn|flash"),
    ("moe", r"moe|gate_up|_down_kernel|grouped|route|expert"),
    ("indexer", r"indexer|topk|radix|_select"),
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
    p.add_argument("--steps", type=int, default=10, help="profiled decode steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before profiling (default 3)")
    p.add_argument("--keep-quantized", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--top", type=int, default=15, help="kernels listed by name (default 15)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/profile_step.json"))
    return p.parse_args(argv)


def decoding_engine(a: argparse.Namespace) -> tuple[LLM, int]:
    """An engine whose ``--batch`` requests all decode (their prompts prefilled); the steps left."""
    keep = {"auto": None, "on": True, "off": False}[a.keep_quantized]
    budget = a.warmup + a.steps + 4
    llm = LLM(
        model=a.model,
        backend=a.backend,
        max_num_seqs=a.batch,
        max_model_len=a.prompt_len + budget + 8,
        keep_quantized=keep,
    )
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request(f"p{i}", [rng.randrange(4, vocab) for _ in range(a.prompt_len)], params)
    running = engine.scheduler.running
    for _ in range(a.batch * a.prompt_len + 16):  # prefill chunks, at most one token each
        if len(running) == a.batch and all(r.output_token_ids for r in running):
            break
        engine.step()
    for _ in range(a.warmup):
        engine.step()
    return llm, budget - a.warmup


def profile_steps(llm: LLM, steps: int) -> tuple[float, profile]:
    """Wall seconds per step over ``steps`` profiled steps, and the profile."""
    cuda = torch.cuda.is_available() and llm.config.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    return wall, prof


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
    llm, left = decoding_engine(a)
    steps = min(a.steps, left)
    wall, prof = profile_steps(llm, steps)
    device = llm.config.device.startswith("cuda") and torch.cuda.is_available()
    by_kind, by_name, calls = breakdown(prof, steps, device)
    busy = sum(by_kind.values())
    what = "device kernels" if device else "CPU operators (self time)"
    launches = sum(calls.values())
    print(f"{llm.engine.backend.name} on {llm.config.device}, batch {a.batch}: {wall * 1e3:.3f} ms per step")
    print(
        f"{what}: {busy / 1e3:.3f} ms per step"
        + (f", device idle {wall * 1e3 - busy / 1e3:.3f} ms" if device else "")
        + f"; {launches:.0f} {'launches' if device else 'operator calls'} per step"
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
        "steps": steps,
        "measured": what,
        "wall_ms_per_step": wall * 1e3,
        "busy_ms_per_step": busy / 1e3,
        "idle_ms_per_step": (wall * 1e3 - busy / 1e3) if device else None,
        "ms_by_kind": {k: v / 1e3 for k, v in by_kind.items()},
        "calls_per_step": launches,
        "ms_by_name": {k: v / 1e3 for k, v in by_name[: a.top]},
        "calls_by_name": {k: calls[k] for k, _ in by_name},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")
    llm.shutdown()
    return report


if __name__ == "__main__":
    run_main(main)
