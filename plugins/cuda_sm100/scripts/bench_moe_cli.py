"""The command line of ``bench_moe.py`` (its arguments and their checks)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
TOKENS = "1,2,4,8,16,64,128,256"
GEMV_TOKENS = 8


def parse_args(description: str) -> argparse.Namespace:
    """``bench_moe.py``'s arguments, checked (a GPU, one sweep a run, no table from a sweep), with
    the default JSON output filled in."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tokens", default=TOKENS, help=f"token counts T (default {TOKENS})")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--calls-per-graph", type=int, default=8)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument(
        "--write-choices", action="store_true", help="write the times into the backend's choice table"
    )
    parser.add_argument(
        "--scales",
        choices=("ue8m0", "fp32"),
        default="ue8m0",
        help="the FP4 scales' storage (ue8m0: the release's; fp32: a checkpoint written with float scales)",
    )
    parser.add_argument("--stages", default="", help="TileLang ring depths to sweep (e.g. 3,4,5)")
    parser.add_argument("--heights", default="", help="TileLang tile heights to sweep (e.g. 16,32,64)")
    parser.add_argument(
        "--gathered",
        action="store_true",
        help="also time the TileLang variants with and without the activations gathered into the sorted "
        "rows first",
    )
    parser.add_argument(
        "--halves",
        action="store_true",
        help="also time the TileLang variants with each K step decoded and multiplied in two K halves "
        "(half the live A registers; checked bit for bit)",
    )
    parser.add_argument(
        "--ctas-per-sm",
        default="",
        help="HEIGHT=CTAS items (e.g. 16=3) at which to time the one-warpgroup TileLang kernels with the "
        "register split of CTAS CTAs an SM (tl.moe.split_for), checked bit for bit",
    )
    parser.add_argument(
        "--compiler-registers",
        default="",
        help="tile heights (e.g. 16,32) at which to time the one-warpgroup TileLang kernels with "
        "the compiler's register allotment instead of tl.moe.SPLIT_REGS, checked bit for bit",
    )
    parser.add_argument(
        "--gemv-tokens",
        type=int,
        default=GEMV_TOKENS,
        help=f"time the decode-width GEMVs at token counts up to this (default {GEMV_TOKENS}; 0: never; "
        "at most the kernel's MAX_TOKENS)",
    )
    parser.add_argument(
        "--gemv-sweep",
        action="store_true",
        help="time only the decode-width GEMVs' kernels over a grid of launches (see the docstring)",
    )
    parser.add_argument(
        "--tile-sweep",
        action="store_true",
        help="time only the tiled Triton kernels on bf16 experts over a grid of launch sizes (docstring)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default: benchmarks/results/bench_moe.json, bench_moe_gemv_sweep.json or "
        "bench_moe_tile_sweep.json)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if (args.gemv_sweep or args.tile_sweep) and args.write_choices:
        raise SystemExit(
            "--gemv-sweep and --tile-sweep time no table to write: run without them for --write-choices"
        )
    if args.gemv_sweep and args.tile_sweep:
        raise SystemExit("--gemv-sweep and --tile-sweep: one sweep a run")
    if args.out is None:
        sweep = "_gemv_sweep" if args.gemv_sweep else "_tile_sweep" if args.tile_sweep else ""
        name = f"bench_moe{sweep}.json"
        args.out = REPO / "benchmarks" / "results" / name
    return args
