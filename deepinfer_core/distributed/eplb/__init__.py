"""Expert-parallel load balancing (EPLB): per-expert load statistics over a sliding window of
steps (:class:`ExpertLoadWindow`), placement policies with redundant experts
(:func:`rebalance_experts`: ``hierarchical`` or ``global``), and the runtime that rebalances
between engine steps (:mod:`.rebalance`) and moves the expert weights between ranks
(:mod:`.weight_move`).
See ``docs/distributed.md`` (EPLB)."""

from .policy import balanced_packing, gpu_loads, imbalance, log2phy_from, rebalance_experts, replicate_experts
from .rebalance import EplbController, initial_placement
from .stats import ExpertLoadWindow
from .weight_move import align_placement, move_expert_weights, plan_layer_moves

__all__ = [
    "EplbController",
    "ExpertLoadWindow",
    "align_placement",
    "move_expert_weights",
    "plan_layer_moves",
    "balanced_packing",
    "gpu_loads",
    "imbalance",
    "initial_placement",
    "log2phy_from",
    "rebalance_experts",
    "replicate_experts",
]
