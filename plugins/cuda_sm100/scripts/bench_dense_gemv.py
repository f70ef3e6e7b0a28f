"""``linear`` on a plain bf16 weight at decode widths: the dense GEMV
(:mod:`deepinfer_cuda_sm100.kernels.gemv`) against cuBLAS (``F.linear``, the reference's path).

For each ``N x K`` weight (default V4-Flash's plain bf16 weights: the LM head, the compressors'
fused ``kv`` + ``gate`` projections of the CSA and HCA layers and of the indexer, the router at
256 and 64 experts, the indexer's head weights) and token count ``M``, µs per call (CUDA graphs,
:func:`graph_timing.time_graph`) and the weight's read rate in TB/s, with the largest difference
from a float32 product.  ``--sweep`` also times each kernel over block sizes, warps and stages
(the kernel's defaults are the fastest of this sweep on an H100 at the head).  ``--write-choices``
writes the ``linear_dense`` points of the measured table, from which ``linear`` on a plain weight
takes the GEMV where it was faster (:func:`deepinfer_cuda_sm100.gemm_dispatch.dense_refusal`).

    python plugins/cuda_sm100/scripts/bench_dense_gemv.py [--shapes 129280x4096] [--m 1,2,4,16,64] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import choice_writers
import torch
import torch.nn.functional as F
from deepinfer_cuda_sm100.kernels import gemv as kg
from graph_timing import gpu_run_header, time_graph

CALLS, REPLAYS = 4, 20
V4_FLASH_PLAIN = "129280x4096,2048x4096,1024x4096,512x4096,256x4096,64x4096"
"""``N x K`` of V4-Flash's plain bf16 linears (see the module docstring)."""


def sweep_launches(m: int) -> list[kg.Launch]:
    """The ``--sweep``'s launches of the kernel that serves ``m`` rows."""
    if m == 1:
        grid = itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (3, 4))
    else:
        grid = itertools.product((32, 64, 128), (64, 128, 256), (4,), (4, 5))
    return [kg.Launch(*p) for p in grid if p[0] * p[1] <= 16384]


def measure(n: int, k: int, m: int, sweep: bool) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(CALLS)]
    exact = xs[0].float() @ w.float().t()
    rows = []

    def row(path: str, fn, out_of, **extra) -> None:
        us = time_graph(fn, CALLS, REPLAYS)
        if us is None:
            return
        err = (out_of().float() - exact).abs().max().item()
        rows.append(
            {"n": n, "k": k, "m": m, "path": path, "us": us, "tb_s": n * k * 2 / us / 1e6, "err": err} | extra
        )

    row("cublas", lambda i: F.linear(xs[i % CALLS], w), lambda: F.linear(xs[0], w))
    if kg.gemv_problem(xs[0], w) is None:
        row("gemv", lambda i: kg.gemv(xs[i % CALLS], w), lambda: kg.gemv(xs[0], w))
    if sweep:
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        kind = "row" if m == 1 else "dot"
        for cfg in sweep_launches(m):
            if k % cfg.block_k:
                continue

            def fn(i, cfg=cfg):
                kg.launch(xs[i % CALLS], w, out, cfg)

            row(f"sweep_{kind}", fn, lambda fn=fn: (fn(0), out)[1], **cfg._asdict())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=V4_FLASH_PLAIN, help="N x K weights, comma-separated")
    ap.add_argument("--m", default="1,2,4,16,64", help="token counts")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' block sizes, warps, stages")
    ap.add_argument(
        "--write-choices", action="store_true", help="write the measured table's linear_dense points"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_dense_gemv.json"))
    a = ap.parse_args()
    results = []
    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        for m in map(int, a.m.split(",")):
            rows = measure(n, k, m, a.sweep)
            results += rows
            best = min(
                (r for r in rows if r["path"].startswith("sweep")), key=lambda r: r["us"], default=None
            )
            for r in rows[:2] + ([best] if best else []):
                extra = {key: r[key] for key in kg.Launch._fields if key in r}
                rate = f"{r['us']:8.1f} us {r['tb_s']:6.3f} TB/s err {r['err']:.3g}"
                print(f"{n}x{k} M={m:3d} {r['path']:<11} {rate} {extra}")
    if a.write_choices:
        print(f"wrote {choice_writers.write_dense_choices(results)}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(gpu_run_header("bench_dense_gemv") | {"results": results}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
