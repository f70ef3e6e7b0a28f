"""GPU benchmark: DeepSeek's TileKernels against our own implementation, per op and token count.

Run on a CUDA machine with TileKernels installed (written for an H200)::

    python plugins/cuda_sm100/scripts/bench_tilekernels.py                  # every op, 1..8192 tokens
    python plugins/cuda_sm100/scripts/bench_tilekernels.py --ops hc_pre,hc_post --tokens 1,64
    python plugins/cuda_sm100/scripts/bench_tilekernels.py --write-choices  # and update the table

For each op that :mod:`deepinfer_cuda_sm100.tk` adapts, at DeepSeek-V4-Flash shapes
(:mod:`deepinfer_cuda_sm100.tk.cases`: hidden 4096, 4 mHC streams, 64 heads of 512 with a rope
of 64, 256 routed experts top-6 with ``sqrtsoftplus`` and hash routing, V4.1's KV numerics in
blocks of 32 and its Engram), it times our own implementation (the Triton kernel; the core's
reference for V4.1's ops, which have no kernel of ours) and the TileKernels adapter, and checks
the adapter against the reference op: within the op's conformance tolerances (integer outputs
exactly), bit for bit where the adapter promises bits (the UE8M0 ``kv_qdq``), and a row's output
alone bitwise equal to the same row in the batch.

Timing: each call captured in a CUDA graph (``--no-graphs``: plain launches) with an L2 flush
before every call (its own time subtracted), CUDA events, after warm-up (the ``Timer`` of
``bench_attention.py``).  Prints a table and writes JSON (default
``benchmarks/results/bench_tilekernels.json``); ``--write-choices`` writes the measured points into
this GPU's table (``deepinfer_cuda_sm100/choices_smXY.json``; the other ops' points stay).  A point
where the adapter failed its checks records our own time only, so the choice stays ours there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "cuda_sm100"), str(Path(__file__).resolve().parent)]

from bench_attention import Timer  # noqa: E402
from choice_writers import GRAPH_FLUSHED, merge  # noqa: E402
from graph_timing import gpu_run_header  # noqa: E402

from deepinfer_core.benchmarking.harness import run_main  # noqa: E402

DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "bench_tilekernels.json"
TOKENS = "1,4,16,64,256,1024,4096,8192"
BITWISE = frozenset({"deepseek_v41.kv_qdq"})
"""Ops whose adapter promises the reference's bits (its module docstring says why)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--ops", help="comma-separated ops (default: every adapted op)")
    p.add_argument("--tokens", default=TOKENS, help=f"token counts (comma-separated; default {TOKENS})")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before capturing")
    p.add_argument("--no-graphs", action="store_true", help="time plain launches instead of graph replays")
    p.add_argument("--no-flush", action="store_true", help="keep the L2 warm between calls")
    p.add_argument(
        "--write-choices",
        action="store_true",
        help="write the measured points into this GPU's kernel-language table\n"
        "(deepinfer_cuda_sm100/choices_smXY.json; other ops' points are kept)",
    )
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON file to write")
    return p.parse_args(argv)


def own_implementations() -> dict:
    """Op -> our own callable: the backend's Triton kernel, else the core's reference."""
    from deepinfer_cuda_sm100.ops import load_ops
    from deepinfer_cuda_sm100.tk_dispatch import OWN_LANGUAGE

    from deepinfer_core.models.deepseek_v41 import ops as _v41  # noqa: F401  (defines V4.1's ops)
    from deepinfer_core.ops.registry import get_op

    triton = load_ops()
    return {
        op: (triton[op].fn if lang == "triton" else get_op(op).reference) for op, lang in OWN_LANGUAGE.items()
    }


def _row(args: tuple, op: str, row: int) -> tuple:
    from deepinfer_cuda_sm100.tk.cases import ROW_ARGS

    return tuple(
        a[row : row + 1].clone() if i in ROW_ARGS[op] and a is not None else a for i, a in enumerate(args)
    )


def _outputs(out) -> tuple:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def check(op: str, adapter, args: tuple) -> dict:
    """The adapter against the reference op: tolerance, bits, and a row alone against the batch."""
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES, get_op
    from deepinfer_core.testing.compare import compare

    spec = get_op(op)
    got, want = adapter.run(*args), spec.reference(*args)
    dtype = next(
        (a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), torch.float32
    )
    atol, rtol = spec.tolerances.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    problems: list[str] = []
    max_err = compare(got, want, atol, rtol, "output", problems)
    bitwise = all(torch.equal(a, b) for a, b in zip(_outputs(got), _outputs(want), strict=True))
    last = args[0].shape[0] - 1
    alone = _outputs(adapter.run(*_row(args, op, last)))
    rows_equal = all(torch.equal(a[last : last + 1], b) for a, b in zip(_outputs(got), alone, strict=True))
    passed = not problems and (bitwise or op not in BITWISE)
    return {
        "passed": passed,
        "max_abs_err": max_err,
        "problems": problems[:3],
        "bitwise_vs_reference": bitwise,
        "row_alone_bitwise": rows_equal,
    }


def bench(a: argparse.Namespace, timer: Timer) -> list[dict]:
    from deepinfer_cuda_sm100 import tk
    from deepinfer_cuda_sm100.tk.cases import VARIANTS, v4_flash_args
    from deepinfer_cuda_sm100.tk_dispatch import OWN_LANGUAGE

    adapters, own = tk.adapters(), own_implementations()
    ops = a.ops.split(",") if a.ops else list(VARIANTS)
    rows = []
    for op in ops:
        adapter = adapters[op]
        for variant in VARIANTS[op]:
            for t in map(int, a.tokens.split(",")):
                args = v4_flash_args(op, variant, t, torch.Generator().manual_seed(t))
                row = {"op": op, "variant": variant, "tokens": t, "own": OWN_LANGUAGE[op]}
                verdict = adapter.supports(*args)
                if verdict is not True:
                    row["refused"] = verdict
                    rows.append(row)
                    print_row(row)
                    continue
                row["key"] = adapter.key(*args)._asdict()
                row["ms"] = timer.ms(lambda fn=own[op], args=args: fn(*args))
                try:
                    row.update(check(op, adapter, args))
                    row["tilekernels_ms"] = timer.ms(lambda fn=adapter.run, args=args: fn(*args))
                except Exception as exc:  # a kernel that fails to build or run at this shape
                    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                    row["error"] = f"{type(exc).__name__}: {first}"
                rows.append(row)
                print_row(row)
    return rows


def print_row(r: dict) -> None:
    head = f"{r['op']:<26} {r['variant']:<10} T={r['tokens']:<5}"
    if "refused" in r:
        print(f"{head} refused: {r['refused']}")
    elif "error" in r:
        print(f"{head} {r['own']} {r['ms']:.4f} ms  tilekernels ERROR {r['error']}")
    else:
        tk_ms, ms = r["tilekernels_ms"], r["ms"]
        flags = (
            f"{'ok' if r['passed'] else 'FAILED'} err={r['max_abs_err'] or 0:.2g} "
            f"bits={r['bitwise_vs_reference']} row-alone={r['row_alone_bitwise']}"
        )
        print(f"{head} {r['own']} {ms:.4f} ms  tilekernels {tk_ms:.4f} ms  x{ms / tk_ms:.2f}  {flags}")


def write_choices(rows: list[dict]) -> Path:
    """The measured points (:mod:`deepinfer_cuda_sm100.kernel_choice`) written into this GPU's table."""
    points = []
    for r in rows:
        if "key" not in r or "ms" not in r:
            continue
        ms = {r["own"]: round(r["ms"], 5)}
        if r.get("passed") and "tilekernels_ms" in r:
            ms["tilekernels"] = round(r["tilekernels_ms"], 5)
        points.append({"op": r["op"], **r["key"], "ms": ms})
    command = "python plugins/cuda_sm100/scripts/bench_tilekernels.py --write-choices"
    return merge(points, command, GRAPH_FLUSHED, ("triton", "tilelang", "tile_kernels"))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tilekernels: no CUDA GPU is visible; run this on a GPU machine", file=sys.stderr)
        return 2
    from deepinfer_cuda_sm100 import tk

    problem = tk.tilekernels_problem()
    if problem is not None:
        print(f"bench_tilekernels: {problem}", file=sys.stderr)
        return 2
    timer = Timer(a.iters, a.warmup, graphs=not a.no_graphs, flush=not a.no_flush)
    results: dict = {
        **gpu_run_header("cuda_sm100 TileKernels adapters vs our own implementation", local_time=True),
        "graphs": not a.no_graphs,
        "l2_flush": not a.no_flush,
        "rows": bench(a, timer),
    }
    if a.write_choices:
        print(f"wrote {write_choices(results['rows'])}")
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    run_main(main)
