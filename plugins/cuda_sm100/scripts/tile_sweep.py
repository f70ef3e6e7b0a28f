"""``bench_moe.py --tile-sweep``: the tiled Triton kernels' launch sizes on plain bf16 experts.

The plain-stack launches of :mod:`deepinfer_cuda_sm100.kernels.moe` serve bf16 experts and the
dequantised FP4 experts (:mod:`deepinfer_cuda_sm100.kernels.moe_dequant`) at prefill.  At each
token count the whole ``moe_experts`` call on the dequantised bf16 stacks is timed over
:func:`tile_launch_grid` (:class:`~deepinfer_cuda_sm100.kernels.moe.TileLaunch` values) and the
default sizes, with the TFLOP/s of its two GEMMs and its error against the reference; the best
launch is printed per token count.  CUDA-graph timing as the rest of ``bench_moe.py``
(:func:`graph_timing.time_graph`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from gemv_sweep import write_sweep
from graph_timing import time_graph

LIMIT = 10.0
Routings = Callable[[int, int, int, int, int], list[tuple[torch.Tensor, torch.Tensor]]]
"""``bench_moe.routings``: ``(tokens, experts, k, n, seed)`` to ``n`` routings ``(ids, weights)``."""
Errors = Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]
"""``bench_moe.errors``: ``(got, want)`` to the max and the RMS relative error."""


def tile_launch_grid() -> list:
    """The ``--tile-sweep`` launches: 64- and 128-row tiles, 64 or 128 columns a program (gate /
    up: of each; down: twice that), K steps of 32 or 64 inputs, 8 warps (4 at 128 x 64 tiles),
    3 or 4 stages.  Those that compile for sm_90 without spills at V4-Flash widths (Triton 3.6,
    offline: 4 warps at 128 x 128 tiles spill 504-568 bytes, 8 warps take 255 registers)."""
    from deepinfer_cuda_sm100.kernels.moe import TileLaunch

    return [
        TileLaunch(bm, bn, bk, warps, stages)
        for bm in (64, 128)
        for bn in (64, 128)
        for bk in (32, 64)
        for warps in (4, 8)
        for stages in (3, 4)
        if warps == 8 or (bm, bn) == (128, 64)
    ]


def sweep_tiles(
    gate_up, down, tokens: list[int], k: int, routings: Routings, errors: Errors, calls: int, replays: int
) -> list[dict]:
    """At each token count, the call on the bf16 stacks ``gate_up`` / ``down`` timed (CUDA graphs
    of ``calls`` calls, each with its own routing) with the default sizes and every launch of
    :func:`tile_launch_grid`, its max relative error against the reference by ``errors``; prints
    a table per token count and returns its rows (JSON ``tile_sweep``)."""
    from deepinfer_cuda_sm100.kernels.moe import DEFAULT_LAUNCH, moe_experts, tile_rows

    from deepinfer_core.ops.moe import moe_experts as reference

    e, d, i = gate_up.shape[0], down.shape[1], down.shape[2]
    out = []
    for t in tokens:
        routes = routings(t, e, k, calls, seed=2000 + t)
        x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
        want = reference(x, *routes[0], gate_up, down, LIMIT)
        flops = 2 * t * k * 3 * d * i
        row = {"T": t, "default_block_m": tile_rows(t * k, e, False), "points": []}
        print(f"tile sweep T={t} ({t * k} pairs, {flops / 1e12:.2f} TFLOP a call)")
        sizes = ("block_m", 7), ("block_n", 7), ("block_k", 7), ("warps", 5), ("stages", 6)
        print("  " + " ".join(f"{c:>{w}}" for c, w in (*sizes, ("us", 9), ("TFLOP/s", 8), ("err", 8))))
        for launch in (DEFAULT_LAUNCH, *tile_launch_grid()):
            try:
                us = time_graph(
                    lambda j, routes=routes, x=x, launch=launch: moe_experts(
                        x, *routes[j], gate_up, down, LIMIT, launch=launch
                    ),
                    calls,
                    replays,
                )
                err = errors(moe_experts(x, *routes[0], gate_up, down, LIMIT, launch=launch), want)[0]
            except Exception as exc:  # a launch that does not fit is reported, the sweep goes on
                print(f"  {launch}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            tflops = flops / (us * 1e-6) / 1e12
            row["points"].append({**vars(launch), "us": us, "TFLOPs": tflops, "max_rel_err": err})
            values = ("-" if v is None else v for v in vars(launch).values())
            cells = " ".join(f"{v:>{w}}" for v, (_, w) in zip(values, sizes, strict=True))
            print(
                f"  {cells} {us:>9.1f} {tflops:>8.1f} {err:>8.2g}"
                + ("  (default)" if launch == DEFAULT_LAUNCH else "")
            )
        best = min(row["points"], key=lambda p: p["us"], default=None)
        row["best"] = best
        if best:
            print(f"  best: {best}")
        out.append(row)
    return out


def write_tile_sweep(
    args: argparse.Namespace, gate_up, down, tokens: list[int], routings: Routings, errors: Errors
) -> None:
    """``bench_moe.py --tile-sweep``: :func:`sweep_tiles` on the bf16 stacks ``gate_up`` / ``down``
    at ``tokens`` (``routings`` / ``errors``: ``bench_moe``'s), written as JSON to ``args.out``."""
    e, d, i, k = args.experts, args.hidden, args.inter, args.top_k
    print(f"E={e} D={d} I={i} top-{k}, bf16 experts: tiled launch sizes at T = {tokens}")
    sweep = sweep_tiles(gate_up, down, tokens, k, routings, errors, args.calls_per_graph, args.replays)
    note = (
        "us per whole moe_experts call (layout, gate / up, down, combine); TFLOP/s of the two "
        "GEMMs (2 * T * k * 3 * D * I flops); err: max |call - reference| / max |reference|"
    )
    benchmark = "cuda_sm100 MoE tiled Triton kernels on bf16 experts: launch-size sweep"
    write_sweep(args, benchmark, note, {"tile_sweep": sweep})
