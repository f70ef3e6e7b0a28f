"""Run the decode-shaped ``cuda_sm100`` kernels a few times, eagerly, for Nsight Compute.

The kernels whose speed targets docs/benchmarks.md measures: the FP8 block GEMM at M = 1 on
DeepSeek-V4-Flash's widest projection (8192 -> 4096) and on a narrow one (4096 -> 1024), and
the FP4 MoE kernels at 64 tokens (256 experts 4096 x 2048, top-6), Triton's and, when TileLang
can compile here, TileLang's (kernels ``moe_gate_up`` / ``moe_down``).  Profile with e.g.::

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy --section LaunchStats -k regex:"fp8_gemm|gate_up|down" \\
        --launch-skip 3 --launch-count 6 python plugins/cuda_sm100/scripts/ncu_targets.py

(``--launch-skip`` passes the warm-up launches that compile the kernels).
"""

from __future__ import annotations

import torch
from bench_moe import random_fp4, routings

from deepinfer_core.benchmarking.harness import run_main


def main() -> None:
    from deepinfer_cuda_sm100.kernels.fp8_gemm import linear_fp8
    from deepinfer_cuda_sm100.kernels.moe import moe_experts

    from deepinfer_core.weights.quant import QuantizedTensor, quant_fp8

    torch.manual_seed(0)
    for k, n in ((8192, 4096), (4096, 1024)):
        data, scale = quant_fp8(torch.randn(n, k, device="cuda") * k**-0.5, (128, 128), "fp32")
        w = QuantizedTensor(data, scale, "fp8", (128, 128))
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        for _ in range(3):
            linear_fp8(x, w)
    torch.cuda.synchronize()
    e, d, inter, k_top, t = 256, 4096, 2048, 6, 64
    gate_up, down = random_fp4(e, 2 * inter, d, 1), random_fp4(e, d, inter, 2)
    x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
    for ids, weights in routings(t, e, k_top, 3, 0):
        moe_experts(x, ids, weights, gate_up, down, 10.0)
    from deepinfer_cuda_sm100.tl import tilelang_problem

    if tilelang_problem() is None:
        from deepinfer_cuda_sm100.tl.moe import moe_experts as tilelang_moe

        for ids, weights in routings(t, e, k_top, 3, 0):
            tilelang_moe(x, ids, weights, gate_up, down, 10.0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    run_main(main)
