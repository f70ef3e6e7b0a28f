"""``linear`` with an FP8 block-scaled weight as an MXFP8 x MXFP8 matmul:
``npu_dynamic_mx_quant`` (activations, per token per 32 channels) then ``npu_quant_matmul`` in its
mx mode (``group_sizes=[1, 1, 32]``, E8M0 scales for both operands, output in x's dtype).

The weight stays as the checkpoint stored it: its ``[N, K]`` e4m3 bytes are passed as the
transposed view ``[K, N]`` and its block scales, repeated to one per 32 inputs
(:func:`~deepinfer_ascend950.quant_mx.mx_weight_scale`, built once per weight), as the matching
transposed view ``[ceil(K/64), N, 2]`` (the operator wants the weight and its scale transposed
alike).  Enabled by ``DEEPINFER_ASCEND950_MX_ACTIVATIONS=1`` (see :mod:`.quant_mx`); plain-tensor
weights, float32 block scales and blocks whose input width is not a multiple of 32 take the
reference.
"""

from __future__ import annotations

import torch

from deepinfer_ascend950.npu import torch_npu
from deepinfer_ascend950.quant_mx import (
    MX_OFF_REASON,
    fp8_weight_problem,
    mx_activations_enabled,
    mx_weight_scale,
    quantize_activations,
)

Verdict = bool | str
MX_GROUP_SIZES = [1, 1, 32]
"""``[group_m, group_n, group_k]`` of the mx mode: one scale per row per 32 values of K."""
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """The contract's ``linear`` (``y = x @ weight.T``) with an FP8 weight, in MXFP8."""
    npu = torch_npu()
    n, k = weight.data.shape
    rows = x.reshape(-1, k)
    xq, xs = quantize_activations(rows)
    y = npu.npu_quant_matmul(
        xq,
        weight.data.t(),
        mx_weight_scale(weight).transpose(0, 1),
        pertoken_scale=xs,
        scale_dtype=npu.float8_e8m0fnu,
        pertoken_scale_dtype=npu.float8_e8m0fnu,
        output_dtype=x.dtype,
        group_sizes=MX_GROUP_SIZES,
    )
    return y.reshape(*x.shape[:-1], n)


def supports(x, weight) -> Verdict:
    """The MX path is on and the weight is an FP8 weight it reads; shapes and dtypes only."""
    if not mx_activations_enabled():
        return MX_OFF_REASON
    problem = fp8_weight_problem(weight)
    if problem:
        return problem
    if not isinstance(x, torch.Tensor) or x.dtype not in OUTPUT_DTYPES or x.dim() < 1:
        return "x must be a float32/bfloat16/float16 tensor [..., K]"
    if x.shape[-1] != weight.data.shape[1]:
        return f"x has {x.shape[-1]} channels, the weight takes K={weight.data.shape[1]}"
    if x.numel() == 0:
        return "no rows"
    return True


def linear_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """FP8 weights with E8M0 scales: V4's 128x128 blocks (whole and partial edge tiles), V4.1's
    32x32 MXFP8 blocks, a decode row and a 3-D activation."""
    from deepinfer_core.ops._cases import randn_fp8

    def x(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return [
        ((x(7, 256), randn_fp8(g, 256, 256, scale=0.1, scale_dtype="ue8m0")), {}),
        ((x(5, 320), randn_fp8(g, 192, 320, scale=0.1, scale_dtype="ue8m0")), {}),
        ((x(1, 96), randn_fp8(g, 64, 96, scale=0.1, block=(32, 32), scale_dtype="ue8m0")), {}),
        ((x(2, 3, 128), randn_fp8(g, 48, 128, scale=0.1, scale_dtype="ue8m0")), {}),
    ]
