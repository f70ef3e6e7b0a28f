"""Time the TileLang FP8 GEMM at every K split count, per weight shape and token tile, on a GPU.

For each ``K x N`` weight (default: DeepSeek-V4-Flash's, as ``bench_fp8_gemm.py``) and each
grouped ``G x K x N`` projection, at each token tile ``BLOCK_M`` of
:data:`~deepinfer_cuda_sm100.tl.fp8_gemm.BLOCK_MS` up to ``--max-m`` (the call's ``M`` equal to
the tile: its widest call), times the GEMM with its split sums at each candidate count
(:func:`~deepinfer_cuda_sm100.tl.fp8_gemm.split_candidates`; CUDA events over a replayed CUDA
graph of ``--calls-per-graph`` calls) and prints them next to the plan rule's count, with each
count's largest difference from the reference op (every count is the contract's arithmetic in
another fp32 accumulation order).  ``--write-choices`` writes the times into this GPU's measured
table (op ``linear_fp8_splits``, :mod:`deepinfer_cuda_sm100.gemm_splits`), from which calls and
precompile take their count.

Compile the counts first (otherwise each is compiled here, one after another)::

    python -m deepinfer_cuda_sm100.tl.precompile --all-splits --jobs 16
    python plugins/cuda_sm100/scripts/bench_gemm_splits.py [--shapes 1024x8192] [--grouped ''] \\
        [--max-m 64] [--write-choices]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import choice_writers
import torch
from deepinfer_cuda_sm100.gemm_dispatch import V4_FLASH_GROUPED, V4_FLASH_SHAPES
from graph_timing import gpu_run_header, time_graph

from deepinfer_core.benchmarking.harness import run_main, write_json

REPO = Path(__file__).resolve().parents[3]
TIMING = "mean of the calls replayed in CUDA graphs (bf16 activations)"


def time_counts(groups: int, k: int, n: int, block_m: int, calls: int, replays: int) -> dict:
    """One row: the rule's count and each candidate count's time (us) and largest difference
    from the reference op, at ``M = block_m``."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import sm_count
    from deepinfer_cuda_sm100.tl import fp8_gemm as tlg

    from deepinfer_core.ops.linear import grouped_linear, linear
    from deepinfer_core.weights.quant import QuantizedTensor, quant_fp8

    data, scale = quant_fp8(torch.randn(groups * n, k, device="cuda") * k**-0.5, (128, 128), "ue8m0")
    w = QuantizedTensor(data, scale, "fp8", (128, 128))
    if groups == 1:
        x = torch.randn(block_m, k, device="cuda").to(torch.bfloat16)
        want = linear(x, w).float()

        def call(s: int) -> torch.Tensor:
            return tlg.linear_fp8(x, w, splits=s)
    else:
        x = torch.randn(block_m, groups, k, device="cuda").to(torch.bfloat16)
        want = grouped_linear(x, w).float()

        def call(s: int) -> torch.Tensor:
            return tlg.grouped_linear_fp8(x, w, splits=s)

    rule = tlg.launch_plan(block_m, groups * n, k, sm_count(x.device)).splits
    row = {
        "G": groups,
        "K": k,
        "N": groups * n,
        "block_m": block_m,
        "rule": rule,
        "us": {},
        "max_abs_err": {},
    }
    for s in tlg.split_candidates(k):
        row["us"][s] = time_graph(lambda i, s=s: call(s), calls, replays)
        row["max_abs_err"][s] = float((call(s).float() - want).abs().max())
    return row


def print_row(row: dict) -> None:
    timed = {s: t for s, t in row["us"].items() if t}
    best = min(timed, key=timed.get) if timed else None
    cells = "  ".join(
        f"{s}:{t:7.1f}{'*' if s == best else ' '}" if t else f"{s}:      -" for s, t in row["us"].items()
    )
    name = f"{row['G']}x{row['K']}x{row['N'] // row['G']}" if row["G"] > 1 else f"{row['K']}x{row['N']}"
    rule_us = row["us"].get(row["rule"])
    gain = f"  rule/best {rule_us / timed[best]:.2f}" if rule_us and best else ""
    print(f"{name:>14} BLOCK_M={row['block_m']:>3} rule {row['rule']:>2}  {cells}{gain}")


def table_points(rows: list[dict]) -> list[dict]:
    """The rows' times as ``linear_fp8_splits`` points of the measured table
    (:mod:`deepinfer_cuda_sm100.gemm_splits`: the weight's ``N x K``, the token tile, the groups)."""
    from deepinfer_cuda_sm100.gemm_splits import DTYPE, SPLITS_OP, kind

    return [
        {"op": SPLITS_OP, "kind": kind(r["G"]), "dtype": DTYPE, "heads": r["N"], "head_dim": r["K"],
         "tokens": r["block_m"], "keys": r["G"], "ms": {str(s): t / 1e3 for s, t in r["us"].items() if t}}
        for r in rows
        if any(r["us"].values())
    ]  # fmt: skip


def write_choices(rows: list[dict]) -> Path:
    """Merge :func:`table_points` into this GPU's table."""
    command = "python plugins/cuda_sm100/scripts/bench_gemm_splits.py --write-choices"
    return choice_writers.merge(table_points(rows), command, TIMING, ("triton", "tilelang"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=V4_FLASH_SHAPES, help="KxN weights ('' for none)")
    parser.add_argument("--grouped", default=V4_FLASH_GROUPED, help="GxKxN grouped projections ('' for none)")
    parser.add_argument("--max-m", type=int, default=256, help="the widest token tile timed (default 256)")
    parser.add_argument("--calls-per-graph", type=int, default=20)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_gemm_splits.json"
    )
    parser.add_argument("--write-choices", action="store_true", help="write the times into this GPU's table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from deepinfer_cuda_sm100.tl import tilelang_problem
    from deepinfer_cuda_sm100.tl.fp8_gemm import BLOCK_MS
    from deepinfer_cuda_sm100.tl.precompile import weight_shapes

    problem = tilelang_problem()
    if problem:
        raise SystemExit(f"the TileLang GEMM cannot run here: {problem}")
    rows = []
    for groups, k, n in weight_shapes(args.shapes, args.grouped):
        for block_m in (bm for bm in BLOCK_MS if bm <= args.max_m):
            rows.append(time_counts(groups, k, n, block_m, args.calls_per_graph, args.replays))
            print_row(rows[-1])
    write_json(args.out, {**gpu_run_header("bench_gemm_splits"), "rows": rows}, torch.device("cuda"))
    if args.write_choices:
        print(f"wrote {write_choices(rows)}")


if __name__ == "__main__":
    run_main(main)
