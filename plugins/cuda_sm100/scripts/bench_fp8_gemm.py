"""Time the ``cuda_sm100`` FP8 block-scaled GEMM (``linear`` with a 128x128 FP8 weight) on a GPU.

For each ``(K, N)`` of DeepSeek-V4-Flash's dense projections and each token count ``M``, times
(CUDA events, replaying a CUDA graph of ``--calls-per-graph`` back-to-back calls, so launch
overhead is excluded):

* ``triton w8a16``: the registered kernel (bf16 x, FP8 weight tiles scaled in registers);
* ``triton w8a8``: the opt-in variant (x quantised per token per 128 channels in the kernel);
* ``scaled_mm``: ``torch._scaled_mm`` with block scales (1x128 activations, 128x128 weights) on
  pre-quantised FP8 activations (the GEMM alone; ``None`` where this torch / GPU lacks it);
* ``bf16 matmul``: cuBLAS on the dequantised bf16 weight.

Prints a table (us per call, TB/s of weight bytes read, TFLOP/s) and writes JSON (default
``benchmarks/results/bench_fp8_gemm.json`` at the repository root).

    python plugins/cuda_sm100/scripts/bench_fp8_gemm.py [--m 1,16,64] [--shapes 4096x1024,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from graph_timing import time_graph

REPO = Path(__file__).resolve().parents[3]
SHAPES = "4096x1024,1024x32768,4096x512,8192x4096,4096x2048,2048x4096"
TOKENS = "1,16,64,128,256,1024,4096,8192"


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as e4m3 with one fp32 scale per (row, 128 channels): ``[M, K/128]``."""
    m, k = x.shape
    xb = x.float().view(m, k // 128, 128)
    s = xb.abs().amax(-1).clamp(min=1e-12) / 448.0
    return (xb / s[..., None]).to(torch.float8_e4m3fn).view(m, k), s


def scaled_mm_call(x: torch.Tensor, w) -> Callable | None:
    """A ``torch._scaled_mm`` call with 1x128 / 128x128 block scales, or ``None`` if unsupported.

    The scale layouts it wants have changed between torch versions: try the known ones.
    """
    if not hasattr(torch, "_scaled_mm"):
        return None
    xq, xs = quantize_activations(x)
    b = w.data.t()  # [K, N], column-major
    ws = w.scale.float()  # [N/128, K/128]
    layouts = (
        (xs.t().contiguous().t(), ws.t()),  # M-major activation scales, [K/128, N/128] weight scales
        (xs.t().contiguous().t(), ws.t().contiguous()),
        (xs.contiguous(), ws.contiguous()),
        (xs.t().contiguous().t(), ws.contiguous()),
    )
    for sa, sb in layouts:
        try:

            def call(sa=sa, sb=sb):
                return torch._scaled_mm(xq, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

            call()
            torch.cuda.synchronize()
            call.__name__ = "scaled_mm"
            return call
        except Exception as exc:  # the next layout
            last = exc
    print(f"  (torch._scaled_mm block scaling unavailable: {type(last).__name__}: {str(last)[:160]})")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default=TOKENS, help=f"token counts M (default {TOKENS})")
    parser.add_argument("--shapes", default=SHAPES, help=f"KxN weight shapes (default {SHAPES})")
    parser.add_argument("--calls-per-graph", type=int, default=20)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bench_fp8_gemm.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    from deepinfer_cuda_sm100.kernels.fp8_gemm import launch_shape, linear_fp8, linear_fp8_w8a8

    from deepinfer_core.weights.quant import QuantizedTensor, quant_fp8

    tokens = [int(t) for t in args.m.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    head = (
        f"{'K x N':<12} {'M':>5} {'tile/splits':>12} "
        + " ".join(f"{name + ' us':>16}" for name in ("triton w8a16", "triton w8a8", "scaled_mm", "bf16"))
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
                "scaled_mm": scaled_mm_call(x, w),
                "bf16_matmul": lambda x=x, d=dense: x @ d.t(),
            }
            times = {
                name: (
                    time_graph(lambda i, fn=fn: fn(), args.calls_per_graph, args.replays)
                    if fn is not None
                    else None
                )
                for name, fn in calls.items()
            }
            err = float((linear_fp8(x, w).float() - (x @ dense.t()).float()).abs().max())
            bm, bn, splits = launch_shape(m, n, k)
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
                    2 * m * n * k / (tb * 1e-6) / 1e12 if (tb := times["bf16_matmul_us"]) else None
                ),
                "w8a16_max_abs_err_vs_bf16": err,
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
    import triton

    result = {
        "benchmark": "cuda_sm100 FP8 block GEMM vs torch._scaled_mm and bf16 matmul",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "calls_per_graph": args.calls_per_graph,
        "replays": args.replays,
        "note": "scaled_mm times the GEMM on pre-quantised activations; triton w8a8 quantises in-kernel",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
