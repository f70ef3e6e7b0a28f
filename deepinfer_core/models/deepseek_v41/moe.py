"""The V4.1 MoE block: ``noaux_tc`` top-k routed experts (with the router temperature) plus a
shared expert."""

from __future__ import annotations

import torch

from deepinfer_core.models.deepseek_v4.fused import FusedProjection
from deepinfer_core.models.deepseek_v4.shared_expert import shared_expert
from deepinfer_core.ops import OpTable
from deepinfer_core.weights.quant import Weight

from .config import DeepseekV41Config


class MoE:
    """The MoE block of layer ``layer``: ``noaux_tc`` top-k routed experts plus a shared expert.
    ``prefix`` / ``top_k``: a DSpark draft layer's (``mtp.{j}.``, ``dspark_num_experts_per_tok``;
    its expert count is its stacks')."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        layer: int,
        w: dict[str, Weight],
        dtype: torch.dtype,
        prefix: str = "",
        top_k: int | None = None,
    ):
        p = (prefix or f"layers.{layer}.") + "ffn."
        self.cfg = cfg
        self.top_k = cfg.num_experts_per_tok if top_k is None else top_k
        self.bias = w[p + "gate.bias"]
        self.gate_up, self.down = w[p + "experts.gate_up"], w[p + "experts.down"]
        names = ("gate.weight", "shared_experts.w1.weight", "shared_experts.w3.weight")
        self.w_in = FusedProjection([(n, w.pop(p + n)) for n in names], dtype, p.removesuffix("."))
        self.s_down = w[p + "shared_experts.w2.weight"]

    def __call__(self, x: torch.Tensor, ops: OpTable) -> torch.Tensor:
        cfg = self.cfg
        # the shared expert on a side branch while the router and the routed experts run
        logits, shared = shared_expert(x, self.w_in, self.s_down, ops, cfg.swiglu_limit)
        if cfg.gate_temp != 1.0:
            logits = logits / cfg.gate_temp
        weights, ids = ops.moe_route(
            logits, self.bias, None, self.top_k, cfg.scoring_func, cfg.routed_scaling_factor
        )
        routed = ops.moe_experts(x, ids, weights, self.gate_up, self.down, cfg.swiglu_limit)
        return routed + shared.join()
