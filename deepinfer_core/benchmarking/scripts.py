"""``deepinfer bench NAME [ARGS...]``: the benchmark scripts of ``benchmarks/`` by name.

The scripts ship with the source tree (``benchmarks/`` beside ``deepinfer_core/``), so an
editable install or a checkout reaches them; a wheel without them gets one line saying so.
``deepinfer bench`` with no name (or ``deepinfer bench throughput``) is the offline
throughput / latency command of :mod:`deepinfer_core.bench`.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from deepinfer_core.errors import ConfigError

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

SCRIPTS: dict[str, tuple[str, str]] = {
    "cpu-tiny": ("cpu_tiny.py", "CPU throughput vs HF transformers on the tiny model"),
    "cpu-engine-features": ("cpu_engine_features.py", "prefix caching and async scheduling on/off, CPU"),
    "cpu-v41": ("cpu_v41.py", "the tiny V4.1 on CPU: throughput, prefix cache, decoder tail"),
    "run-batch": ("run_batch.py", "run-batch peak RSS and lines/s by input size"),
    "serve": ("serve.py", "deepinfer serve (HTTP, streaming) vs LLM.generate: tok/s, TTFT, ITL"),
    "structured-outputs": ("structured_outputs.py", "structured vs unconstrained throughput, grammar TTFT"),
    "speculative": ("speculative.py", "speculative decoding: DSpark vs fixed vs none"),
    "gpu-e2e": ("gpu_e2e.py", "V4-Flash-width model: decode / prefill tok/s vs HF and the roofline (GPU)"),
    "e2e-fidelity": ("e2e_fidelity.py", "the e2e model on a fast backend vs the fp32 reference (GPU)"),
    "gpu-distributed": ("gpu_distributed.py", "DP N + EP N decode and CP N prefill vs one GPU (GPUs)"),
    "distributed-cost-model": ("distributed_cost_model.py", "the DP/EP/CP cost model of V4-Flash"),
    "npu-decode": ("npu_decode.py", "ascend950 decode / prefill tok/s per chip vs CANN's anchor (NPU)"),
}
"""``deepinfer bench`` name -> (script in ``benchmarks/``, what it measures)."""


def names_help() -> str:
    """The benchmark names and what each measures (``deepinfer bench --help``)."""
    width = max(map(len, SCRIPTS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SCRIPTS.items()]
    return "benchmarks (deepinfer bench NAME --help for each one's flags):\n" + "\n".join(lines)


def run_script(name: str, argv: Sequence[str]) -> int:
    """Run the benchmark ``name`` with ``argv`` as its command line; its exit status."""
    script = BENCHMARKS_DIR / SCRIPTS[name][0]
    if not script.is_file():
        raise ConfigError(
            f"deepinfer bench {name}: {script} not found; the benchmark scripts come with the source "
            "tree (install DeepInfer from a checkout: pip install -e .)"
        )
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
