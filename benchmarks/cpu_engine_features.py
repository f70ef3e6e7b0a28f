"""Engine features on CPU with the built-in tiny model: prefix caching and async scheduling.

Two workloads, each run with the feature on and off (same prompts, greedy, EOS ignored):

- ``shared-prefix``: ``--num-prompts`` prompts that share a ``--prefix-len``-token prefix,
  each followed by ``--suffix-len`` unique tokens.  Requests are submitted in two waves (the
  first prompt alone, then the rest) so that the rest can hit the first one's pages.  With
  prefix caching the shared pages are reused and only the SWA replay tail is recomputed.
- ``async``: ``--num-prompts`` independent prompts, ``--max-tokens`` decode steps each, with
  async scheduling on and off.

Prints a table and writes JSON (``benchmarks/results/cpu_engine_features.json``).  Usage::

    python benchmarks/cpu_engine_features.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir

RESULTS = Path(__file__).parent / "results" / "cpu_engine_features.json"


def _random_tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(4, 500, (n,), generator=g).tolist()


def _timed_generate(llm: LLM, waves: list[list[list[int]]], params: SamplingParams) -> dict:
    metrics_before = llm.get_metrics()
    start = time.perf_counter()
    outputs = []
    for wave in waves:
        outputs += llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.get_metrics()
    new_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for wave in waves for p in wave)

    def delta(key: str) -> int:
        return int(after.get(key, 0) - metrics_before.get(key, 0))

    return {
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "total_tok_s": (prompt_tokens + new_tokens) / seconds,
        "output_tok_s": new_tokens / seconds,
        "prefix_hit_tokens": delta("num_prefix_hit_tokens"),
        "replayed_tokens": delta("num_replayed_tokens"),
        "computed_prompt_tokens": prompt_tokens
        - delta("num_prefix_hit_tokens")
        + delta("num_replayed_tokens"),
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
    }


def _llm(model_dir: Path, **kw) -> LLM:
    return LLM(model=str(model_dir), backend="reference", dtype="float32", max_num_seqs=64, **kw)


def run(args: argparse.Namespace) -> list[dict]:
    """Run both workloads with the feature on and off; returns one row per run."""
    model_dir = Path(args.model) if args.model else builtin_tiny_model_dir()
    g = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []

    prefix = _random_tokens(g, args.prefix_len)
    shared = [prefix + _random_tokens(g, args.suffix_len) for _ in range(args.num_prompts)]
    waves = [shared[:1], shared[1:]]
    for enabled in (False, True):
        llm = _llm(model_dir, enable_prefix_caching=enabled)
        _timed_generate(llm, [[_random_tokens(g, 8)]], SamplingParams(max_tokens=2))  # warm-up
        rows.append(
            {
                "workload": "shared-prefix",
                "feature": "prefix_caching",
                "enabled": enabled,
                **_timed_generate(llm, waves, params),
            }
        )

    independent = [_random_tokens(g, args.suffix_len + 16) for _ in range(args.num_prompts)]
    for enabled in (False, True):
        llm = _llm(model_dir, async_scheduling=enabled, enable_prefix_caching=False)
        _timed_generate(llm, [[_random_tokens(g, 8)]], SamplingParams(max_tokens=2))
        rows.append(
            {
                "workload": "async",
                "feature": "async_scheduling",
                "enabled": enabled,
                **_timed_generate(llm, [independent], params),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    """One line per run, and whether the feature changed the generated tokens."""
    head = (
        f"{'workload':14s} {'feature':17s} {'on':>3s} {'s':>6s} {'tok/s':>8s} {'out tok/s':>9s} "
        f"{'prompt tok':>10s} {'computed':>8s} {'hit':>6s} {'replayed':>8s}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['workload']:14s} {r['feature']:17s} {'on' if r['enabled'] else 'off':>3s} "
            f"{r['seconds']:6.2f} {r['total_tok_s']:8.0f} {r['output_tok_s']:9.0f} {r['prompt_tokens']:10d} "
            f"{r['computed_prompt_tokens']:8d} {r['prefix_hit_tokens']:6d} {r['replayed_tokens']:8d}"
        )
    for workload in ("shared-prefix", "async"):
        off, on = (r for r in rows if r["workload"] == workload)
        same = off["tokens"] == on["tokens"]
        print(
            f"{workload}: feature on is {off['seconds'] / on['seconds']:.2f}x the speed of off; "
            f"generated tokens identical: {same}"
        )


def main(argv: list[str] | None = None) -> int:
    """CLI entry: parse flags, run, print, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args)
    print_table(rows)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "args": vars(args),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": torch.get_num_threads(),
        "results": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
