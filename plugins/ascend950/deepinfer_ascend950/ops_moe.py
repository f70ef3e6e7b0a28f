"""Ascend 950 ops of the MoE and linear side (``torch_npu`` fused operators):

================== ====================================================== ========================
op                 operator(s)                                            module
================== ====================================================== ========================
``moe_route``      ``npu_moe_gating_top_k`` (top-k with bias; hash mode)  :mod:`.moe_routing`
``linear``         ``npu_dynamic_mx_quant`` + ``npu_quant_matmul`` (MXFP8) :mod:`.linear_mx`
``grouped_linear`` ``npu_dynamic_mx_quant`` + ``npu_grouped_matmul``      :mod:`.grouped_linear_mx`
                   (MxA8W8, one group per weight block)
``moe_experts``    ``npu_dynamic_mx_quant`` + ``npu_grouped_matmul``      :mod:`.moe_mx_experts`
                   (MXFP4 experts x MXFP8 activations)
================== ====================================================== ========================

``linear``, ``grouped_linear`` and ``moe_experts`` take the MX path only with
``DEEPINFER_ASCEND950_MX_ACTIVATIONS=1`` (:mod:`.quant_mx`: it quantises activations, beyond the
contract's tolerances).  Every case an op's ``supports`` rejects, and every op not listed
(``swiglu``, ``moe_dispatch`` / ``moe_combine``, ``embedding``, ``tile_matmul``), runs the
core's reference.

**No weight-only FP8 path.**  A linear that keeps the activations unquantised would need a
weight-only ("antiquant") matmul taking FP8 e4m3 weights with scales that vary along K.  The 950
documents none: ``aclnnWeightQuantBatchMatmulV2`` (``npu_weight_quant_batchmatmul``;
``matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2.md`` in cann/ops-nn,
section Ascend 950PR/950DT) takes FLOAT8_E4M3FN / HIFLOAT8 weights in per-channel mode only
(``antiquantScale`` ``(n,)`` in x's dtype, group size 0) and its MX mode (FLOAT8_E8M0 scales,
group size 32) for FLOAT4_E2M1 weights only; ``npu_grouped_matmul``'s weight-only modes on the
950 (table 4 of ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md`` in
Ascend/op-plugin) are the same: per-channel for FP8, "mx" for FP4.  A 128x128 (or 32x32) block
weight has a different scale per block of K, so a per-channel operator would need one call (or
one group, with a re-laid-out copy of the weight) per block column and a rounding of each
partial product to x's dtype: no memory saved against weights dequantised at load, and not the
contract's arithmetic.  Without the MX switch FP8 weights therefore stay with the reference,
dequantised at load (the backend declares no ``quantized_weights`` then, see :mod:`.plugin`).

**No expert-parallel dispatch/combine.**  ``npu_moe_distribute_dispatch_v2`` / ``combine_v2``
(``docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_distribute_dispatch_v2.md`` and
``..._combine_v2.md`` in Ascend/op-plugin) cannot carry the core's ``moe_dispatch`` /
``moe_combine`` contract (:mod:`deepinfer_core.ops.expert_parallel`): (1) the pages list Atlas
A2 / A3 only, not the 950; (2) the order of the received rows within one expert is not
documented, and ``assist_info_for_combine`` / ``ep_recv_counts`` / ``expand_scales`` "may differ
by product, algorithm and version" and must not be relied on, while the contract fixes the order
(ascending local expert, then source rank, then source pair); (3) the routing weight of each
received row (the contract's ``recv_weights``) comes back as ``expand_scales`` only on A2 and on
A3's ``"hierarchy"`` algorithm (``None`` otherwise); (4) ``x`` is bfloat16/float16 only and the
quantised exchange is int8 per token (``quant_mode=2``), not the contract's FP8 e4m3 with one
float32 scale per 128 channels; (5) ``combine_v2`` weights and adds the contributions itself
(``Sum(expert_scales * ata_out + shared_expert_x)``) in an unstated order, where the contract's
rows already carry their weights and are added in ascending logical expert order; (6) H, BS and
K are bounded (A3: H in [1024, 8192], BS <= 512, K <= 16).  Both ops run the reference
(``all_to_all_single`` over the process group, HCCL on NPUs).
"""

from __future__ import annotations

from deepinfer_ascend950 import grouped_linear_mx, linear_mx, moe_mx_experts, moe_routing
from deepinfer_core.ops import OpImpl

OPS: dict = {
    "moe_route": OpImpl(
        fn=moe_routing.moe_route, supports=moe_routing.supports, sample_cases=moe_routing.route_cases
    ),
    "linear": OpImpl(fn=linear_mx.linear, supports=linear_mx.supports, sample_cases=linear_mx.linear_cases),
    "grouped_linear": OpImpl(
        fn=grouped_linear_mx.grouped_linear,
        supports=grouped_linear_mx.supports,
        sample_cases=grouped_linear_mx.grouped_cases,
    ),
    "moe_experts": OpImpl(
        fn=moe_mx_experts.moe_experts,
        supports=moe_mx_experts.supports,
        sample_cases=moe_mx_experts.experts_cases,
    ),
}
