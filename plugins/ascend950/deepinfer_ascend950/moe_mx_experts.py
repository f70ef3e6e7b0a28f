"""``moe_experts`` with FP4 expert stacks as MXFP4-weight x MXFP8-activation grouped matmuls
(``npu_dynamic_mx_quant`` + ``npu_grouped_matmul``), the SwiGLU between them, then the combine.

Per call: the (token, expert) pairs are sorted by expert (stable, on the device: no host sync),
the group ends come from ``searchsorted`` (``group_list_type=0``, cumulative), the pairs' rows
are quantised to MXFP8 and multiplied by ``gate_up`` (the checkpoint's packed e2m1 bytes
``[E, 2I, D/2]`` passed as the transposed view ``[E, D/2, 2I]`` with
``weight_dtype=torch_npu.float4_e2m1fn_x2``; the per-32 E8M0 scales paired and viewed alike,
``[E, ceil(D/64), 2I, 2]``), the clamped SwiGLU runs in torch, its output is quantised again and
multiplied by ``down``; each pair's result is weighted, and a token's contributions are added in
ascending expert order with the arithmetic of the reference's combine
(:func:`~deepinfer_core.ops.moe_paths.expert_order_sum`), then the shared expert's output.
Ids outside ``[0, E)`` (expert-parallel padding rows) are routed to expert 0 with weight 0.

Enabled by ``DEEPINFER_ASCEND950_MX_ACTIVATIONS=1`` (:mod:`.quant_mx`): the activation
quantisation puts the result outside the contract's tolerances.  Plain (unquantised) stacks,
float32 FP4 scales and mixed stacks take the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_ascend950.npu import torch_npu
from deepinfer_ascend950.quant_mx import (
    MX_OFF_REASON,
    fp4_experts_problem,
    mx_activations_enabled,
    paired,
    quantize_activations,
)
from deepinfer_core.ops.moe_paths import expert_order_sum

Verdict = bool | str
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 1024
"""Most groups ``npu_grouped_matmul`` takes in one call."""


def _grouped(npu, rows: torch.Tensor, stack, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``rows [P, K]`` (sorted by expert) times their experts of the FP4 ``stack [E, N, K]``."""
    xq, xs = quantize_activations(rows)
    weight = stack.data.transpose(1, 2)  # [E, K/2, N]: the stored (E, N, K/2) bytes, transposed
    scale = paired(stack.scale).transpose(1, 2)  # [E, ceil(K/64), N, 2], transposed alike
    return npu.npu_grouped_matmul(
        [xq],
        [weight],
        scale=[scale],
        per_token_scale=[xs],
        group_list=ends,
        split_item=3,
        group_type=0,
        group_list_type=0,
        output_dtype=out_dtype,
        weight_dtype=npu.float4_e2m1fn_x2,
        scale_dtype=npu.float8_e8m0fnu,
        per_token_scale_dtype=npu.float8_e8m0fnu,
    )[0]


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up,
    down,
    limit: float,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """The contract's ``moe_experts`` with FP4 experts, in MXFP4 x MXFP8 (see the module docstring)."""
    npu = torch_npu()
    t, top_k = ids.shape
    e = gate_up.shape[0]
    valid = (ids >= 0) & (ids < e)
    ids = torch.where(valid, ids, 0).long()
    weights = torch.where(valid, weights, 0.0)
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(e, device=x.device), right=True)
    rows = x.index_select(0, order // top_k)
    h = _grouped(npu, rows, gate_up, ends, x.dtype)
    gate, up = h.chunk(2, dim=-1)
    h = F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
    y = _grouped(npu, h, down, ends, x.dtype)
    y = y * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
    contrib = torch.empty_like(y).index_copy_(0, order, y).view(t, top_k, -1)
    routed = expert_order_sum(contrib, ids)
    return routed if shared is None else routed + shared


def supports(x, ids, weights, gate_up, down, limit, shared=None) -> Verdict:
    """The MX path is on and both stacks are FP4 ones it reads; shapes and dtypes only."""
    if not mx_activations_enabled():
        return MX_OFF_REASON
    for name, w in (("gate_up", gate_up), ("down", down)):
        problem = fp4_experts_problem(w)
        if problem:
            return f"{name}: {problem}"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        return "x must be a [T, D] float32/bfloat16/float16 tensor"
    t, d = x.shape
    if ids.dim() != 2 or ids.shape[0] != t or ids.dtype not in (torch.int32, torch.int64):
        return f"ids must be a [T={t}, k] integer tensor"
    if tuple(weights.shape) != tuple(ids.shape) or not weights.is_floating_point():
        return "weights must be a float tensor of ids' shape"
    e, two_i, _ = gate_up.shape
    if two_i % 2 or tuple(gate_up.shape) != (e, two_i, d) or tuple(down.shape) != (e, d, two_i // 2):
        got = f"{tuple(gate_up.shape)}, {tuple(down.shape)}"
        return f"stacks must be gate_up [E, 2I, D={d}] and down [E, D, I], got {got}"
    if not 1 <= e <= MAX_EXPERTS:
        return f"{e} experts: the grouped matmul takes 1..{MAX_EXPERTS} groups"
    if d % 32 or (two_i // 2) % 32:
        return f"D={d} and I={two_i // 2} must be multiples of 32 (the MX group)"
    if shared is not None and (tuple(shared.shape) != (t, d) or shared.dtype != x.dtype):
        return f"shared must be a [{t}, {d}] {x.dtype} tensor"
    if t == 0:
        return "no tokens"
    return True


def experts_cases(g: torch.Generator, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """FP4 stacks with E8M0 scales: decode, a block with a token routed twice and the shared add,
    expert-parallel padding ids, and D/I whose group counts are odd (a padded scale pair)."""
    from deepinfer_core.ops._cases import randn_fp4

    def case(t: int, e: int, k: int, d: int, i: int, **kw) -> tuple[tuple, dict]:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g) + 0.1
        x = torch.randn(t, d, generator=g).to(dtype)
        gate_up = randn_fp4(g, e, 2 * i, d, scale=1.5 * d**-0.5, scale_dtype="ue8m0")
        down = randn_fp4(g, e, d, i, scale=i**-0.5, scale_dtype="ue8m0")
        return (x, ids, w, gate_up, down, 10.0), kw

    out = [case(1, 8, 3, 64, 32), case(19, 8, 3, 64, 64)]
    (x, ids, w, gu, dn, lim), _ = out[1]
    ids[0, 1] = ids[0, 0]
    out[1] = ((x, ids, w, gu, dn, lim), {"shared": torch.randn(*x.shape, generator=g).to(dtype)})
    (x, ids, w, gu, dn, lim), _ = case(6, 8, 2, 64, 32)
    ids[1] = -1
    ids[3, 0] = 8
    out.append(((x, ids, w, gu, dn, 0.75), {}))
    out.append(case(5, 4, 2, 96, 96))
    return out
