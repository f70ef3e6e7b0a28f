"""``run_batch`` on the built-in tiny model (CPU): peak RSS and throughput by input size."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepinfer_core.benchmarking import harness as h  # noqa: E402


def child(inp: str, out: str, max_in_flight: int | None) -> None:
    """One measured run (in its own interpreter): prints a JSON line with the figures."""
    from deepinfer_core.batch import run_batch

    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    kw = {"backend": "reference", "max_in_flight": max_in_flight, "progress": False}
    s, wall = h.timed(lambda: run_batch(inp, out, **kw))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"lines": s.lines, "completed": s.completed, "failed": s.failed,
                      "engine_requests": s.engine_requests, "generated_tokens": s.generated_tokens,
                      "run_seconds": round(s.seconds, 2), "wall_seconds_with_start": round(wall, 2),
                      "lines_per_s": round(s.lines / s.seconds, 1),
                      "output_tok_per_s": round(s.generated_tokens / s.seconds, 1),
                      "peak_rss_mib": round(peak / 1024, 1),
                      "rss_before_engine_mib": round(rss_start / 1024, 1),
                      "output_bytes": os.path.getsize(out)}))  # fmt: skip


def main() -> None:
    ap = h.parser(__doc__, "run_batch", max_tokens=2)
    ap.add_argument("--sizes", type=h.positive_ints, default=[1000, 100_000], help="input lines per run")
    ap.add_argument("--max-in-flight", type=int, default=None, help="default: run_batch's (4 x max_num_seqs)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = h.parse(ap)
    if args.child:
        return child(*args.child, args.max_in_flight)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            inp, out = Path(tmp) / f"in_{size}.jsonl", Path(tmp) / f"out_{size}.jsonl"
            with open(inp, "w", encoding="utf-8") as f:
                for i in range(size):
                    body = {"prompt": [4 + i % 97, 4 + i % 89, 4 + i % 83, 4 + i % 79],
                            "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
                    f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                                        "body": body}) + "\n")  # fmt: skip
            mib = round(inp.stat().st_size / 2**20, 2)
            h.log(f"{size} lines ({mib} MiB input)")
            cmd = [sys.executable, __file__, "--child", str(inp), str(out), "--threads", str(args.threads)]
            cmd += ["--max-in-flight", str(args.max_in_flight)] if args.max_in_flight else []
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            rows.append({"size": size, "input_mib": mib, **json.loads(done.stdout.splitlines()[-1])})
            h.log(json.dumps(rows[-1]))
    h.print_table(rows, "size:d input_mib peak_rss_mib lines_per_s output_tok_per_s run_seconds")
    h.write_json(args.output, {"threads": args.threads, "max_tokens": args.max_tokens, "rows": rows})


if __name__ == "__main__":
    h.run_main(main)
