"""GPU benchmark of the ``cuda_sm100`` attention kernels (``sparse_attention``, ``indexer_topk``).

Run on a CUDA machine (written for an H200)::

    python plugins/cuda_sm100/scripts/bench_attention.py            # everything
    python plugins/cuda_sm100/scripts/bench_attention.py --only attention --batches 32,256
    python plugins/cuda_sm100/scripts/bench_attention.py --tune      # also sweep the kernel tiles

**Attention** (the Triton kernel and, with TileLang installed, the TileLang one) at
DeepSeek-V4-Flash shapes (64 heads, head dim 512, bf16; plain and packed-FP8 pools, ``--kv``):
decode, one query per request, for each batch (``--batches``) and context, and prefill, a chunk
of ``--prefill`` queries of one request ending at the context; for each of ``--layers``: a
sliding-window layer (SWA: the window of 128 split between the ring and this step's rows, at
the first context only, as it does not depend on it), a CSA layer (the window plus the
indexer's top-512 compressed entries) and an HCA layer (the window plus every compressed
entry of ratio 128 through a paged index).  Each time is compared with the roofline ``max(bytes /
HBM, flops / 790e12)`` (``attention_inputs.roofline_ms``: HBM the running GPU's preset, 4.24e12 on
an H200, 3.0e12 on an H100, or ``--peak-bytes``), bytes counting the key rows, queries, outputs
and index lists once.

**Indexer top-k** (64 heads of dim 128, k = 512) on ``T x C`` candidates: ``128 x 16384``,
``128 x 262144`` (decode: each query its own paged entries) and ``8192 x 2048`` (prefill: one
request's entries); the fused kernel (scores + selection) and its selection alone against
``torch.topk`` on the same scores (and, where the selection takes its threshold path, the
one-program radix select too; on rows of at most 32,768 candidates, the row selection of
``kernels/indexer_rows.py``), and, with TileLang installed, the TileLang scores beside the
Triton ones (``indexer_tilelang.py``: time, agreement, ``--tune`` their blocks per CTA).

Timing: each op captured in a CUDA graph (``--no-graphs``: plain launches) with an L2 flush
before every call (the flush's own time subtracted), CUDA events, after warm-up.  Prints a
table and writes JSON (default ``benchmarks/results/bench_attention.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "cuda_sm100")]

import attention_tilelang  # noqa: E402
import choice_writers  # noqa: E402
import indexer_bench  # noqa: E402
from graph_timing import gpu_run_header  # noqa: E402

from deepinfer_core.benchmarking.harness import run_main  # noqa: E402

DEFAULT_OUTPUT = REPO / "benchmarks" / "results" / "bench_attention.json"

from attention_inputs import (  # noqa: E402
    HEAD_DIM,
    HEADS,
    PEAK_FLOPS,
    decode_inputs,
    device_peak_bytes,
    packed_inputs,
    prefill_inputs,
    roofline_ms,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--only", choices=["attention", "indexer"], help="run one of the two benchmarks")
    p.add_argument("--batches", default="1,4,16,32,64,128,256", help="decode batch sizes (comma-separated)")
    p.add_argument(
        "--prefill",
        default="1024,8192",
        help="prefill chunk sizes of one request (comma-separated; '' for none)",
    )
    p.add_argument("--contexts", default="4096,65536", help="context lengths (comma-separated)")
    p.add_argument("--layers", default="swa,csa,hca", help="attention layer kinds (comma-separated)")
    p.add_argument(
        "--kv",
        default="plain,fp8",
        help="KV pool formats (comma-separated): plain bfloat16 rows, fp8 packed rows (kv_cache_dtype=fp8)",
    )
    p.add_argument(
        "--indexer-shapes",
        default="128x16384,128x32768,128x262144,8192x2048",
        help="indexer T x C shapes (comma-separated); a trailing c (8192x2048c) makes a prefill "
        "shape causal: each token sees the entries its position closes",
    )
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before capturing")
    p.add_argument(
        "--no-graphs", action="store_true", help="time plain launches instead of CUDA graph replays"
    )
    p.add_argument("--no-flush", action="store_true", help="keep the L2 warm between calls")
    p.add_argument(
        "--peak-bytes", type=float, help="HBM bytes/s of the roofline (default: the running GPU's preset)"
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="also sweep the attention tiles, the seesaw kernel's schedule variants (checked bit for bit),\n"
        "the indexer's tiles and its threshold segments at each shape, and time the selection's kernels\n"
        "apart",
    )
    p.add_argument("--check", action="store_true", help="compare each output with the reference op first")
    p.add_argument(
        "--write-choices",
        action="store_true",
        help="write the measured kernel-language table of this GPU's architecture into the package\n"
        "(deepinfer_cuda_sm100/choices_smXY.json: which of Triton / TileLang serves each shape)",
    )
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON file to write")
    a = p.parse_args(argv)
    if not {x for x in a.layers.split(",") if x} <= {"swa", "csa", "hca"}:
        p.error(f"--layers takes swa, csa, hca (comma-separated), got {a.layers!r}")
    return a


# ---------------------------------------------------------------------------------------------
# timing


class Timer:
    """Milliseconds per call of ``fn``: CUDA-graph replays (or launches), L2 flushed before each."""

    def __init__(self, iters: int, warmup: int, graphs: bool, flush: bool):
        self.iters, self.warmup, self.graphs = iters, warmup, graphs
        self.scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush else None
        self._flush_ms: float | None = None

    def _flush(self) -> None:
        if self.scratch is not None:
            self.scratch.zero_()

    def _run(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            self._flush()
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self.graphs:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                for _ in range(self.iters):
                    self._flush()
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            torch.cuda.synchronize()
            start.record()
            graph.replay()
            end.record()
        else:
            start.record()
            for _ in range(self.iters):
                self._flush()
                fn()
            end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / self.iters

    def ms(self, fn: Callable[[], object]) -> float:
        """Time per call, less the flush's own time."""
        if self.scratch is None:
            return self._run(fn)
        if self._flush_ms is None:
            self._flush_ms = self._run(lambda: None)
        return max(self._run(fn) - self._flush_ms, 1e-4)


# ---------------------------------------------------------------------------------------------
# inputs


# ---------------------------------------------------------------------------------------------
# benchmarks


def bench_attention(a: argparse.Namespace, timer: Timer, rows: list[dict], saved=lambda: None) -> None:
    """Triton's kernel (the previous default) and, where TileLang is installed, the TileLang ones
    (the two-consumer kernel, and on plain pools the warp-specialised seesaw kernel): each
    shape's row appended to ``rows``, then ``saved()`` called (the output file rewritten, so a
    run cut short keeps the rows it measured)."""
    from deepinfer_cuda_sm100.attention_dispatch import choice_kind
    from deepinfer_cuda_sm100.kernels import attention as ka
    from deepinfer_cuda_sm100.tl import sparse_attention as tla

    from deepinfer_core.ops.attention import sparse_attention as reference

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [("decode", b) for b in a.batches.split(",") if b] + [
        ("prefill", t) for t in a.prefill.split(",") if t
    ]
    layers = [x for x in a.layers.split(",") if x]
    for n, ctx in enumerate(int(x) for x in a.contexts.split(",")):
        for (phase, batch), layer, kv in itertools.product(shapes, layers, a.kv.split(",")):
            if layer == "swa" and n:
                continue  # a window-only call does not depend on the context
            batch = int(batch)
            make = decode_inputs if phase == "decode" else prefill_inputs
            inp = make(batch, ctx, layer, torch.bfloat16, g)
            if kv == "fp8":
                inp = packed_inputs(inp)
            args = inp["args"]
            row = {
                "op": "sparse_attention",
                "layer": layer,
                "phase": phase,
                "kv": kv,
                "batch": batch,
                "context": ctx,
                "keys": inp["keys"],
            }
            if a.check:
                err = (ka.sparse_attention(*args).float() - reference(*args).float()).abs().max().item()
                row["max_abs_err"] = err
            cfg = ka.default_config(HEADS, HEAD_DIM, torch.bfloat16)
            plan = ka.plan_launch(batch, HEADS, ka.max_keys_of(args[2]), cfg, args[0].device)
            row["plan"] = f"{'split' if plan.split else 'direct'} chunk={plan.chunk} x{plan.nsplit}"
            row["ms"] = timer.ms(lambda args=args: ka.sparse_attention(*args))
            row["roofline_ms"] = roofline_ms(inp["bytes"], inp["flops"], a.peak_bytes)
            row["gbps"] = inp["bytes"] / row["ms"] / 1e6
            row["choice_key"] = {"kind": choice_kind(args[2], args[1]), "keys": tla.max_keys(args[2])}
            attention_tilelang.measure(row, args, reference, timer.ms, a.check)
            if a.tune:
                row["tune"] = tune_attention(args, timer) + (
                    tune_tilelang_splits(args, timer) if "tilelang_ms" in row else []
                )
                if "tilelang_ws_ms" in row:
                    row["tune"] += attention_tilelang.tune_seesaw(args, timer.ms)
            rows.append(row)
            saved()
            print_row(row)


def tune_attention(args: tuple, timer: Timer) -> list[dict]:
    from deepinfer_cuda_sm100.kernels import attention as ka

    out = []
    for block_h, block_n, warps, stages in (
        (64, 32, 8, 2),
        (64, 64, 8, 2),
        (64, 32, 4, 2),
        (32, 64, 4, 2),
        (32, 32, 4, 3),
        (16, 64, 4, 2),
        (64, 16, 4, 2),
    ):
        cfg = ka.AttentionConfig(block_h, block_n, warps, stages)
        try:
            ms = timer.ms(lambda cfg=cfg: ka.sparse_attention_impl(*args, config=cfg))
        except Exception as exc:  # out of resources, ...
            out.append(
                {"config": [block_h, block_n, warps, stages], "error": f"{type(exc).__name__}: {exc}"[:200]}
            )
            continue
        out.append({"config": [block_h, block_n, warps, stages], "ms": ms})
        print(f"    tune {cfg}: {ms:.4f} ms")
    return out


def tune_tilelang_splits(args: tuple, timer: Timer) -> list[dict]:
    """The TileLang kernel with each fewest-blocks-a-split (``MIN_SPLIT_BLOCKS``) of 1, 2, 4, 8:
    how many splits a small batch should take."""
    from deepinfer_cuda_sm100.tl import sparse_attention as tla

    out, default = [], tla.MIN_SPLIT_BLOCKS
    try:
        for blocks in (1, 2, 4, 8):
            tla.MIN_SPLIT_BLOCKS = blocks
            splits = tla.plan_splits(
                args[0].shape[0], HEADS, tla.max_keys(args[2]), tla.num_sms(args[0].device)
            )
            ms = timer.ms(lambda: tla.sparse_attention(*args))
            out.append({"tilelang_min_split_blocks": blocks, "splits": splits, "ms": ms})
            print(f"    tune tilelang: at least {blocks} blocks a split ({splits} splits): {ms:.4f} ms")
    finally:
        tla.MIN_SPLIT_BLOCKS = default
    return out


def print_row(r: dict) -> None:
    """One attention row of the benchmark's table."""
    print(
        f"attention {r['layer']:3} {r['kv']:5} {r['phase']:7} T {r['batch']:4} ctx {r['context']:6} "
        f"keys {r['keys']:5}: "
        f"triton {r['ms']:8.4f} ms ({100 * r['roofline_ms'] / r['ms']:5.1f}%)  "
        + attention_tilelang.describe(r)
        + f"roofline {r['roofline_ms']:8.4f} ms  [{r['plan']}]"
        + (f"  err {r['max_abs_err']:.2e}" if "max_abs_err" in r else "")
        + attention_tilelang.errors(r)
    )


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU is visible; run this on a GPU machine", file=sys.stderr)
        return 2
    timer = Timer(a.iters, a.warmup, graphs=not a.no_graphs, flush=not a.no_flush)
    if a.peak_bytes:
        gpu = f"given (--peak-bytes {a.peak_bytes:g})"
    else:
        a.peak_bytes, gpu = device_peak_bytes()
    results: dict = {
        **gpu_run_header("cuda_sm100 attention kernels (sparse_attention, indexer_topk)", local_time=True),
        "graphs": not a.no_graphs,
        "l2_flush": not a.no_flush,
        "roofline_gpu": gpu,
        "peak_bytes_per_s": a.peak_bytes,
        "peak_flops": PEAK_FLOPS,
    }
    a.output.parent.mkdir(parents=True, exist_ok=True)

    def saved() -> None:
        a.output.write_text(json.dumps(results, indent=2) + "\n")

    if a.only in (None, "attention"):
        bench_attention(a, timer, results.setdefault("attention", []), saved)
    if a.only in (None, "indexer"):
        indexer_bench.bench_indexer(a, timer, results.setdefault("indexer", []), saved)
    if a.write_choices and results.get("attention"):
        print(f"wrote {choice_writers.write_attention_choices(results)}")
    if a.write_choices and results.get("indexer"):
        print(f"wrote {choice_writers.write_select_choices(results['indexer'])}")
        print(f"wrote {choice_writers.write_score_choices(results['indexer'])}")
    saved()
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    run_main(main)
