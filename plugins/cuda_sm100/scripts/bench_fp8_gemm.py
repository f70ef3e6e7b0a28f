"""Time the ``cuda_sm100`` FP8 block-scaled GEMM (``linear`` with a 128x128 FP8 weight) on a GPU.

For each ``(K, N)`` of DeepSeek-V4-Flash's dense projections and each token count ``M``, times
(CUDA events, replaying a CUDA graph of ``--calls-per-graph`` back-to-back calls, so launch
overhead is excluded):

* ``triton w8a16``: the registered kernel (bf16 x, FP8 weight tiles scaled in registers);
* ``triton w8a8``: the opt-in variant (x quantised per token per 128 channels in the kernel);
* ``scaled_mm``: torch's block-scaled FP8 GEMM (``torch.nn.functional.scaled_mm`` where this torch
  has it, else ``torch._scaled_mm``; 1x128 activation scales, 128x128 weight scales: Hopper
  only) on pre-quantised FP8 activations (the GEMM alone; ``None`` where no configuration
  runs, with every error printed in full);
* ``tilelang``: the TileLang GEMM (``M <= 256``, :mod:`deepinfer_cuda_sm100.tl.fp8_gemm`) at
  the K split count the dispatcher passes (the measured table's, ``bench_gemm_splits.py``, else
  the plan's rule); ``None`` where TileLang cannot compile here or the kernel refuses the call;
* ``tilelang wide`` (``M <= 64``): the same GEMM with the wide tile kind (128 weight rows, two
  consumer warpgroups sharing each activation tile) where the shipped plan takes narrow tiles;
  a probe, not a table path (its bits against ``tilelang``'s are in the JSON);
* ``bf16 matmul``: cuBLAS on the dequantised bf16 weight;
* ``dequant+cublas``: the backend's other W8A16 path, the weight dequantised by a kernel then
  cuBLAS (:mod:`deepinfer_cuda_sm100.gemm_dispatch`);
* ``w8a8 prefill`` (M > 64): the registered kernel in its W8A8 prefill math, and
  ``scaled_mm+quant``: the backend's cuBLAS W8A8 path (:mod:`deepinfer_cuda_sm100.scaled_mm`,
  the activation quantisation included);

``--grouped`` (default V4-Flash's ``o_a``, 8 groups of 4096 -> 1024): the grouped output
projection's two paths, Triton's one launch for every group and the weight dequantised then
the batched GEMM (:mod:`deepinfer_cuda_sm100.gemm_dispatch`), at each ``M``.

``--write-choices`` writes the W8A16 paths' (Triton, dequantise + cuBLAS, TileLang where it
ran), the two W8A8 paths' and the grouped paths' times per shape and M into the measured table
the backend chooses by.

Prints a table (us per call, TB/s of weight bytes read, TFLOP/s), the geometric mean of
scaled_mm's time over Triton's W8A16 and over TileLang's (all points, M <= 64, M > 64), and the
chosen W8A16 path (per row the fastest of Triton, TileLang and dequantise + cuBLAS: what the
table written by ``--write-choices`` picks) against scaled_mm: each row where it is slower, the
smallest ratio and the geometric means (JSON ``chosen_w8a16_over_scaled_mm``); writes JSON (default
``benchmarks/results/bench_fp8_gemm.json`` at the repository root).

``--sweep``: for each shape at each decode M (<= 64) also time a grid of decode launches
(tile width 64 / 32 / 16, 1-16 K splits, the splits summed in the kernel; the chosen launch
also with torch summing them, ``DEEPINFER_FP8_SPLITK=separate``) and print the fastest next to
the chosen one (JSON ``sweep``): data to tune :func:`launch_config` with.

    python plugins/cuda_sm100/scripts/bench_fp8_gemm.py [--m 1,16,64] [--shapes 4096x1024,...] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import choice_writers
import torch
from deepinfer_cuda_sm100.gemm_dispatch import V4_FLASH_GROUPED, V4_FLASH_SHAPES
from graph_timing import gpu_run_header, time_graph
from scaled_mm_configs import scaled_mm_call

from deepinfer_core.benchmarking.harness import run_main

REPO = Path(__file__).resolve().parents[3]
SHAPES = V4_FLASH_SHAPES
GROUPED = V4_FLASH_GROUPED
TOKENS = "1,16,64,128,256,1024,4096,8192"


def sweep_decode(x: torch.Tensor, w, calls: int, replays: int) -> dict:
    """Time a grid of decode launches of ``x @ w.T`` (see the module docstring): ``{"chosen":
    ..., "chosen_separate_us": ..., "best": ..., "points": [...]}``, each point ``{"block_n",
    "splits", "warps", "stages", "us"}``."""
    from deepinfer_cuda_sm100.kernels import fp8_gemm

    m, k = x.shape
    n = w.data.shape[0]
    k_blocks = -(-k // fp8_gemm.BLOCK_K)
    chosen = fp8_gemm.launch_config(m, n, k, sms=fp8_gemm.sm_count(x.device))

    def timed(launch, reduction="fused"):
        def call(i, launch=launch):
            return fp8_gemm._run(x, w.data, w.scale, False, 0, launch, reduction)

        return time_graph(call, calls, replays)

    points, seen = [], set()
    for bn in fp8_gemm.DECODE_BLOCK_NS:
        for splits in (1, 2, 3, 4, 6, 8, 11, 16):
            if splits > 1 and -(-k_blocks // splits) < 1:
                continue
            real = -(-k_blocks // -(-k_blocks // splits))  # as _run balances them
            stages = min(fp8_gemm.MAX_STAGES, max(2, -(-k_blocks // real)))
            launch = fp8_gemm.Launch(16, bn, real, 4, stages)
            if launch in seen:
                continue
            seen.add(launch)
            points.append({**launch._asdict(), "us": timed(launch)})
    timed_points = [p for p in points if p["us"] is not None]
    best = min(timed_points, key=lambda p: p["us"]) if timed_points else None
    same = [p["us"] for p in points if all(p[key] == value for key, value in chosen._asdict().items())]
    chosen_us = same[0] if same else timed(chosen)
    return {
        "chosen": {**chosen._asdict(), "us": chosen_us},
        "chosen_separate_us": timed(chosen, "separate") if chosen.splits > 1 else None,
        "best": best,
        "points": points,
    }


PREFILL_GRID = [(bm, bn, w, st) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for st in (3, 4)]


def sweep_prefill(x: torch.Tensor, w, calls: int, replays: int) -> dict:
    """Time prefill launches of ``x @ w.T``: the W8A8 kernel on pre-quantised activations (the
    activation quantisation kernel included) and the W8A16 kernel, over :data:`PREFILL_GRID`
    (``BLOCK_M``, ``BLOCK_N``, warps, stages): ``{"w8a8": best, "w8a16": best, "points": [...]}``."""
    from deepinfer_cuda_sm100.kernels import fp8_gemm

    points = []
    for variant, w8a8 in (("w8a8", True), ("w8a16", False)):
        for bm, bn, warps, stages in PREFILL_GRID:
            launch = fp8_gemm.Launch(bm, bn, 1, warps, stages)

            def call(i, launch=launch, w8a8=w8a8):
                return fp8_gemm._run(x, w.data, w.scale, w8a8, 0, launch, prequant=w8a8)

            try:
                us = time_graph(call, calls, replays)
            except Exception as exc:  # e.g. out of shared memory: reported, the grid goes on
                print(f"    {variant} {launch}: {type(exc).__name__}: {str(exc)[:120]}")
                us = None
            points.append({"variant": variant, **launch._asdict(), "us": us})
    best = {}
    for variant in ("w8a8", "w8a16"):
        timed = [p for p in points if p["variant"] == variant and p["us"] is not None]
        best[variant] = min(timed, key=lambda p: p["us"]) if timed else None
    return {**best, "points": points}


def w8a8_prefill(x: torch.Tensor, w) -> torch.Tensor:
    """The registered ``linear`` kernel in its W8A8 prefill math (``DEEPINFER_FP8_PREFILL=w8a8``)."""
    import os

    from deepinfer_cuda_sm100.kernels.fp8_gemm import PREFILL_ENV, linear_fp8

    saved = os.environ.get(PREFILL_ENV)
    os.environ[PREFILL_ENV] = "w8a8"
    try:
        return linear_fp8(x, w)
    finally:
        if saved is None:
            del os.environ[PREFILL_ENV]
        else:
            os.environ[PREFILL_ENV] = saved


def tilelang_call(x: torch.Tensor, w, wide: bool = False) -> Callable | None:
    """The TileLang GEMM on ``x`` (``wide``: the wide tile kind), or ``None`` (printed why) where
    it does not run."""
    from deepinfer_cuda_sm100.gemm_dispatch import tilelang_usable
    from deepinfer_cuda_sm100.tl import tilelang_problem
    from deepinfer_cuda_sm100.tl.fp8_gemm import MAX_M

    if not tilelang_usable(x, w):
        if x.shape[0] <= MAX_M:
            print(f"  (tilelang: {tilelang_problem() or 'the kernel does not take this call'})")
        return None
    from deepinfer_cuda_sm100.gemm_dispatch import tilelang_splits
    from deepinfer_cuda_sm100.tl.fp8_gemm import linear_fp8 as tilelang_linear

    n, k = w.data.shape
    splits = None if wide else tilelang_splits(x, x.shape[0], n, k, 1)  # as the dispatcher calls it
    return lambda: tilelang_linear(x, w, wide, splits=splits)


def same_bits(a: Callable | None, b: Callable | None) -> bool | None:
    """Whether two calls give the same bits (``None`` where either did not run)."""
    return None if a is None or b is None else torch.equal(a(), b())


def grouped_rows(spec: str, tokens: list[int], calls: int, replays: int) -> list[dict]:
    """Time the grouped GEMM's paths (Triton's one launch, TileLang's one launch where it takes
    the call, the weight dequantised then the batched GEMM) for each ``G x K x N`` of ``spec``
    and each ``M`` (printed; the rows returned)."""
    from deepinfer_cuda_sm100.gemm_dispatch import cublas_grouped_linear, tilelang_usable
    from deepinfer_cuda_sm100.kernels.fp8_gemm import grouped_linear_fp8

    from deepinfer_core.ops.linear import grouped_linear
    from deepinfer_core.weights.quant import QuantizedTensor, quant_fp8

    rows = []
    for shape in filter(None, spec.split(",")):
        g, k, n = (int(v) for v in shape.split("x"))
        data, scale = quant_fp8(torch.randn(g * n, k, device="cuda") * k**-0.5, (128, 128), "ue8m0")
        w = QuantizedTensor(data, scale, "fp8", (128, 128))
        for m in tokens:
            x = torch.randn(m, g, k, device="cuda").to(torch.bfloat16)
            paths = {"triton": grouped_linear_fp8, "cublas": cublas_grouped_linear}
            if tilelang_usable(x, w, g):
                from deepinfer_cuda_sm100.gemm_dispatch import tilelang_splits
                from deepinfer_cuda_sm100.tl.fp8_gemm import grouped_linear_fp8 as tilelang_grouped

                splits = tilelang_splits(x, m, g * n, k, g)  # as the dispatcher calls it
                paths["tilelang"] = lambda x, w, s=splits: tilelang_grouped(x, w, s)
            times = {
                p: time_graph(lambda i, f=f, x=x, w=w: f(x, w), calls, replays) for p, f in paths.items()
            }
            want = grouped_linear(x, w).float()
            errs = {p: float((f(x, w).float() - want).abs().max()) for p, f in paths.items() if p != "cublas"}
            exact = torch.equal(cublas_grouped_linear(x, w).float(), want)
            row = {"G": g, "K": k, "N": n, "M": m, **{f"{p}_us": t for p, t in times.items()}}
            row |= {f"{p}_max_abs_err": e for p, e in errs.items()}
            rows.append({**row, "cublas_bitwise_reference": exact})
            errors = ", ".join(f"{p} {e:.3g}" for p, e in errs.items())
            print(
                f"grouped {g}x{k}x{n} M={m:>5}: "
                + ", ".join(f"{p} {t:8.1f} us" for p, t in times.items())
                + f" (errors {errors}; dequant+bmm bitwise: {exact})"
            )
    return rows


W8A16_PATHS = ("triton_w8a16", "tilelang", "dequant_cublas")
"""The paths ``linear``'s table chooses among for a kept FP8 weight (``--write-choices``)."""


def chosen_against_scaled_mm(rows: list[dict]) -> dict:
    """The path the table chooses per row (the fastest of :data:`W8A16_PATHS` that ran: the table
    ``--write-choices`` writes holds these rows) against cuBLAS's block-scaled FP8 GEMM
    (``scaled_mm``): printed per row where it is slower, with the smallest ratio and the
    geometric means; ``{"min": ..., "slower": [[K, N, M, ratio], ...], "geomean": {...}}``."""
    slower, ratios = [], []
    for r in rows:
        times = {p: r[f"{p}_us"] for p in W8A16_PATHS if r.get(f"{p}_us")}
        if not times or not r.get("scaled_mm_us"):
            continue
        path = min(times, key=times.get)
        r["chosen_path"], r["chosen_us"] = path, times[path]
        ratio = r["scaled_mm_us"] / times[path]
        ratios.append(ratio)
        if ratio < 1.0:
            slower.append([r["K"], r["N"], r["M"], round(ratio, 3)])
            print(f"chosen path {path} at {r['K']}x{r['N']} M={r['M']}: {ratio:.2f}x scaled_mm")
    out = {
        "min": min(ratios) if ratios else None,
        "slower": slower,
        "geomean": speedups(rows, "chosen_us", "chosen path"),
    }
    print(f"chosen path vs scaled_mm: smallest {out['min']}, {len(slower)} of {len(ratios)} rows below 1.0x")
    return out


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def speedups(rows: list[dict], column: str, name: str) -> dict[str, float | None]:
    """Geometric mean of cuBLAS FP8 time / ``column``'s time over all rows, M <= 64 and M > 64
    (``None`` where no row has both); printed as one line."""
    groups = (("all", lambda m: True), ("M<=64", lambda m: m <= 64), ("M>64", lambda m: m > 64))
    out = {
        label: geomean(
            [
                r["scaled_mm_us"] / r[column]
                for r in rows
                if keep(r["M"]) and r["scaled_mm_us"] and r.get(column)
            ]
        )
        for label, keep in groups
    }
    print(
        f"geomean scaled_mm time / {name} time: "
        + ", ".join(f"{label} {'-' if v is None else f'{v:.2f}'}" for label, v in out.items())
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default=TOKENS, help=f"token counts M (default {TOKENS})")
    parser.add_argument("--shapes", default=SHAPES, help=f"KxN weight shapes ('' for none; default {SHAPES})")
    parser.add_argument(
        "--grouped", default=GROUPED, help=f"GxKxN grouped projections ('' for none; default {GROUPED})"
    )
    parser.add_argument("--calls-per-graph", type=int, default=20)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_fp8_gemm.json")
    parser.add_argument(
        "--sweep", action="store_true", help="also time a grid of decode (M <= 64) and prefill launches"
    )
    parser.add_argument(
        "--write-choices",
        action="store_true",
        help="write the measured W8A16 paths (triton, dequantise + cuBLAS, tilelang) per shape and M\n"
        "into the "
        "package's table of this GPU's architecture (deepinfer_cuda_sm100/choices_smXY.json)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    from deepinfer_cuda_sm100.gemm_dispatch import cublas_linear
    from deepinfer_cuda_sm100.kernels.fp8_gemm import (
        DECODE_MAX_M,
        launch_shape,
        linear_fp8,
        linear_fp8_w8a8,
        sm_count,
    )
    from deepinfer_cuda_sm100.scaled_mm import available as scaled_mm_available
    from deepinfer_cuda_sm100.scaled_mm import scaled_mm_linear
    from deepinfer_cuda_sm100.tl.fp8_gemm import NARROW_MAX_M

    from deepinfer_core.weights.quant import QuantizedTensor, quant_fp8

    tokens = [int(t) for t in args.m.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in filter(None, args.shapes.split(","))]
    rows = []
    head = (
        f"{'K x N':<12} {'M':>5} {'tile/splits':>12} "
        + " ".join(
            f"{name + ' us':>16}"
            for name in (
                "triton w8a16",
                "triton w8a8",
                "tilelang",
                "tilelang wide",
                "scaled_mm",
                "bf16",
                "dequant+cublas",
                "w8a8 prefill",
                "scaled_mm+quant",
            )
        )
        + f" {'w8a16 TB/s':>10} {'w8a16 TF/s':>10} {'err':>8}"
    )
    print(head)
    for k, n in shapes:
        data, scale = quant_fp8(torch.randn(n, k, device="cuda") * k**-0.5, (128, 128), "fp32")
        w = QuantizedTensor(data, scale, "fp8", (128, 128))
        dense = w.dequantize(torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            calls = {
                "triton_w8a16": lambda x=x, w=w: linear_fp8(x, w),
                "triton_w8a8": lambda x=x, w=w: linear_fp8_w8a8(x, w),
                "tilelang": tilelang_call(x, w),
                "tilelang_wide": tilelang_call(x, w, wide=True) if m <= NARROW_MAX_M else None,
                "scaled_mm": scaled_mm_call(x, w, dense),
                "bf16_matmul": lambda x=x, d=dense: x @ d.t(),
                "dequant_cublas": lambda x=x, w=w: cublas_linear(x, w),
                "triton_w8a8_prefill": (lambda x=x, w=w: w8a8_prefill(x, w)) if m > DECODE_MAX_M else None,
                "backend_scaled_mm": (
                    (lambda x=x, w=w: scaled_mm_linear(x, w)) if scaled_mm_available() else None
                ),
            }
            times = {
                name: (
                    time_graph(lambda i, fn=fn: fn(), args.calls_per_graph, args.replays)
                    if fn is not None
                    else None
                )
                for name, fn in calls.items()
            }
            try:
                err = float((linear_fp8(x, w).float() - (x @ dense.t()).float()).abs().max())
            except Exception as exc:  # reported; the other columns kept
                print(f"  (triton w8a16 failed: {type(exc).__name__}: {str(exc)[:300]})")
                err = float("nan")
            bm, bn, splits = launch_shape(m, n, k, sms=sm_count(x.device))
            t = times["triton_w8a16"]
            weight_bytes = n * k + scale.numel() * 4
            row = {
                "K": k,
                "N": n,
                "M": m,
                "tile": [bm, bn],
                "splits": splits,
                **{f"{name}_us": v for name, v in times.items()},
                "w8a16_weight_TBps": weight_bytes / (t * 1e-6) / 1e12 if t else None,
                "w8a16_TFLOPps": 2 * m * n * k / (t * 1e-6) / 1e12 if t else None,
                "bf16_matmul_TFLOPps": (
                    2 * m * n * k / (tb * 1e-6) / 1e12 if (tb := times["bf16_matmul"]) else None
                ),
                "w8a16_max_abs_err_vs_bf16": err,
                "tilelang_wide_bitwise": same_bits(calls["tilelang"], calls["tilelang_wide"]),
            }
            rows.append(row)

            def fmt(v, width=16, spec=".1f"):
                return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"

            print(
                f"{f'{k}x{n}':<12} {m:>5} {f'{bm}x{bn}/{splits}':>12} "
                + " ".join(fmt(times[name]) for name in calls)
                + f" {fmt(row['w8a16_weight_TBps'], 10, '.2f')} {fmt(row['w8a16_TFLOPps'], 10, '.1f')}"
                + f" {err:>8.3g}"
            )
            if args.sweep and m <= 64:
                row["sweep"] = sweep = sweep_decode(x, w, args.calls_per_graph, args.replays)
                best, chosen = sweep["best"], sweep["chosen"]
                if best is not None:
                    print(
                        f"    sweep: chosen 16x{chosen['block_n']}/{chosen['splits']}"
                        f" {fmt(chosen['us'], 0)} us (torch-summed splits"
                        f" {fmt(sweep['chosen_separate_us'], 0)}), fastest"
                        f" 16x{best['block_n']}/{best['splits']} {best['us']:.1f} us"
                    )
            if args.sweep and m > 64:
                row["sweep"] = sweep = sweep_prefill(x, w, args.calls_per_graph, args.replays)
                for variant in ("w8a8", "w8a16"):
                    b = sweep[variant]
                    if b is not None:
                        tf = 2 * m * n * k / (b["us"] * 1e-6) / 1e12
                        print(
                            f"    sweep {variant}: fastest {b['block_m']}x{b['block_n']} w{b['warps']}"
                            f" s{b['stages']} {b['us']:.1f} us ({tf:.0f} TFLOP/s)"
                        )
    grouped = grouped_rows(args.grouped, tokens, args.calls_per_graph, args.replays)
    ratios = speedups(rows, "triton_w8a16_us", "triton w8a16")
    tl_ratio = speedups(rows, "tilelang_us", "tilelang")
    chosen = chosen_against_scaled_mm(rows)
    result = {
        **gpu_run_header("cuda_sm100 FP8 block GEMM vs torch._scaled_mm and bf16 matmul"),
        "calls_per_graph": args.calls_per_graph,
        "replays": args.replays,
        "note": "scaled_mm times the GEMM on pre-quantised activations; triton w8a8 quantises in-kernel",
        "sms": sm_count(torch.device("cuda")),
        "geomean_scaled_mm_over_triton_w8a16": ratios,
        "geomean_scaled_mm_over_tilelang": tl_ratio,
        "chosen_w8a16_over_scaled_mm": chosen,
        "rows": rows,
        "grouped_rows": grouped,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.write_choices:
        print(f"wrote {choice_writers.write_gemm_choices(rows, grouped)}")


if __name__ == "__main__":
    run_main(main)
