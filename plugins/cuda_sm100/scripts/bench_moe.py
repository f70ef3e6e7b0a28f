"""Time the ``cuda_sm100`` MoE kernels (``moe_experts``) at decode on a GPU.

DeepSeek-V4-Flash's routed experts: ``E`` (default 256) experts of ``hidden x inter`` (4096 x
2048: gate_up ``[E, 4096, 4096]``, down ``[E, 4096, 2048]``), top-6, random routing (distinct
experts per token, uniform).  For each token count ``T`` it times (CUDA events, replaying a
CUDA graph of ``--calls-per-graph`` back-to-back calls, each with its own routing, so launch
overhead is excluded and consecutive calls touch different experts):

* ``triton fp4``: the registered kernels on FP4 e2m1 experts (one scale per 32 inputs, ue8m0 as
  in the release or float32 with ``--scales fp32``: the checkpoint format kept with
  ``keep_quantized``), in the default ``bf16`` math;
* ``triton fp4 fp8math``: the same with ``DEEPINFER_MOE_MATH=fp8`` (e2m1 as e4m3, activations
  quantised per token and 32 inputs to e4m3, e4m3 MMAs; its error against the reference is
  reported next to the default math's);
* ``tilelang fp4``: the TileLang GEMMs (:mod:`deepinfer_cuda_sm100.tl.moe`) on the same FP4
  experts, between the same Triton layout and combine launches (where TileLang can compile);
* ``tilelang wide fp4``: the same with the wide variant (``consumers=2``: two consumer
  warpgroups a CTA; where its widths fit, :func:`~deepinfer_cuda_sm100.tl.moe.wide_problem`);
* ``triton gemv fp4``: the decode-width GEMVs (:mod:`deepinfer_cuda_sm100.kernels.moe_gemv`:
  CUDA-core dot products, many small programs) on the same FP4 experts, at the token counts
  up to ``--gemv-tokens`` (default 8; 0: not timed);
* ``triton dequant fp4``: the FP4 experts dequantised once per call, a group of experts at a time,
  then Triton's plain-stack launches (:mod:`deepinfer_cuda_sm100.kernels.moe_dequant`; the
  dequantisation is inside the time);
* ``cublas grouped fp4``: cuBLAS's grouped GEMMs over the expert-sorted pairs
  (:mod:`deepinfer_cuda_sm100.kernels.moe_grouped`: every FP4 expert dequantised first, inside the
  time; where the dequantised stacks fit its scratch);
* ``triton bf16``: the same kernels on the dequantised bf16 experts;
* ``cublas grouped bf16``: the grouped GEMMs on the bf16 experts;
* ``grouped_mm``: the core reference on the bf16 experts (``torch._grouped_mm`` over the
  expert-sorted pairs: the reference backend's path).

The bandwidth is the effective weight-read rate: the bytes of the distinct experts a call
routes to (data and scales), averaged over the calls of the graph, divided by the time.
Prints a table and writes JSON (default ``benchmarks/results/bench_moe.json`` at the
repository root).

    python plugins/cuda_sm100/scripts/bench_moe.py [--tokens 1,2,4,8,16,64,128,256] [--experts 256]
        [--gemv-tokens 8] [--write-choices]

``--stages 3,4,5`` also times both TileLang variants at each depth of their shared-memory
ring (the result is the same at any depth) and prints each, to retune
``tl.moe.STAGES``; ``--heights 16,32,64`` times them at each tile height (the same result at
any height; 128, ``tl.moe.PREFILL_BLOCK_M``, too), to check ``tl.moe.tile_height`` and
``tl.moe.WIDE_TALL_PAIRS``; ``--compiler-registers 16,32`` times the
one-warpgroup kernels at those heights with the compiler's register allotment instead of
``tl.moe.SPLIT_REGS`` (the same result, checked bit for bit), ``--ctas-per-sm 16=3`` with the
split of that many CTAs an SM (``tl.moe.split_for``; checked likewise); ``--gathered`` times both
variants with and without the activations gathered into the sorted rows first and loaded by
TMA (``tl.moe.moe_experts(gathered=True / False)``, the gather launch included; the default
is ``tl.moe.gathers_rows``'; the same result, checked bit for bit); ``--halves`` times both
with each K step decoded and multiplied in two K halves (``tl.moe.moe_experts(halves=True)``:
half the live A registers, so the default four CTAs an SM at 16-row tiles keep their wgmma
pipelined; checked likewise).

``--gemv-sweep`` times only the decode-width GEMVs (``gemv_sweep.py``; no table), kernel by
kernel, at the token counts of ``--tokens`` up to ``--gemv-tokens``: the gate / up kernel and the
down kernel over a grid of launches (:class:`~deepinfer_cuda_sm100.kernels.moe_gemv.GemvLaunch`:
rows per set 4 / 8 / 16, K steps of 256 / 512 / 1024 inputs, 2 / 4 / 8 warps, where a thread
holds one or two scale groups of a row set: 13 launches a kernel at V4-Flash widths), µs and TB/s
of each and the best, the combine's time and the whole call's with the default and the best
launches; JSON ``gemv_sweep`` (default ``benchmarks/results/bench_moe_gemv_sweep.json``).  A few
minutes on an H200:

    python plugins/cuda_sm100/scripts/bench_moe.py --experts 64 --gemv-sweep

``--tile-sweep`` times only the tiled Triton kernels on bf16 experts (the dequantised FP4
experts' stacks: the plain-stack launches the bf16 experts and the dequantised experts' path
run), the whole call over a grid of launch sizes (``tile_sweep.py``,
:class:`~deepinfer_cuda_sm100.kernels.moe.TileLaunch`: 64- and 128-row tiles, 64 or 128 columns a
program, K steps of 32 or 64, warps, stages) against the default sizes, with TFLOP/s and the
error against the reference; JSON ``tile_sweep`` (default
``benchmarks/results/bench_moe_tile_sweep.json``; no table):

    python plugins/cuda_sm100/scripts/bench_moe.py --experts 64 --tokens 2048,8192 --tile-sweep

``--write-choices`` writes the Triton and TileLang FP4 times (both TileLang variants), the
GEMVs' (language ``triton_gemv``, at the token counts where they were timed), the dequantised
experts' (``triton_dequant``) and the grouped GEMMs' (``cublas_grouped``) of each token count, and
the bf16 experts' Triton and grouped times as points of kind ``bf16``,
into the backend's measured table (``moe_experts`` points of ``choices_smXY.json``, see
:mod:`deepinfer_cuda_sm100.kernel_choice`), which the op's dispatcher reads; the points' kind
names the scales' storage (:func:`~deepinfer_cuda_sm100.moe_dispatch.choice_kind`: ``fp4`` or
``fp4+fp32``), so a checkpoint of each storage needs its own run.
"""

from __future__ import annotations

import json

import torch
from bench_moe_cli import parse_args
from graph_timing import gpu_run_header, time_graph
from register_splits import register_splits, time_register_split

from deepinfer_core.benchmarking.harness import run_main

LIMIT = 10.0


def random_fp4(e: int, out: int, inp: int, seed: int, scales: str = "ue8m0"):
    """An FP4 stack of random codes with power-of-two scales near ``1 / (3 sqrt(inp))``, built
    on the GPU, the scales stored as ``scales`` (``"ue8m0"`` or ``"fp32"``)."""
    from deepinfer_core.weights.quant import UE8M0_DTYPE, QuantizedTensor

    g = torch.Generator(device="cuda").manual_seed(seed)
    data = torch.randint(0, 256, (e, out, inp // 2), dtype=torch.uint8, device="cuda", generator=g)
    base = round(float(torch.log2(torch.tensor(1.0 / (3 * inp**0.5)))))
    jitter = torch.randint(-1, 2, (e, out, inp // 32), device="cuda", generator=g)
    scale = torch.exp2((base + jitter).float())
    return QuantizedTensor(data, scale.to(UE8M0_DTYPE) if scales == "ue8m0" else scale, "fp4", (1, 32))


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got - want| / max |want|, ||got - want|| / ||want||)``."""
    got, want = got.float(), want.float()
    diff = got - want
    return (
        float(diff.abs().max() / want.abs().max().clamp(min=1e-6)),
        float(diff.norm() / want.norm().clamp(min=1e-30)),
    )


def routings(t: int, e: int, k: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` routings of ``t`` tokens: ``(ids [t, k] int64, weights [t, k] fp32)``, distinct experts."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
        w = torch.rand(t, k, device="cuda", generator=g) + 0.1
        out.append((ids, 1.5 * w / w.sum(-1, keepdim=True)))
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])

    from deepinfer_cuda_sm100.kernels.moe import moe_experts as triton_moe
    from deepinfer_cuda_sm100.kernels.moe import tile_count, tile_rows, using_moe_math
    from deepinfer_cuda_sm100.kernels.moe_dequant import moe_experts as dequant_moe
    from deepinfer_cuda_sm100.kernels.moe_gemv import MAX_TOKENS
    from deepinfer_cuda_sm100.kernels.moe_gemv import moe_experts as gemv_moe
    from deepinfer_cuda_sm100.kernels.moe_grouped import grouped_problem
    from deepinfer_cuda_sm100.kernels.moe_grouped import moe_experts as grouped_moe
    from deepinfer_cuda_sm100.tl import tilelang_problem

    from deepinfer_core.ops.moe import moe_experts as reference

    e, d, i, k = args.experts, args.hidden, args.inter, args.top_k
    gemv_tokens = min(args.gemv_tokens, MAX_TOKENS)
    gate_up, down = random_fp4(e, 2 * i, d, 1, args.scales), random_fp4(e, d, i, 2, args.scales)
    if args.gemv_sweep:
        from gemv_sweep import write_gemv_sweep

        tokens = [t for t in (int(v) for v in args.tokens.split(",")) if 1 <= t <= gemv_tokens]
        write_gemv_sweep(args, gate_up, down, tokens, routings)
        return
    gate_up_bf16, down_bf16 = gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16)
    if args.tile_sweep:
        from tile_sweep import write_tile_sweep

        tokens = [int(v) for v in args.tokens.split(",")]
        write_tile_sweep(args, gate_up_bf16, down_bf16, tokens, routings, errors)
        return
    tl_problem = tilelang_problem()
    wide_problem = tl_problem
    if tl_problem is None:
        from deepinfer_cuda_sm100.tl.moe import moe_experts as tilelang_moe
        from deepinfer_cuda_sm100.tl.moe import tile_height, tile_heights
        from deepinfer_cuda_sm100.tl.moe import wide_problem as tl_wide_problem

        wide_problem = tl_wide_problem(d, i)
        if wide_problem:
            print(f"(no TileLang wide column: {wide_problem})")
    else:
        print(f"(no TileLang columns: {tl_problem})")

    grouped_fp4_problem = grouped_problem(torch.empty(0, d, dtype=torch.bfloat16), gate_up, down)
    if grouped_fp4_problem:
        print(f"(no cublas grouped fp4 column: {grouped_fp4_problem})")
    fp4_expert_bytes = (gate_up.nbytes + down.nbytes) / e
    bf16_expert_bytes = (gate_up_bf16.nbytes + down_bf16.nbytes) / e
    names = (
        "triton_fp4",
        "triton_fp4_fp8math",
        "tilelang_fp4",
        "tilelang_wide_fp4",
        "triton_gemv_fp4",
        "triton_dequant_fp4",
        "cublas_grouped_fp4",
        "triton_bf16",
        "cublas_grouped_bf16",
        "grouped_mm",
    )
    tbps_columns = [f"{n}_weight_TBps" for n in names]
    print(
        f"E={e} D={d} I={i} top-{k}, {args.scales} scales: "
        f"{fp4_expert_bytes / 2**20:.1f} MiB per FP4 expert, "
        f"{bf16_expert_bytes / 2**20:.1f} MiB bf16"
    )
    head = f"{'T':>5} {'experts':>8} {'tiles':>6} " + " ".join(f"{n + ' us':>15}" for n in names)
    head += (
        f" {'fp4 TB/s':>9} {'fp8m TB/s':>9} {'tl TB/s':>9} {'tlw TB/s':>9} {'gemv TB/s':>9} {'dq TB/s':>9}"
        f" {'cbg TB/s':>9} {'bf16 TB/s':>9} {'cbgb TB/s':>9} {'gmm TB/s':>9}"
    )
    head += f" {'err':>9} {'fp8m err':>9} {'tl err':>9} {'tlw err':>9} {'gemv err':>9} {'dq err':>9}"
    head += f" {'cbg err':>9}"
    print(head)
    rows, tuned = [], []
    for t in [int(v) for v in args.tokens.split(",")]:
        routes = routings(t, e, k, args.calls_per_graph, seed=t)
        x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
        distinct = sum(int(ids.unique().numel()) for ids, _ in routes) / len(routes)
        calls = {
            "triton_fp4": lambda j, routes=routes, x=x: triton_moe(x, *routes[j], gate_up, down, LIMIT),
            "triton_dequant_fp4": lambda j, routes=routes, x=x: dequant_moe(
                x, *routes[j], gate_up, down, LIMIT
            ),
            "triton_bf16": lambda j, routes=routes, x=x: triton_moe(
                x, *routes[j], gate_up_bf16, down_bf16, LIMIT
            ),
            "cublas_grouped_bf16": lambda j, routes=routes, x=x: grouped_moe(
                x, *routes[j], gate_up_bf16, down_bf16, LIMIT
            ),
            "grouped_mm": lambda j, routes=routes, x=x: reference(
                x, *routes[j], gate_up_bf16, down_bf16, LIMIT
            ),
        }
        if grouped_fp4_problem is None:
            calls["cublas_grouped_fp4"] = lambda j, routes=routes, x=x: grouped_moe(
                x, *routes[j], gate_up, down, LIMIT
            )
        if tl_problem is None:
            calls["tilelang_fp4"] = lambda j, routes=routes, x=x: tilelang_moe(
                x, *routes[j], gate_up, down, LIMIT
            )
        if wide_problem is None:
            calls["tilelang_wide_fp4"] = lambda j, routes=routes, x=x: tilelang_moe(
                x, *routes[j], gate_up, down, LIMIT, consumers=2
            )
        if t <= gemv_tokens:
            calls["triton_gemv_fp4"] = lambda j, routes=routes, x=x: gemv_moe(
                x, *routes[j], gate_up, down, LIMIT
            )
        times = {
            "tilelang_fp4": None,
            "tilelang_wide_fp4": None,
            "triton_gemv_fp4": None,
            "cublas_grouped_fp4": None,
        }
        for name, fn in calls.items():
            times[name] = time_graph(fn, args.calls_per_graph, args.replays)
            if name == "triton_fp4":  # the same kernels in the fp8 math (read at capture)
                with using_moe_math("fp8"):
                    times["triton_fp4_fp8math"] = time_graph(fn, args.calls_per_graph, args.replays)

        def tbps(us, per_expert, distinct=distinct):
            return distinct * per_expert / (us * 1e-6) / 1e12 if us else None

        sweep = [("stages", int(v)) for v in args.stages.split(",") if v]
        sweep += [("block_m", int(v)) for v in args.heights.split(",") if v]
        sweep += [("gathered", True), ("gathered", False)] if args.gathered else []
        sweep += [("halves", True)] if args.halves else []
        variants = [c for c in (1, 2) if c == 1 or wide_problem is None] if tl_problem is None else []
        runs = [(c, kv) for c in variants for kv in sweep if kv[0] != "block_m" or kv[1] in tile_heights(c)]
        for consumers, (knob, value) in runs:
            us = time_graph(
                lambda j, routes=routes, x=x, c=consumers, kw={knob: value}: tilelang_moe(
                    x, *routes[j], gate_up, down, LIMIT, consumers=c, **kw
                ),
                args.calls_per_graph,
                args.replays,
            )
            tb = tbps(us, fp4_expert_bytes)
            bitwise = torch.equal(
                tilelang_moe(x, *routes[0], gate_up, down, LIMIT, consumers=consumers, **{knob: value}),
                tilelang_moe(x, *routes[0], gate_up, down, LIMIT, consumers=consumers),
            )
            tuned.append(
                {"T": t, "consumers": consumers, knob: value, "us": us, "weight_TBps": tb, "bitwise": bitwise}
            )
            print(f"    tune T={t} consumers={consumers} {knob}={value}: {us:.1f} us, {tb:.2f} TB/s", end="")
            print(f", bitwise {bitwise}")
        splits = register_splits(args.compiler_registers, args.ctas_per_sm) if tl_problem is None else []
        for bm, split in splits:
            tuned.append(time_register_split(tilelang_moe, x, routes, gate_up, down, LIMIT, bm, split, args))
            tuned[-1]["weight_TBps"] = tb = tbps(tuned[-1]["us"], fp4_expert_bytes)
            label = "compiler's registers" if split is False else f"registers {split}"
            print(
                f"    tune T={t} block_m={bm} {label}: {tuned[-1]['us']:.1f} us, {tb:.2f} TB/s, "
                f"bitwise {tuned[-1]['bitwise']}"
            )
        want = reference(x, *routes[0], gate_up_bf16, down_bf16, LIMIT).float()
        err, rms = errors(triton_moe(x, *routes[0], gate_up, down, LIMIT), want)
        fp8_err = fp8_rms = None
        try:  # (a failure of the opt-in math is reported, the other columns kept)
            with using_moe_math("fp8"):
                fp8_err, fp8_rms = errors(triton_moe(x, *routes[0], gate_up, down, LIMIT), want)
        except Exception as exc:
            print(f"  (fp8 math failed: {type(exc).__name__}: {str(exc)[:300]})")

        tl_err = tl_rms = None
        if tl_problem is None:
            tl_err, tl_rms = errors(tilelang_moe(x, *routes[0], gate_up, down, LIMIT), want)
        tlw_err = tlw_rms = None
        if wide_problem is None:
            tlw_err, tlw_rms = errors(tilelang_moe(x, *routes[0], gate_up, down, LIMIT, consumers=2), want)
        gemv_err = gemv_rms = None
        if t <= gemv_tokens:
            gemv_err, gemv_rms = errors(gemv_moe(x, *routes[0], gate_up, down, LIMIT), want)
        dq_err, dq_rms = errors(dequant_moe(x, *routes[0], gate_up, down, LIMIT), want)
        cbg_err, cbg_rms = errors(grouped_moe(x, *routes[0], gate_up_bf16, down_bf16, LIMIT), want)

        bm = tile_rows(t * k, e, False)
        row = {
            "T": t,
            "distinct_experts": distinct,
            "tile_rows": bm,
            "tilelang_tile_rows": tile_height(t * k, e) if tl_problem is None else None,
            "tilelang_wide_tile_rows": tile_height(t * k, e, 2) if tl_problem is None else None,
            "tiles": tile_count(t * k, e, bm),
            **{f"{name}_us": v for name, v in times.items()},
            "triton_fp4_weight_TBps": tbps(times["triton_fp4"], fp4_expert_bytes),
            "triton_fp4_fp8math_weight_TBps": tbps(times["triton_fp4_fp8math"], fp4_expert_bytes),
            "tilelang_fp4_weight_TBps": tbps(times["tilelang_fp4"], fp4_expert_bytes),
            "tilelang_wide_fp4_weight_TBps": tbps(times["tilelang_wide_fp4"], fp4_expert_bytes),
            "triton_gemv_fp4_weight_TBps": tbps(times["triton_gemv_fp4"], fp4_expert_bytes),
            "triton_dequant_fp4_weight_TBps": tbps(times["triton_dequant_fp4"], fp4_expert_bytes),
            "cublas_grouped_fp4_weight_TBps": tbps(times["cublas_grouped_fp4"], fp4_expert_bytes),
            "triton_bf16_weight_TBps": tbps(times["triton_bf16"], bf16_expert_bytes),
            "cublas_grouped_bf16_weight_TBps": tbps(times["cublas_grouped_bf16"], bf16_expert_bytes),
            "grouped_mm_weight_TBps": tbps(times["grouped_mm"], bf16_expert_bytes),
            "fp4_max_rel_err_vs_reference": err,
            "fp4_rel_rms_err_vs_reference": rms,
            "fp4_fp8math_max_rel_err_vs_reference": fp8_err,
            "fp4_fp8math_rel_rms_err_vs_reference": fp8_rms,
            "tilelang_fp4_max_rel_err_vs_reference": tl_err,
            "tilelang_fp4_rel_rms_err_vs_reference": tl_rms,
            "tilelang_wide_fp4_max_rel_err_vs_reference": tlw_err,
            "tilelang_wide_fp4_rel_rms_err_vs_reference": tlw_rms,
            "triton_gemv_fp4_max_rel_err_vs_reference": gemv_err,
            "triton_gemv_fp4_rel_rms_err_vs_reference": gemv_rms,
            "triton_dequant_fp4_max_rel_err_vs_reference": dq_err,
            "triton_dequant_fp4_rel_rms_err_vs_reference": dq_rms,
            "cublas_grouped_max_rel_err_vs_reference": cbg_err,
            "cublas_grouped_rel_rms_err_vs_reference": cbg_rms,
        }
        rows.append(row)

        def fmt(v, width=15, spec=".1f"):
            return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"

        print(
            f"{t:>5} {distinct:>8.1f} {row['tiles']:>6} "
            + " ".join(fmt(times[n]) for n in names)
            + "".join(f" {fmt(row[c], 9, '.2f')}" for c in tbps_columns)
            + f" {err:>9.2g} {fmt(fp8_err, 9, '.2g')} {fmt(tl_err, 9, '.2g')} {fmt(tlw_err, 9, '.2g')}"
            + f" {fmt(gemv_err, 9, '.2g')} {dq_err:>9.2g} {cbg_err:>9.2g}"
        )

    result = {
        **gpu_run_header(
            "cuda_sm100 MoE (moe_experts) decode: Triton FP4 (bf16 / fp8 math) / TileLang FP4 "
            "(one and two consumer warpgroups) / Triton decode-width FP4 GEMVs / Triton bf16 "
            "vs torch._grouped_mm bf16"
        ),
        "experts": e,
        "hidden": d,
        "inter": i,
        "top_k": k,
        "scales": args.scales,
        "gemv_tokens": gemv_tokens,
        "calls_per_graph": args.calls_per_graph,
        "replays": args.replays,
        "fp4_expert_bytes": fp4_expert_bytes,
        "bf16_expert_bytes": bf16_expert_bytes,
        "note": "TB/s = bytes of the distinct experts routed to per call / time; each call of a graph "
        "has its own routing; err = max |triton fp4 - reference on the dequantised experts| / max |ref| "
        "(rms: ||diff|| / ||ref||), fp8math: DEEPINFER_MOE_MATH=fp8",
        "rows": rows,
        "stage_sweep": tuned,
    }
    if args.write_choices:
        from choice_writers import write_moe_choices
        from deepinfer_cuda_sm100.moe_dispatch import choice_kind

        print(f"wrote {write_moe_choices(rows, d, i, e, k, choice_kind(gate_up))}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
