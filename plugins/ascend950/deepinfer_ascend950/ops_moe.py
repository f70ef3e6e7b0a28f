"""Ascend 950 ops of the MoE and linear side (``torch_npu`` fused operators):

============== ====================================================== ==========================
op             operator(s)                                            module
============== ====================================================== ==========================
``moe_route``  ``npu_moe_gating_top_k`` (top-k with bias; hash mode)  :mod:`.moe_routing`
``linear``     ``npu_dynamic_mx_quant`` + ``npu_quant_matmul`` (MXFP8) :mod:`.linear_mx`
``moe_experts`` ``npu_dynamic_mx_quant`` + ``npu_grouped_matmul``     :mod:`.moe_mx_experts`
               (MXFP4 experts x MXFP8 activations)
============== ====================================================== ==========================

``linear`` and ``moe_experts`` take the MX path only with ``DEEPINFER_ASCEND950_MX_ACTIVATIONS=1``
(:mod:`.quant_mx`: it quantises activations, beyond the contract's tolerances).  Every case an
op's ``supports`` rejects, and every op not listed (``grouped_linear``, ``swiglu``,
``moe_dispatch`` / ``moe_combine``, ``embedding``, ``tile_matmul``), runs the core's reference.
"""

from __future__ import annotations

from deepinfer_ascend950 import linear_mx, moe_mx_experts, moe_routing
from deepinfer_core.ops import OpImpl

OPS: dict = {
    "moe_route": OpImpl(
        fn=moe_routing.moe_route, supports=moe_routing.supports, sample_cases=moe_routing.route_cases
    ),
    "linear": OpImpl(fn=linear_mx.linear, supports=linear_mx.supports, sample_cases=linear_mx.linear_cases),
    "moe_experts": OpImpl(
        fn=moe_mx_experts.moe_experts,
        supports=moe_mx_experts.supports,
        sample_cases=moe_mx_experts.experts_cases,
    ),
}
