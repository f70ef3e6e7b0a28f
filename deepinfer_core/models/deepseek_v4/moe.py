"""DeepSeek-V4 MoE block: hash-routed or ``noaux_tc`` top-k experts plus a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.ops import OpTable

from .config import DeepseekV4Config


class MoE:
    """The MoE block of layer ``layer``."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, w: dict[str, torch.Tensor]):
        p = f"model.layers.{layer}.mlp."
        self.cfg = cfg
        self.tid2eid = w.get(p + "gate.tid2eid")
        self.bias = w.get(p + "gate.e_score_correction_bias")
        self.gate_up, self.down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]
        s = p + "shared_experts."
        # router and shared-expert gate/up read the same input: one fused matmul
        parts = [w.pop(p + "gate.weight"), w.pop(s + "gate_proj.weight"), w.pop(s + "up_proj.weight")]
        self.w_in, self.in_sizes = torch.cat(parts), [t.shape[0] for t in parts]
        self.s_down = w[s + "down_proj.weight"]

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor, ops: OpTable) -> torch.Tensor:
        """``x`` ``[T, D]`` -> ``[T, D]``; ``input_ids`` ``[T]`` feed hash routing."""
        cfg = self.cfg
        logits, s_gate, s_up = ops.linear(x, self.w_in).split(self.in_sizes, dim=-1)
        fixed = F.embedding(input_ids, self.tid2eid) if self.tid2eid is not None else None
        weights, ids = ops.moe_route(
            logits, self.bias, fixed, cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor
        )
        routed = ops.moe_experts(x, ids, weights, self.gate_up, self.down, cfg.swiglu_limit)
        return routed + ops.linear(ops.swiglu(s_gate, s_up, cfg.swiglu_limit), self.s_down)
