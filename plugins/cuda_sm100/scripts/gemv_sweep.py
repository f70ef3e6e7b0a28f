"""``bench_moe.py --gemv-sweep``: the decode-width FP4 GEMVs' launches, kernel by kernel.

At each token count, the gate / up kernel and the down kernel (its pair programs, without the
combine) of :mod:`deepinfer_cuda_sm100.kernels.moe_gemv` each timed alone over
:func:`gemv_launch_grid` (:class:`~deepinfer_cuda_sm100.kernels.moe_gemv.GemvLaunch` values),
with the µs and the TB/s of the weights each reads (the distinct experts' gate and up rows, or
down rows, data and scales), the best launch of each, the combine's time and the whole
``moe_experts`` call's with the default and with the best launches.  CUDA-graph timing as the
rest of ``bench_moe.py`` (:func:`graph_timing.time_graph`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from graph_timing import gpu_run_header, time_graph

LIMIT = 10.0
Routings = Callable[[int, int, int, int, int], list[tuple[torch.Tensor, torch.Tensor]]]
"""``bench_moe.routings``: ``(tokens, experts, k, n, seed)`` to ``n`` routings ``(ids, weights)``."""


def gemv_launch_grid(hidden: int, inter: int) -> dict[str, list]:
    """The ``--gemv-sweep`` launches of each GEMV kernel (``gate_up``: K = ``hidden``, ``down``: K =
    ``inter``): rows per set 4 / 8 / 16, K steps of 256 / 512 / 1024 inputs (at most K), 2 / 4 / 8
    warps where a thread holds one or two scale groups (32 or 64 weights) of a row set (fewer
    sum each group across threads, more spill), one stage (Triton 3.6 does not pipeline these
    loops: two stages compile to the same code)."""
    from deepinfer_cuda_sm100.kernels.moe_gemv import GemvLaunch

    return {
        name: [
            GemvLaunch(bn, bk, warps, 1)
            for bn in (4, 8, 16)
            for bk in (256, 512, 1024)
            for warps in (2, 4, 8)
            if bk <= k and 32 <= bn * bk // (32 * warps) <= 64
        ]
        for name, k in (("gate_up", hidden), ("down", inter))
    }


def _launch_of(point: dict):
    """The :class:`~deepinfer_cuda_sm100.kernels.moe_gemv.GemvLaunch` of a sweep point."""
    from deepinfer_cuda_sm100.kernels.moe_gemv import GemvLaunch

    return GemvLaunch(*(point[f] for f in GemvLaunch._fields))


def _fmt(v: float | None, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


HEADS = (("kernel", 8), ("block_n", 7), ("block_k", 7), ("warps", 5), ("stages", 6), ("us", 8), ("TB/s", 6))
"""The ``--gemv-sweep`` table's columns and widths."""


def sweep_gemv(
    gate_up, down, tokens: list[int], k: int, routings: Routings, calls: int, replays: int
) -> list[dict]:
    """At each token count, each GEMV kernel timed alone (CUDA graphs of ``calls`` calls, each
    with its own routing from ``routings(t, experts, k, calls, seed)``) over
    :func:`gemv_launch_grid`, then the combine and the whole call with the default and the best
    launches; prints a table per token count and returns its rows (JSON ``gemv_sweep``)."""
    from deepinfer_cuda_sm100.kernels import moe_gemv
    from deepinfer_cuda_sm100.kernels.moe import combine_pairs

    e, d, i = gate_up.shape[0], down.shape[1], down.shape[2]
    grid = gemv_launch_grid(d, i)
    expert_bytes = {"gate_up": gate_up.nbytes / e, "down": down.nbytes / e}
    defaults = {"gate_up": moe_gemv.GATE_UP, "down": moe_gemv.DOWN}
    out = []
    for t in tokens:
        routes = routings(t, e, k, calls, seed=1000 + t)
        x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
        distinct = sum(int(ids.unique().numel()) for ids, _ in routes) / len(routes)
        plan = moe_gemv.launch_plan(t, k, d, i)
        hs = [moe_gemv.gate_up_h(x, ids, gate_up, LIMIT, plan["gate_up"]) for ids, _ in routes]
        ys = [moe_gemv.down_contributions(h, *r, down, plan["down"]) for h, r in zip(hs, routes, strict=True)]
        outs = [torch.empty(t, d, dtype=torch.bfloat16, device="cuda") for _ in routes]

        def kernel(name, launch, routes=routes, x=x, hs=hs, t=t):
            p = moe_gemv.launch_plan(t, k, d, i, launch, launch)[name]
            if name == "gate_up":
                return lambda j: moe_gemv.gate_up_h(x, routes[j][0], gate_up, LIMIT, p)
            return lambda j: moe_gemv.down_contributions(hs[j], *routes[j], down, p)

        def call(launches, routes=routes, x=x):
            return lambda j: moe_gemv.moe_experts(x, *routes[j], gate_up, down, LIMIT, **launches)

        row = {"T": t, "distinct_experts": distinct}
        print(f"gemv sweep T={t} ({t * k} pairs, {distinct:.1f} experts a call)")
        print("  " + " ".join(f"{c:>{w}}" for c, w in HEADS))
        best = {}
        for name, launches in grid.items():
            points = []
            for launch in launches:
                us = time_graph(kernel(name, launch), calls, replays)
                tb = distinct * expert_bytes[name] / (us * 1e-6) / 1e12 if us else None
                points.append({**launch._asdict(), "us": us, "weight_TBps": tb})
                cells = (name, *launch, _fmt(us, 0, ".1f"), _fmt(tb, 0, ".2f"))
                mark = "  (default)" if launch == defaults[name] else ""
                print("  " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, HEADS, strict=True)) + mark)
            timed = [p for p in points if p["us"] is not None]
            row[name], row[f"best_{name}"] = points, min(timed, key=lambda p: p["us"]) if timed else None
            if timed:
                top = row[f"best_{name}"]
                best[f"{name}_launch"] = _launch_of(top)
                print(f"  best {name}: {_launch_of(top)}, {top['us']:.1f} us, {top['weight_TBps']:.2f} TB/s")

        def combine(j, ys=ys, routes=routes, outs=outs):
            return combine_pairs(ys[j], routes[j][0], e, False, None, outs[j])

        row["combine_us"] = time_graph(combine, calls, replays)
        row["call_default_us"] = time_graph(call({}), calls, replays)
        row["call_best_us"] = time_graph(call(best), calls, replays)
        times = ("combine_us", "call_default_us", "call_best_us")
        print("  " + ", ".join(f"{key[:-3]} {_fmt(row[key], 0, '.1f')} us" for key in times))
        out.append(row)
    return out


def write_gemv_sweep(args: argparse.Namespace, gate_up, down, tokens: list[int], routings: Routings) -> None:
    """``bench_moe.py --gemv-sweep``: :func:`sweep_gemv` on the FP4 stacks ``gate_up`` / ``down``
    at ``tokens`` (``routings``: ``bench_moe.routings``), written as JSON to ``args.out``."""
    e, d, i, k = args.experts, args.hidden, args.inter, args.top_k
    print(f"E={e} D={d} I={i} top-{k}, {args.scales} scales: decode-width GEMV launches at T = {tokens}")
    sweep = sweep_gemv(gate_up, down, tokens, k, routings, args.calls_per_graph, args.replays)
    note = (
        "per kernel: us per call, TB/s = bytes of the distinct experts' weights it reads per call "
        "/ time (gate_up: the gate and up rows, down: the down rows, data and scales); down without the "
        "combine (combine_us); call_*_us: the whole moe_experts call, default and best launches"
    )
    write_sweep(
        args,
        "cuda_sm100 MoE decode-width FP4 GEMVs: launch sweep of the gate / up and down kernels",
        note,
        {"scales": args.scales, "gemv_sweep": sweep},
    )


def write_sweep(args: argparse.Namespace, benchmark: str, note: str, fields: dict) -> None:
    """A ``bench_moe.py`` sweep's JSON at ``args.out``: the GPU run header of ``benchmark``, the
    shape and timing arguments, ``note`` and ``fields`` (the sweep's rows among them)."""
    result = {
        **gpu_run_header(benchmark),
        "experts": args.experts,
        "hidden": args.hidden,
        "inter": args.inter,
        "top_k": args.top_k,
        "calls_per_graph": args.calls_per_graph,
        "replays": args.replays,
        "note": note,
        **fields,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
