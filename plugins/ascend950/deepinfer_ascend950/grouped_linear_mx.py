"""``grouped_linear`` (V4's block-diagonal ``o_a`` projection) with an FP8 block-scaled weight as
one MXFP8 x MXFP8 grouped matmul: ``npu_dynamic_mx_quant`` (activations) then
``npu_grouped_matmul`` in its MxA8W8 mode (both operands float8_e4m3fn, E8M0 ``scale`` /
``per_token_scale``, one group of rows per weight block, ``group_type=0``).

The ``T`` tokens' ``G`` slices are laid out group-major (``[G * T, K]``, group ``g``'s rows
``g*T:(g+1)*T``, ``group_list`` = ``T`` rows each); the weight stays the checkpoint's bytes:
``[G*N, K]`` viewed as ``[G, N, K]`` and passed transposed (``[G, K, N]``), its per-32 E8M0 scales
(:func:`~deepinfer_ascend950.quant_mx.mx_weight_scale`: the block scales repeated, built once per
weight) viewed and transposed alike (``[G, ceil(K/64), N, 2]``).  Like ``linear``, enabled by
``DEEPINFER_ASCEND950_MX_ACTIVATIONS=1`` only (:mod:`.quant_mx`): the activation quantisation
is beyond the contract's tolerances.  Plain weights, float32 block scales and blocks whose input
width is not a multiple of 32 take the reference.
"""

from __future__ import annotations

import torch

from deepinfer_ascend950.moe_mx_experts import MAX_EXPERTS
from deepinfer_ascend950.npu import torch_npu
from deepinfer_ascend950.quant_mx import (
    MX_OFF_REASON,
    fp8_weight_problem,
    mx_activations_enabled,
    mx_weight_scale,
    quantize_activations,
)

Verdict = bool | str
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """The contract's ``grouped_linear`` (``[T, G, K]`` x ``[G*N, K]`` -> ``[T, G, N]``) in MXFP8."""
    npu = torch_npu()
    t, groups, k = x.shape
    n = weight.data.shape[0] // groups
    xq, xs = quantize_activations(x.transpose(0, 1).reshape(groups * t, k))
    w = weight.data.view(groups, n, k).transpose(1, 2)  # [G, K, N]: the stored bytes, transposed
    scale = mx_weight_scale(weight)
    scale = scale.view(groups, n, *scale.shape[1:]).transpose(1, 2)  # [G, ceil(K/64), N, 2]
    y = npu.npu_grouped_matmul(
        [xq],
        [w],
        scale=[scale],
        per_token_scale=[xs],
        group_list=torch.full((groups,), t, dtype=torch.int64, device=x.device),
        split_item=3,
        group_type=0,
        group_list_type=1,
        output_dtype=x.dtype,
        scale_dtype=npu.float8_e8m0fnu,
        per_token_scale_dtype=npu.float8_e8m0fnu,
    )[0]
    return y.view(groups, t, n).transpose(0, 1)


def supports(x, weight) -> Verdict:
    """The MX path is on and the weight is an FP8 weight it reads; shapes and dtypes only."""
    if not mx_activations_enabled():
        return MX_OFF_REASON
    problem = fp8_weight_problem(weight)
    if problem:
        return problem
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in FLOAT_DTYPES:
        return "x must be a [T, G, K] float32/bfloat16/float16 tensor"
    t, groups, k = x.shape
    rows = weight.data.shape[0]
    if weight.data.shape[1] != k or rows % groups:
        return f"weight {tuple(weight.data.shape)} is not [G*N, K] for x of G={groups}, K={k}"
    if not 1 <= groups <= MAX_EXPERTS:
        return f"{groups} groups: the grouped matmul takes 1..{MAX_EXPERTS}"
    if t == 0:
        return "no tokens"
    return True


def grouped_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """FP8 weights with E8M0 scales: V4's 128x128 blocks (groups of 128 rows; groups of 64 rows
    sharing a block), V4.1's 32x32 blocks, and a decode token."""
    from deepinfer_core.ops._cases import randn_fp8

    def x(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return [
        ((x(5, 2, 256), randn_fp8(g, 2 * 128, 256, scale=0.1, scale_dtype="ue8m0")), {}),
        ((x(3, 4, 128), randn_fp8(g, 4 * 64, 128, scale=0.1, scale_dtype="ue8m0")), {}),
        ((x(1, 2, 96), randn_fp8(g, 2 * 32, 96, scale=0.1, block=(32, 32), scale_dtype="ue8m0")), {}),
    ]
