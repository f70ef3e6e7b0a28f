"""EMULATOR of ``torch_npu.npu_moe_gating_top_k`` (MoE routing: norm, optional group filter, top-k
or hash lookup, renormalisation).  Tests only; see the package docstring.

Documents followed (facts, not code):

* D1 ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k.md`` in Ascend/op-plugin
  (the torch_npu signature, argument dtypes and shapes, the "equivalent computation" in fp32 with
  a *stable* descending sort, the three outputs);
* D2 ``moe/moe_gating_top_k/docs/aclnnMoeGatingTopKV2.md`` in cann/ops-transformer (the kernel
  behind the ``input_ids`` / ``tid2eid`` arguments: ``normType`` 2 = ``sqrt(softplus(x))``, the
  hash mode, and when ``yOut`` is renormalised);
* ``op_plugin/ops/opapi/MoeGatingTopKKernelNpuOpApi.cpp`` in Ascend/op-plugin (which aclnn entry
  a call reaches: V2 when both hash tensors are given, and its argument checks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_NORMS = {
    0: lambda x: torch.softmax(x, dim=-1),
    1: torch.sigmoid,
    2: lambda x: F.softplus(x).sqrt(),
}


def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EMULATOR: ``(y [T, k] in x's dtype, expert_idx [T, k] int32, norm_out [T, E] float32)``.

    Semantics (D1, D2): ``norm_out = norm(x)`` computed in float32 (softmax, sigmoid or
    sqrt-softplus for ``norm_type`` 0 / 1 / 2); the selection value is ``norm_out + bias``; with
    ``group_count > 1`` the experts are split into ``group_count`` groups, each scored by its max
    (``group_select_mode`` 0) or the sum of its two largest values (1), and only the best
    ``k_group`` groups stay candidates; the ``k`` largest candidates are picked, ties toward the
    lower expert id (D1's equivalent code sorts stably).  In hash mode (``input_ids`` and
    ``tid2eid`` both given) the picks are ``tid2eid[input_ids]`` and no sorting happens.  The
    weights are the *unbiased* ``norm_out`` at the picks, divided by their sum plus ``eps`` when
    ``norm_type`` is 1 or 2 (or 0 with ``renorm=1``), times ``routed_scaling_factor``.
    ``norm_out`` is returned only with ``out_flag`` (else an empty tensor here).

    Where the documents disagree or are silent:

    * D1 lists ``norm_type`` 0 and 1 only and says ``renorm`` supports only 0; D2 adds
      ``norm_type=2`` (sqrt-softplus) and ``renorm=1`` for softmax.  This emulator follows D2,
      the newer kernel the ``input_ids`` / ``tid2eid`` arguments of D1 already reach.
    * D1's equivalent code renormalises only for ``norm_type == 1`` and applies it in either
      mode; D2 renormalises for 1 and 2.  D2 is followed.
    * D2 restricts hash mode to ``k <= 64`` and the simple path (``k_group == group_count`` or
      ``group_count == E``); both are checked here.
    * Neither says in what precision ``y`` is renormalised before the cast to x's dtype; float32
      is assumed (``norm_out`` is documented as float32).
    """
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError(f"npu_moe_gating_top_k: x must be 2-D float16/bfloat16/float32, got {x.dtype}")
    t, e = x.shape
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (e,)):
        raise RuntimeError("npu_moe_gating_top_k: bias must be 1-D of x's last dim and x's dtype")
    if (input_ids is None) != (tid2eid is None):
        raise RuntimeError(
            "npu_moe_gating_top_k: input_ids and tid2eid must be both provided or both omitted"
        )
    if norm_type not in _NORMS:
        raise RuntimeError(f"npu_moe_gating_top_k: norm_type {norm_type} is not 0, 1 or 2")
    if group_count < 1 or e % group_count or not 1 <= k_group <= group_count:
        raise RuntimeError("npu_moe_gating_top_k: need group_count | E and 1 <= k_group <= group_count")
    if not 1 <= k <= e // group_count * k_group or e > 2048:
        raise RuntimeError(f"npu_moe_gating_top_k: k={k} out of range for E={e} (E <= 2048)")
    norm_out = _NORMS[norm_type](x.float())
    if tid2eid is not None:
        if tid2eid.dim() != 2 or tid2eid.shape[1] != k or k > 64:
            raise RuntimeError("npu_moe_gating_top_k: tid2eid must be [num_keys, k] with k <= 64")
        if input_ids.dim() != 1 or input_ids.shape[0] != t:
            raise RuntimeError("npu_moe_gating_top_k: input_ids must be 1-D with x's first dim")
        if not (k_group == group_count or group_count == e):
            raise RuntimeError("npu_moe_gating_top_k: hash mode takes only the simple path (no group filter)")
        idx = tid2eid.long()[input_ids.long()]
    else:
        value = norm_out + bias.float() if bias is not None else norm_out
        if group_count > 1:
            grouped = value.view(t, group_count, e // group_count)
            if group_select_mode == 0:
                score = grouped.amax(dim=-1)
            else:
                score = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(dim=-1)
            keep = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k_group]
            mask = torch.ones(t, group_count, dtype=torch.bool).scatter_(1, keep, False)
            value = grouped.masked_fill(mask[..., None], float("-inf")).view(t, e)
        idx = torch.sort(value, dim=-1, descending=True, stable=True).indices[:, :k]
    y = norm_out.gather(1, idx)
    if norm_type in (1, 2) or renorm == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    out = norm_out if out_flag else norm_out.new_empty(0)
    return y.to(x.dtype), idx.to(torch.int32), out


FUNCTIONS = {"npu_moe_gating_top_k": npu_moe_gating_top_k}
