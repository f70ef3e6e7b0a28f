"""``deepinfer bench``: offline throughput and latency of one ``LLM.generate`` call
(docs/configuration.md); latencies from each output's ``RequestMetrics``, counts from
:meth:`~deepinfer_core.LLM.get_metrics`."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer_core.errors import ConfigError
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.user_files import read_text_file

PERCENTILES = (50, 90, 99)
METRICS = ("num_prefix_hit_tokens", "num_replayed_tokens", "num_preemptions", "num_steps", "peak_cache_usage",
           "kv_cache_capacity_tokens")  # fmt: skip


@dataclass
class BenchArgs:
    """What to run: the flags of ``deepinfer bench`` (``num_prompts=None``: 16 synthetic, or
    every prompt of the file); ``engine``: :class:`~deepinfer_core.LLM` keyword arguments."""

    num_prompts: int | None = None
    input_len: int = 32
    output_len: int = 16
    prompts_file: str | None = None
    shared_prefix_len: int = 0
    seed: int = 0
    temperature: float = 1.0
    engine: dict[str, Any] = field(default_factory=dict)


def synthetic_prompts(
    num_prompts: int, input_len: int, shared_prefix_len: int, token_ids: Sequence[int], seed: int
) -> list[list[int]]:
    """``num_prompts`` random prompts of ``input_len`` ids drawn from ``token_ids``; the first
    ``shared_prefix_len`` ids are the same in every prompt."""
    if input_len < 1:
        raise ConfigError(f"--input-len={input_len}: must be >= 1")
    if not 0 <= shared_prefix_len <= input_len:
        raise ConfigError(f"--shared-prefix-len={shared_prefix_len}: must be in [0, --input-len={input_len}]")
    rng = random.Random(seed)
    prefix = [rng.choice(token_ids) for _ in range(shared_prefix_len)]
    rest = input_len - shared_prefix_len
    return [prefix + [rng.choice(token_ids) for _ in range(rest)] for _ in range(num_prompts)]


def read_prompts_file(path: str | Path) -> list[str]:
    """Prompts of a file: ``.jsonl`` lines ``{"prompt": ...}``, else one prompt per non-empty line."""
    p = Path(path)
    lines = [line for line in read_text_file("--prompts-file", path).splitlines() if line.strip()]
    if p.suffix != ".jsonl":
        return lines
    prompts = []
    for i, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--prompts-file {path}, line {i}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ConfigError(f'--prompts-file {path}, line {i}: expected an object with a string "prompt"')
        prompts.append(record["prompt"])
    return prompts


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """Mean and p50/p90/p99 (linear interpolation between order statistics) of ``values``."""
    xs = list(values) or [0.0]
    cuts = statistics.quantiles(xs * 2 if len(xs) == 1 else xs, n=100, method="inclusive")
    return {"mean": statistics.fmean(xs), **{f"p{q}": cuts[q - 1] for q in PERCENTILES}}


def run_bench(args: BenchArgs) -> dict[str, Any]:
    """Build the engine, run every prompt through one ``generate`` call; returns the results."""
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    if args.output_len < 1:
        raise ConfigError(f"--output-len={args.output_len}: must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ConfigError(f"--num-prompts={args.num_prompts}: must be >= 1")
    llm = LLM(seed=args.seed, **args.engine)
    prompts: list[Any]
    if args.prompts_file is not None:
        if not (texts := read_prompts_file(args.prompts_file)):
            raise ConfigError(f"--prompts-file {args.prompts_file}: holds no prompt")
        prompts = [texts[i % len(texts)] for i in range(args.num_prompts or len(texts))]
    else:
        tok = llm.get_tokenizer()
        special = tok.special_token_ids if tok is not None else set()
        ids = [t for t in range(llm.engine.model_config.vocab_size) if t not in special]
        synthetic = synthetic_prompts(
            args.num_prompts or 16, args.input_len, args.shared_prefix_len, ids, args.seed
        )
        prompts = [{"prompt_token_ids": p} for p in synthetic]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    llm.reset_metrics()  # every rank's, in a distributed run
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - t0
    return summarize(outputs, duration, llm, args)


ENGINE_FIELDS = ("model", "device", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "page_size", "enable_prefix_caching", "async_scheduling", "batch_invariant", "strict_ops",
                 "keep_quantized")  # fmt: skip


def summarize(outputs: list[RequestOutput], duration_s: float, llm: Any, args: BenchArgs) -> dict[str, Any]:
    """The benchmark's numbers from the outputs, wall time, the engine's metrics and settings (the
    resolved options, the backend and the software versions)."""
    import torch

    from deepinfer_core import __version__

    metrics, ok = llm.get_metrics(), [o for o in outputs if o.error is None]
    errors = [o.error for o in outputs if o.error is not None]
    duration_s = max(duration_s, 1e-9)  # a run whose every request was rejected takes ~0 s
    num_in = sum(len(o.prompt_token_ids) for o in ok)
    num_out = sum(len(c.token_ids) for o in ok for c in o.outputs)
    ttft = [o.metrics.ttft * 1e3 for o in ok if o.metrics is not None and o.metrics.ttft is not None]
    latency = [o.metrics.latency * 1e3 for o in ok if o.metrics is not None and o.metrics.latency is not None]
    kept = ("output_len", "prompts_file", "shared_prefix_len", "seed", "temperature")
    engine = {"backend": llm.engine.backend.name, **{k: getattr(llm.config, k) for k in ENGINE_FIELDS}}
    engine |= {"kv_cache_capacity_tokens": llm.kv_cache_capacity_tokens, "deepinfer_version": __version__}
    return {"num_requests": len(outputs), "num_failed_requests": len(outputs) - len(ok),
            "first_error": errors[0] if errors else None, "num_input_tokens": num_in,
            "num_output_tokens": num_out, "duration_s": duration_s,
            "request_throughput": len(ok) / duration_s, "output_throughput": num_out / duration_s,
            "total_token_throughput": (num_in + num_out) / duration_s, "ttft_ms": percentiles(ttft),
            "latency_ms": percentiles(latency), **{k: metrics[k] for k in METRICS},
            "args": {"num_prompts": len(outputs), "input_len": None if args.prompts_file else args.input_len,
                     **{k: getattr(args, k) for k in kept}, **args.engine},
            "engine": engine | {"torch_version": torch.__version__}}  # fmt: skip


def format_table(result: dict[str, Any]) -> str:
    """The results as an aligned two-column table."""
    r = result
    rows: list[tuple[str, Any]] = [
        ("Requests (failed)", f"{r['num_requests']} ({r['num_failed_requests']})"),
        ("Input tokens", r["num_input_tokens"]), ("Output tokens", r["num_output_tokens"]),
        ("Duration (s)", f"{r['duration_s']:.3f}"),
        ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
        ("Output throughput (tok/s)", f"{r['output_throughput']:.2f}"),
        ("Total throughput (tok/s)", f"{r['total_token_throughput']:.2f}"),
    ]  # fmt: skip
    for key, name in (("ttft_ms", "TTFT (ms)"), ("latency_ms", "Latency (ms)")):
        rows += [(f"{name} {q}", f"{r[key][q]:.2f}") for q in ("mean", *(f"p{q}" for q in PERCENTILES))]
    rows += [("Prefix-hit tokens", r["num_prefix_hit_tokens"]), ("Replayed tokens", r["num_replayed_tokens"]),
             ("Preemptions", r["num_preemptions"]), ("Peak cache usage", f"{r['peak_cache_usage']:.1%}"),
             ("KV cache capacity (tokens)", r["kv_cache_capacity_tokens"])]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
