"""DeepSeek-V4 MoE block: hash-routed or ``noaux_tc`` top-k experts plus a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_core.distributed.state import ParallelState
from deepinfer_core.ops import OpTable
from deepinfer_core.weights.quant import Weight

from .config import DeepseekV4Config
from .fused import FusedProjection


class MoE:
    """The MoE block of layer ``layer``."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        layer: int,
        w: dict[str, Weight],
        dtype: torch.dtype,
        prefix: str | None = None,
        parallel: ParallelState | None = None,
    ):
        p = (prefix or f"model.layers.{layer}.") + "mlp."
        self.cfg = cfg
        self.parallel = parallel  # expert parallelism: the experts held are this rank's
        self.tid2eid = w.get(p + "gate.tid2eid")
        self.bias = w.get(p + "gate.e_score_correction_bias")
        self.gate_up, self.down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]
        # router and shared-expert gate/up read the same input: one fused matmul (one per run of
        # parts of one format with keep_quantized, see .fused)
        names = ("gate.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")
        self.w_in = FusedProjection([(n, w.pop(p + n)) for n in names], dtype, p.removesuffix("."))
        self.s_down = w[p + "shared_experts.down_proj.weight"]

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor, ops: OpTable) -> torch.Tensor:
        """``x`` ``[T, D]`` -> ``[T, D]``; ``input_ids`` ``[T]`` feed hash routing."""
        cfg = self.cfg
        logits, s_gate, s_up = self.w_in(x, ops)
        fixed = F.embedding(input_ids, self.tid2eid) if self.tid2eid is not None else None
        weights, ids = ops.moe_route(
            logits, self.bias, fixed, cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor
        )
        routed = ops.moe_experts(x, ids, weights, self.gate_up, self.down, cfg.swiglu_limit)
        return routed + ops.linear(ops.swiglu(s_gate, s_up, cfg.swiglu_limit), self.s_down)
