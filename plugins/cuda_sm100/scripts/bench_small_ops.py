"""Time the ``cuda_sm100`` Triton kernels against the core's reference ops on a GPU.

Decode-sized calls (T = 1, 16, 64, 256 tokens by default) at DeepSeek-V4-Flash widths
(hidden 4096, 64 heads x 512, rope dim 64, hc_mult 4, shared expert 2048, vocabulary 129,280):
the norms, the rope (the attention's queries and keys, the indexer's queries, and the rope
channels alone of the attention output, a strided view) and its cos/sin tables, the mHC ops,
the shared expert's SwiGLU, V4.1's compressor pooling (``compress_pool``: the CSA and HCA
windows ``T`` tokens close), greedy sampling's ``argmax_rows`` over ``[T, vocabulary]``
float32 logits (the reference is ``torch.argmax``; fp32 whatever ``--dtype``, as the sampler
takes them) and ``cache_write`` of ``T`` rows into a packed FP8 KV pool
(``kv_cache_dtype="fp8"``; 592-byte rows).  Each implementation is timed with CUDA events
two ways: replaying a CUDA graph of ``--calls-per-graph`` back-to-back calls (GPU time per
call, launch overhead excluded), and eagerly (what a Python loop costs, launches included).
Prints a table and writes JSON (default ``benchmarks/results/cuda_sm100_small_ops.json`` at
the repository root).  ``--rope-heads 1,4,8,64`` also times the Triton ``apply_rope`` at that
many heads a program, each checked bit for bit against the default launch.

    python plugins/cuda_sm100/scripts/bench_small_ops.py [--tokens 1,16,64,256] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from graph_timing import gpu_run_header, time_graph

from deepinfer_core.benchmarking.harness import run_main
from deepinfer_core.ops import all_ops
from deepinfer_core.ops.kv_format import Fp8KVPool, PackedKVPool

REPO = Path(__file__).resolve().parents[3]
HIDDEN, HEADS, HEAD_DIM, ROPE_DIM, HC, Q_LORA = 4096, 64, 512, 64, 4, 1024
INDEX_DIM = 128  # the indexer's query head width (its last ROPE_DIM channels rotate)
SHARED_INTER = 2048  # the shared expert's intermediate width
VOCAB = 129280  # the logits' width (greedy sampling's argmax_rows)


def workloads(t: int, dtype: torch.dtype) -> list[tuple[str, str, tuple]]:
    """``(op, label, args)`` of the calls one V4-Flash layer makes with ``t`` tokens."""
    dev = "cuda"

    def randn(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dt)

    pos = torch.randint(0, 65536, (t,), device=dev).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE_DIM, 2, device=dev).float() / ROPE_DIM))
    cos, sin = (pos[:, None] * inv).cos().to(dtype), (pos[:, None] * inv).sin().to(dtype)
    k, m = HC * HIDDEN, (2 + HC) * HC
    fused = randn(t, Q_LORA + HEAD_DIM + ROPE_DIM)
    shared = randn(t, 2 * SHARED_INTER, scale=6)  # the shared expert's gate | up projection
    csa, hca = max(1, t // 4), max(1, t // 128)  # the compressor windows t tokens close
    return [
        (
            "rms_norm",
            f"[{t},{HIDDEN}] w",
            (randn(t, HIDDEN), 1 + randn(HIDDEN, dt=torch.float32, scale=0.1), 1e-6),
        ),
        (
            "rms_norm",
            f"q_a [{t},{Q_LORA}] strided",
            (fused[:, :Q_LORA], randn(Q_LORA, dt=torch.float32), 1e-6),
        ),
        ("rms_norm", f"[{t},{HEADS},{HEAD_DIM}]", (randn(t, HEADS, HEAD_DIM), None, 1e-6)),
        ("apply_rope", f"[{t},{HEADS + 1},{HEAD_DIM}]", (randn(t, HEADS + 1, HEAD_DIM), cos, sin)),
        ("apply_rope", f"indexer q [{t},{HEADS},{INDEX_DIM}]", (randn(t, HEADS, INDEX_DIM), cos, sin)),
        (
            "apply_rope",
            f"rope slice [{t},{HEADS},{HEAD_DIM}][..., -{ROPE_DIM}:]",
            (randn(t, HEADS, HEAD_DIM)[..., -ROPE_DIM:], cos, sin),
        ),
        ("rope_cos_sin", f"[{t}] x {ROPE_DIM // 2}", (pos.long(), inv, 1.0, dtype)),
        (  # V4.1's compressor: a CSA window of 2 x 4 rows closes per 4 tokens, an HCA one per 128
            "compress_pool",
            f"CSA [{csa},8,{HEAD_DIM}]",
            (randn(csa, 8, HEAD_DIM), randn(csa, 8, HEAD_DIM, dt=torch.float32)),
        ),
        (
            "compress_pool",
            f"HCA [{hca},128,{HEAD_DIM}]",
            (randn(hca, 128, HEAD_DIM), randn(hca, 128, HEAD_DIM, dt=torch.float32)),
        ),
        (
            "swiglu",
            f"[{t},{SHARED_INTER}] strided",
            (shared[:, :SHARED_INTER], shared[:, SHARED_INTER:], 10.0),
        ),
        (
            "hc_pre",
            f"[{t},{HC},{HIDDEN}]",
            (
                randn(t, HC, HIDDEN),
                randn(m, k, dt=torch.float32, scale=k**-0.5),
                randn(m, dt=torch.float32),
                1 + randn(3, dt=torch.float32, scale=0.1),
                1e-6,
                1e-6,
                20,
            ),
        ),
        (
            "hc_post",
            f"[{t},{HC},{HIDDEN}]",
            (
                randn(t, HIDDEN),
                randn(t, HC, HIDDEN),
                2 * randn(t, HC, dt=torch.float32).sigmoid(),
                randn(t, HC, HC, dt=torch.float32).softmax(-1),
            ),
        ),
        (
            "hc_head",
            f"[{t},{HC},{HIDDEN}]",
            (
                randn(t, HC, HIDDEN),
                randn(HC, k, dt=torch.float32, scale=k**-0.5),
                randn(HC, dt=torch.float32),
                randn(1, dt=torch.float32).abs(),
                1e-6,
                1e-6,
            ),
        ),
        ("argmax_rows", f"[{t},{VOCAB}] fp32 logits", (randn(t, VOCAB, dt=torch.float32, scale=4),)),
        (
            "cache_write",
            f"fp8 pool, {t} rows of {HEAD_DIM}",
            (
                Fp8KVPool.zeros(4 * 1024, HEAD_DIM, ROPE_DIM, dev),
                torch.randperm(4 * 1024, device=dev)[:t],
                randn(t, HEAD_DIM, scale=3),
            ),
        ),  # fmt: skip
    ]


def fresh(args: tuple) -> tuple:
    """``args`` with every tensor and packed pool copied (ops such as ``cache_write`` write into
    their first argument: the kernel's and the reference's results are compared on copies)."""

    def copy(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, PackedKVPool):
            return replace(x, data=x.data.clone())
        return x

    return tuple(copy(x) for x in args)


def time_eager(fn: Callable, args: tuple, iters: int) -> float:
    """Microseconds per call of a plain Python loop of calls (launch overhead included)."""
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def max_err(a, b) -> float:
    """Largest absolute difference over (nested) outputs (a packed pool: over its bytes)."""
    if isinstance(a, (tuple, list)):
        return max(max_err(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, PackedKVPool):
        a, b = a.data, b.data
    return float((a.double() - b.double()).abs().max())


def rope_heads(call_args: tuple, args: argparse.Namespace) -> dict[int, float]:
    """The Triton ``apply_rope`` timed (µs a call in a CUDA graph) at each ``--rope-heads`` count
    of heads a program, each output checked bit for bit against the default launch's; prints them."""
    from deepinfer_cuda_sm100.kernels import rope

    want = rope.apply_rope(*call_args)
    times = {}
    for heads in (int(v) for v in args.rope_heads.split(",")):
        got = rope.apply_rope(*call_args, heads_per_program=heads)
        if not torch.equal(got, want):
            raise SystemExit(f"apply_rope with {heads} heads a program differs from the default launch")
        times[heads] = time_graph(
            lambda i, h=heads: rope.apply_rope(*call_args, heads_per_program=h),
            args.calls_per_graph,
            args.replays,
        )
    print("    heads a program: " + ", ".join(f"{h}: {us:.1f} us" for h, us in times.items()))
    return times


def main() -> None:
    """Parse the arguments, time every workload, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256", help="comma-separated token counts")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--calls-per-graph", type=int, default=20)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--eager-iters", type=int, default=200)
    parser.add_argument(
        "--rope-heads",
        default="",
        help="also time the Triton apply_rope at these heads a program (e.g. 1,4,8,64), bits checked",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "cuda_sm100_small_ops.json"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this benchmark times GPU kernels")
    from deepinfer_cuda_sm100.backend import is_available
    from deepinfer_cuda_sm100.ops import load_ops

    ok, reason = is_available()
    if not ok:
        raise SystemExit(f"cuda_sm100 is unavailable: {reason}")
    dtype = getattr(torch, args.dtype)
    kernels, refs = load_ops(), all_ops()
    torch.manual_seed(0)
    rows = []
    header = (
        f"{'op':<11} {'shape':<36} {'ref graph us':>12} {'triton graph us':>15} {'speedup':>8} "
        f"{'ref eager us':>12} {'triton eager us':>15} {'max err':>9}"
    )
    print(header)
    print("-" * len(header))
    for t in (int(x) for x in args.tokens.split(",")):
        for op, label, call_args in workloads(t, dtype):
            impl, ref = kernels[op], refs[op].reference
            verdict = impl.supports(*call_args) if impl.supports else True
            if verdict is not True:
                print(f"{op:<11} {label:<36} kernel refuses: {verdict}")
                continue
            row = {"op": op, "shape": label, "tokens": t, "dtype": args.dtype}
            row["max_abs_err"] = max_err(impl.fn(*fresh(call_args)), ref(*fresh(call_args)))
            row["ref_graph_us"] = time_graph(
                lambda i, f=ref, a=call_args: f(*a), args.calls_per_graph, args.replays
            )
            row["triton_graph_us"] = time_graph(
                lambda i, f=impl.fn, a=call_args: f(*a), args.calls_per_graph, args.replays
            )
            row["ref_eager_us"] = time_eager(ref, call_args, args.eager_iters)
            row["triton_eager_us"] = time_eager(impl.fn, call_args, args.eager_iters)
            rg, kg = row["ref_graph_us"], row["triton_graph_us"]
            row["graph_speedup"] = rg / kg if rg and kg else None

            def fmt(v, width, spec=".1f"):
                return f"{v:>{width}{spec}}" if v is not None else f"{'n/a':>{width}}"

            print(
                f"{op:<11} {label:<36} {fmt(rg, 12)} {fmt(kg, 15)} {fmt(row['graph_speedup'], 7, '.2f')}x "
                f"{fmt(row['ref_eager_us'], 12)} {fmt(row['triton_eager_us'], 15)} {row['max_abs_err']:>9.2g}"
            )
            if op == "apply_rope" and args.rope_heads:
                row["rope_heads_us"] = rope_heads(call_args, args)
            rows.append(row)
    result = {
        **gpu_run_header("cuda_sm100 small ops vs reference"),
        "calls_per_graph": args.calls_per_graph,
        "replays": args.replays,
        "eager_iters": args.eager_iters,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
