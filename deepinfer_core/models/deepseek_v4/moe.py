"""DeepSeek-V4 MoE block: hash-routed or ``noaux_tc`` top-k experts plus a shared expert.

With expert parallelism (``parallel.expert_parallel``) the block holds only its rank's routed
experts (the physical slots of :class:`~deepinfer_core.contract.placement.ExpertPlacement`,
stacked ``[S, 2I, D]`` / ``[S, D, I]``); routed pairs go to their experts' ranks and back through
the ``moe_dispatch`` / ``moe_combine`` ops.  The shared expert runs locally.  Inside
:func:`~deepinfer_core.ops.expert_parallel.fixed_dispatch_rows` ``(rows)`` (a decode graph of
``rows`` rows on every rank) the dispatch is the fixed-shape one with ``capacity = rows * k``
(no host sync: capturable); otherwise it is the dynamic one.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.contract.placement import EXPERT_PLACEMENT_KEY, ExpertPlacement
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.expert_parallel import dispatch_rows
from deepinfer_core.weights.quant import Weight

from .config import DeepseekV4Config
from .fused import FusedProjection
from .shared_expert import shared_expert

FP8_DISPATCH_ENV = "DEEPINFER_EP_FP8_DISPATCH"
"""``1``: expert-parallel dispatch sends the token rows as FP8 e4m3 with one scale per 128
channels (``moe_dispatch(fp8=True)``); read when the model is built."""


class MoE:
    """The MoE block of layer ``layer``.

    Attributes:
        gate_up, down: the routed experts held here: every expert, or with expert parallelism
            this rank's physical slots (EPLB replaces their rows in place between steps).
        placement: the model's shared :class:`ExpertPlacement` (``None`` without expert
            parallelism); read at every call, so a rebalanced layout takes effect at the next step.
        expert_load: ``None``, or a ``[L, E]`` int64 tensor on the device to which each call
            adds the (token, logical expert) pairs it routes for requests' rows (row
            ``layer``; padding rows are not load), without a host sync.
    """

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
        self.layer = layer
        # expert parallelism shards the main layers' experts; an MTP layer (layer >= L) keeps all
        ep = parallel is not None and parallel.expert_parallel and layer < cfg.num_hidden_layers
        self.placement: ExpertPlacement | None = w.get(EXPERT_PLACEMENT_KEY) if ep else None  # type: ignore[assignment]
        if ep and self.placement is None:
            raise ValueError(
                f"MoE layer {layer}: expert parallelism needs the weights loaded with parallel= "
                f"(no {EXPERT_PLACEMENT_KEY!r} in them)"
            )
        self.fp8_dispatch = os.environ.get(FP8_DISPATCH_ENV, "0") not in ("", "0")
        self.expert_load: torch.Tensor | None = None
        self.tid2eid = w.get(p + "gate.tid2eid")
        self.bias = w.get(p + "gate.e_score_correction_bias")
        self.gate_up, self.down = w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"]
        # router and shared-expert gate/up read the same input: one fused matmul (one per run of
        # parts of one format with keep_quantized, see .fused)
        names = ("gate.weight", "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight")
        self.w_in = FusedProjection([(n, w.pop(p + n)) for n in names], dtype, p.removesuffix("."))
        self.s_down = w[p + "shared_experts.down_proj.weight"]

    def __call__(
        self, x: torch.Tensor, input_ids: torch.Tensor, ops: OpTable, real: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` ``[T, D]`` -> ``[T, D]``; ``input_ids`` ``[T]`` feed hash routing; ``real``
        ``[T]`` bool marks the rows of requests (padding rows of a graph replay or a dummy
        step are routed too, but not counted in :attr:`expert_load`)."""
        cfg = self.cfg
        ep = self.placement is not None  # no second stream beside the expert-parallel exchange
        logits, shared = shared_expert(x, self.w_in, self.s_down, ops, cfg.swiglu_limit, overlap=not ep)
        fixed = F.embedding(input_ids, self.tid2eid) if self.tid2eid is not None else None
        weights, ids = ops.moe_route(
            logits, self.bias, fixed, cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor
        )
        if self.expert_load is not None and self.layer < self.expert_load.shape[0]:
            flat = ids.reshape(-1)
            ones = (
                torch.ones_like(flat)
                if real is None
                else real.to(flat.dtype).repeat_interleave(ids.shape[-1])
            )
            self.expert_load[self.layer].index_add_(0, flat, ones)
        if ep:
            return self._expert_parallel(x, ids, weights, ops) + shared.join()
        if shared.overlapped:  # the routed experts while the shared expert runs; the sum after both
            routed = ops.moe_experts(x, ids, weights, self.gate_up, self.down, cfg.swiglu_limit)
            return routed + shared.join()  # = moe_experts(shared=...) bit for bit (its contract)
        # the shared expert's output joins the routed sum in the op (a kernel fuses the add)
        return ops.moe_experts(
            x, ids, weights, self.gate_up, self.down, cfg.swiglu_limit, shared=shared.join()
        )

    def _expert_parallel(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ops: OpTable
    ) -> torch.Tensor:
        """The routed experts over the EP group: logical ids -> physical slots -> dispatch ->
        this rank's experts (one per received row) -> combine (in logical expert order)."""
        parallel, placement = self.parallel, self.placement
        assert parallel is not None and placement is not None
        group = parallel.ep_group if parallel.ep_group is not None else parallel.device_group
        slots = placement.physical(self.layer, ids, salt=parallel.ep_rank)
        rows = dispatch_rows()  # a fixed-shape step: every rank sends rows * k rows to every rank
        capacity = None if rows is None else rows * ids.shape[1]
        recv_x, recv_ids, recv_w, handle = ops.moe_dispatch(
            x, slots, weights, placement.slots_per_rank, group, fp8=self.fp8_dispatch, capacity=capacity
        )
        y = ops.moe_experts(
            recv_x, recv_ids[:, None], recv_w[:, None], self.gate_up, self.down, self.cfg.swiglu_limit
        )
        return ops.moe_combine(y, handle, ids)
