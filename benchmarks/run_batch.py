"""``run_batch`` on the built-in tiny model (CPU): peak RSS and throughput by input size.

For each ``--sizes`` entry, writes an OpenAI Batch input file of that many short completions
requests (a 4-token prompt, ``max_tokens`` tokens, greedy, EOS ignored) and runs
:func:`deepinfer_core.batch.run_batch` on it in a fresh interpreter, which reports its own peak
resident set size (``getrusage``'s ``ru_maxrss``), so every size is measured alone.  Memory that
does not grow with the input is the claim: the input is streamed, at most ``--max-in-flight``
requests are outstanding, and per line only an 8-byte hash of its ``custom_id`` is kept.

Prints a table and writes JSON (``benchmarks/results/run_batch.json``).  Usage::

    python benchmarks/run_batch.py --sizes 1000,100000 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepinfer_core.benchmarking.harness import log, positive_ints, print_table, write_json  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "run_batch.json"


def write_input(path: Path, size: int, max_tokens: int) -> None:
    """``size`` completions requests, prompts of 4 token ids varying with the line."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(size):
            body = {
                "prompt": [4 + i % 97, 4 + i % 89, 4 + i % 83, 4 + i % 79],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            f.write(
                json.dumps(
                    {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}
                )
            )
            f.write("\n")


def child(args: argparse.Namespace) -> None:
    """One measured run (in its own interpreter): prints a JSON line with the figures."""
    import torch

    from deepinfer_core.batch import run_batch

    torch.set_num_threads(args.threads)
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    summary = run_batch(
        args.input,
        args.output,
        backend="reference",
        max_in_flight=args.max_in_flight,
        progress=False,
    )
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(
        json.dumps(
            {
                "lines": summary.lines,
                "completed": summary.completed,
                "failed": summary.failed,
                "engine_requests": summary.engine_requests,
                "generated_tokens": summary.generated_tokens,
                "run_seconds": round(summary.seconds, 2),
                "wall_seconds_with_start": round(wall, 2),
                "lines_per_s": round(summary.lines / summary.seconds, 1),
                "output_tok_per_s": round(summary.generated_tokens / summary.seconds, 1),
                "peak_rss_mib": round(peak / 1024, 1),
                "rss_before_engine_mib": round(rss_start / 1024, 1),
                "output_bytes": os.path.getsize(args.output),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=positive_ints, default=[1000, 100_000], help="input lines per run")
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument(
        "--max-in-flight", type=int, default=None, help="default: run_batch's (4 x max_num_seqs)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--input", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            inp, out = Path(tmp) / f"in_{size}.jsonl", Path(tmp) / f"out_{size}.jsonl"
            write_input(inp, size, args.max_tokens)
            log(f"{size} lines ({inp.stat().st_size / 2**20:.1f} MiB input)")
            cmd = [sys.executable, __file__, "--child", "--input", str(inp), "--output", str(out)]
            cmd += ["--threads", str(args.threads)]
            if args.max_in_flight:
                cmd += ["--max-in-flight", str(args.max_in_flight)]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            row = {
                "size": size,
                "input_mib": round(inp.stat().st_size / 2**20, 2),
                **json.loads(done.stdout.splitlines()[-1]),
            }
            log(json.dumps(row))
            rows.append(row)
    columns = [("lines", "size", "d"), ("input MiB", "input_mib", ""), ("peak RSS MiB", "peak_rss_mib", "")]
    columns += [
        ("lines/s", "lines_per_s", ""),
        ("out tok/s", "output_tok_per_s", ""),
        ("run s", "run_seconds", ""),
    ]
    print_table(rows, columns)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
    }
    write_json(args.json, {"meta": meta, "max_tokens": args.max_tokens, "rows": rows}, quiet=True)


if __name__ == "__main__":
    main()
