"""cuBLAS's block-scaled FP8 GEMM through torch, DeepSeek's W8A8 scheme: ``x`` quantised per
token per 128 channels (:func:`~deepinfer_cuda_sm100.kernels.fp8_gemm.quantize_activations`,
the same kernel and numerics as the Triton W8A8 prefill), the weight's e4m3 bytes and 128x128
scales as stored, ``torch.nn.functional.scaled_mm`` with the ``BlockWise1x128`` /
``BlockWise128x128`` recipes (Hopper, cuBLASLt >= 12.9).

The layouts torch's CUDA source requires (aten/src/ATen/native/cuda/ScaledBlas.cpp): the
weight ``[K, N]`` column-major (the stored ``[N, K]`` transposed), the activation scales
``[M, K/128]`` outer-dim-major (strides ``(1, M)``), the weight scales ``[round_up(K/128, 4),
N/128]`` with strides ``(1, round_up(K/128, 4))`` (rows padded to 16 bytes).  The rows are
padded to a multiple of 16 (zero rows, scale 1; the output sliced back): cuBLASLt refused
other row counts on torch 2.11 (``plugins/cuda_sm100/scripts/bench_fp8_gemm.py`` tries every
layout and reports which runs).  Used by :mod:`deepinfer_cuda_sm100.gemm_dispatch` in the W8A8
prefill where the measured table says it is faster than Triton's W8A8 tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 16
"""Rows are padded to a multiple of this."""


def available() -> bool:
    """Whether this torch has the recipe-based ``scaled_mm``."""
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def activation_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[M, K/128]`` float32 activation scales with strides ``(1, M)``."""
    return torch.empty(scales.shape[1], scales.shape[0], device=scales.device).copy_(scales.t()).t()


def weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """The weight's ``[N/128, K/128]`` block scales (float32 or UE8M0) as the
    ``[round_up(K/128, 4), N/128]`` float32 operand with strides ``(1, round_up(K/128, 4))``."""
    nb, kb = scale.shape
    rows = torch.ones(nb, _round_up(kb, 4), device=scale.device)
    rows[:, :kb] = scale.float()
    return rows.t()


def scaled_mm_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """``linear(x, weight)`` in W8A8 on cuBLAS (see the module docstring); ``x`` bf16/fp16
    ``[..., K]``, ``weight`` an FP8 128x128-block ``QuantizedTensor`` ``[N, K]``."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import quantize_activations

    k = x.shape[-1]
    n = weight.data.shape[0]
    xq, xs = quantize_activations(x.reshape(-1, k))
    m = xq.shape[0]
    m_pad = _round_up(max(m, 1), ROW_MULTIPLE)
    if m_pad != m:
        xq = torch.cat([xq, xq.new_zeros(m_pad - m, k)])
        xs = torch.cat([xs, xs.new_ones(m_pad - m, xs.shape[1])])
    recipes = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    out = F.scaled_mm(
        xq,
        weight.data.t(),
        activation_scales(xs),
        recipes[0],
        weight_scales(weight.scale),
        recipes[1],
        output_dtype=x.dtype,
    )
    return out[:m].reshape(*x.shape[:-1], n)
