"""The EPLB runtime: rebalance the expert placement between engine steps and move the weights.

:class:`EplbController` is built by the engine when ``EngineConfig.eplb`` is set and called
after every step.  Each step it records the MoE's per-layer per-expert token counts into an
:class:`~.stats.ExpertLoadWindow` (device ops only).  Every ``rebalance_interval`` steps it

1. all-reduces the window's load over the expert-parallel group (the same step on every rank:
   the ranks of an expert-parallel run step in lockstep),
2. computes a new placement with :func:`~.policy.rebalance_experts` (the configured policy,
   ``num_gpus`` = the EP size) and aligns it with the current one (:func:`~.weight_move.align_placement`:
   the same per-GPU sets, permuted so that experts already on a rank keep their slot),
3. moves the weights (:func:`~.weight_move.move_expert_weights`): each rank receives the logical experts its
   new slots need and it lacks, point to point from a current holder, and rewrites its local
   expert stacks in place (same storage, so captured device graphs keep reading them),
4. swaps the placement (:meth:`ExpertPlacement.update`, in place as well).

Everything runs between two steps on the step's stream; the engine keeps its requests,
caches and schedule.  With ``layers_per_step`` the move is spread over the following steps, a
few layers after each, the placement published layer by layer (a rebalancing that falls due
while a move is in progress is skipped).  The loads, policy and plan are computed identically
on every rank, so no rank needs to tell another what it sends.

**What the model must expose** (duck-typed, see :func:`local_expert_weights` and
:func:`step_counts`): per MoE layer (placement layer ``l``), its local expert stacks — tensors
or :class:`~deepinfer_core.weights.quant.QuantizedTensor` (data and scale) whose leading
dimension is the rank's ``slots_per_rank`` slots in slot order; and an ``[L, E]`` int64 device
buffer of tokens routed to each logical expert that the MoE adds to during a step.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.contract.placement import ExpertPlacement
from deepinfer_core.weights.quant import Weight

from .policy import imbalance, rebalance_experts
from .stats import ExpertLoadWindow
from .weight_move import align_placement, move_expert_weights, weight_parts

logger = logging.getLogger("deepinfer.eplb")


# ---- the model's side --------------------------------------------------------------------------
def _moe_blocks(model: Any) -> list[Any]:
    """The MoE blocks of ``model.layers[i].moe`` (the DeepSeek-V4 models'), in layer order."""
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(layer, "moe") for layer in layers):
        raise TypeError(f"EPLB: {type(model).__name__} has neither expert_weights() nor layers[i].moe")
    return [layer.moe for layer in layers]


def local_expert_weights(model: Any) -> list[list[Weight]]:
    """Per MoE layer, the local expert stacks of ``model`` (leading dimension: local slots).

    ``model.expert_weights()`` when the model defines it; else ``[moe.gate_up, moe.down]`` of
    every ``model.layers[i].moe`` (the DeepSeek-V4 models' MoE blocks)."""
    if hasattr(model, "expert_weights"):
        return [list(ws) for ws in model.expert_weights()]
    return [[moe.gate_up, moe.down] for moe in _moe_blocks(model)]


def model_placement(model: Any) -> Any:
    """The expert placement the model's MoE blocks share (``model.layers[i].moe.placement``)."""
    placement = getattr(model, "placement", None)
    if placement is None:
        placement = next((m.placement for m in _moe_blocks(model) if m.placement is not None), None)
    if placement is None:
        raise TypeError(f"EPLB: {type(model).__name__} has no expert placement (is expert parallelism on?)")
    return placement


def step_counts(model: Any, num_layers: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """The ``[L, E]`` int64 buffer the MoE adds each step's routed (token, logical expert)
    pairs to: ``model.expert_counts`` when the model has one; else the ``expert_load`` of the
    ``model.layers[i].moe`` blocks, a zeroed buffer attached to all of them when they have none
    (attach before capturing device graphs, so the captured steps count too)."""
    counts = getattr(model, "expert_counts", None)
    if isinstance(counts, torch.Tensor):
        return counts
    blocks = _moe_blocks(model)
    counts = next((m.expert_load for m in blocks if m.expert_load is not None), None)
    if counts is None:
        counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
    for m in blocks:
        m.expert_load = counts
    return counts


def initial_placement(model_config: Any, ep_size: int, num_redundant: int) -> Any:
    """The placement an EPLB run loads its experts by: the default one
    (:meth:`ExpertPlacement.default`, experts in order, the redundant slots replicas of experts
    ``0, 1, ...``) over the model's MoE layers (``num_hidden_layers``) and routed experts
    (``n_routed_experts``)."""
    layers, experts = model_config.num_hidden_layers, model_config.n_routed_experts
    return ExpertPlacement.default(layers, experts, ep_size, num_redundant)


# ---- the controller ----------------------------------------------------------------------------
def infer_num_nodes(world_size: int) -> int:
    """Nodes of the launch: ``world_size / LOCAL_WORLD_SIZE`` under ``torchrun`` (1 when the
    variable is missing or does not divide the world).  The controller takes the largest value
    over the EP ranks, so all of them agree."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) > 0 and world_size % int(local) == 0:
        return world_size // int(local)
    return 1


CHECKS_KEPT = 16
"""Rebalancing checks an :class:`EplbController` keeps for its metrics (the latest ones)."""


class EplbController:
    """Expert-parallel load balancing of one rank: load window, periodic rebalancing and
    weight move (see the module docstring).

    Args:
        config: the :class:`~deepinfer_core.config.EPLBConfig`.
        placement: the model's :class:`~deepinfer_core.contract.placement.ExpertPlacement`
            (updated in place); ``None`` = the one its MoE blocks share (:func:`model_placement`).
        model: the model, exposing its local expert stacks (:func:`local_expert_weights`) and
            its step counts buffer (:func:`step_counts`), unless ``counts`` is given.
        parallel: this rank's :class:`~deepinfer_core.contract.parallel.ParallelState`
            (``ep_rank``, ``ep_size``, ``ep_group``).  Every EP rank builds its controller at
            the same point: without ``config.num_nodes`` the constructor all-reduces the nodes
            each rank infers (:func:`infer_num_nodes`) over the EP group.
        counts: the ``[L, E]`` int64 step buffer; ``None`` = found on the model or placement.
        num_groups: expert groups of the hierarchical policy (``None`` = one per expert: V4
            routes without group limits).
        layers_per_step: spread a rebalancing's weight move over steps, this many changed
            layers after each (the placement updated layer by layer, so every step routes by
            weights in place); ``None`` = every layer at once.

    Attributes:
        window: the :class:`ExpertLoadWindow`.
        steps: steps seen.
        rebalances: rebalancings done.
        last_ratio: ``(before, after)`` max/mean GPU load of the last rebalancing's window,
            under the old and the new placement.
        last_received: experts this rank received in the last weight move.
        moving: whether a spread move is in progress.
        checks: the last :data:`CHECKS_KEPT` rebalancing checks (``step``, max/mean GPU load of
            the window under the current placement ``imbalance_before`` and under the one the
            policy proposed ``imbalance_after``, whether it ``rebalanced``): a check's
            ``imbalance_before`` measures the traffic routed by the previous check's placement.
    """

    def __init__(
        self,
        config: Any,
        placement: Any,
        model: Any,
        parallel: Any,
        counts: torch.Tensor | None = None,
        num_groups: int | None = None,
        layers_per_step: int | None = None,
    ):
        if placement is None:
            placement = model_placement(model)
        self.config, self.placement, self.model, self.parallel = config, placement, model, parallel
        if config.num_redundant_experts != placement.num_redundant:
            raise ValueError(
                f"eplb.num_redundant_experts={config.num_redundant_experts} but the expert placement has "
                f"{placement.num_redundant} redundant slots"
            )
        L, E = placement.num_layers, placement.num_experts
        weights = local_expert_weights(model)
        if len(weights) != L:
            raise ValueError(f"EPLB: the model has {len(weights)} MoE layers, the expert placement {L}")
        device = weight_parts(weights[0][0])[0].device
        self.counts = counts if counts is not None else step_counts(model, L, E, device)
        if tuple(self.counts.shape) != (L, E):
            raise ValueError(
                f"EPLB: expert counts have shape {tuple(self.counts.shape)}, the placement is {(L, E)}"
            )
        self.window = ExpertLoadWindow(config.window_steps, L, E, self.counts.device)
        self.num_groups = num_groups or E
        ep = parallel.ep_size
        nodes = config.num_nodes
        if nodes is None:
            nodes = infer_num_nodes(ep)
            if ep > 1:  # every rank must compute the same placements: agree on the launch's nodes
                agreed = torch.tensor([nodes], dtype=torch.int64, device=self.counts.device)
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=parallel.ep_group)
                nodes = int(agreed)
        if config.policy == "hierarchical" and (ep % nodes or self.num_groups % nodes):
            if config.num_nodes is not None:
                raise ValueError(
                    f"eplb.num_nodes={nodes} must divide the EP size ({ep}) and the expert groups "
                    f"({self.num_groups}); use policy='global'"
                )
            nodes = 1
        self.num_nodes = nodes
        self.steps = 0
        self.rebalances = 0
        self.last_ratio: tuple[float, float] | None = None
        self.last_received = 0
        self.checks: deque[dict[str, Any]] = deque(maxlen=CHECKS_KEPT)
        if layers_per_step is not None and layers_per_step < 1:
            raise ValueError(f"EPLB: layers_per_step={layers_per_step} must be >= 1")
        self.layers_per_step = layers_per_step
        self._pending: torch.Tensor | None = None  # the placement a spread move is heading to

    def step(self) -> bool:
        """Record the step's counts; continue a move in progress (``layers_per_step``), or
        rebalance when the interval is reached.  Returns whether this call changed the
        placement."""
        self.window.record(self.counts, reset=True)
        self.steps += 1
        if self._pending is not None:
            self._move_next()
            return True
        if self.steps % self.config.rebalance_interval:
            return False
        return self.rebalance()

    @property
    def moving(self) -> bool:
        """Whether a rebalancing's weight move is still spread over the coming steps."""
        return self._pending is not None

    def rebalance(self) -> bool:
        """Rebalance now (every EP rank at once).  Returns whether the placement changed (with
        ``layers_per_step``: whether a move started; its first layers moved already)."""
        par = self.parallel
        load = self.window.global_load(par.ep_group if par.ep_size > 1 else None).cpu()
        if int(load.sum()) == 0 or self._pending is not None:
            return False
        old = self.placement.phy2log.clone()
        new, _, _ = rebalance_experts(
            load, self.placement.num_slots, self.num_groups, self.num_nodes, par.ep_size, self.config.policy
        )
        new = align_placement(old, new, par.ep_size, self.num_nodes)
        before, after = imbalance(load, old, par.ep_size), imbalance(load, new, par.ep_size)
        self.last_ratio = (before, after)
        self.checks.append(
            {
                "step": self.steps,
                "imbalance_before": before,
                "imbalance_after": after,
                "rebalanced": after < before,
            }
        )
        if after >= before:  # keep the layout (and the weights) when it is no better
            logger.info("EPLB: kept the placement (max/mean load %.3f, a new one %.3f)", before, after)
            return False
        self.last_received = 0
        self._pending = new
        self._move_next()
        self.rebalances += 1
        logger.info("EPLB: rebalancing at step %d: max/mean load %.3f -> %.3f", self.steps, before, after)
        return True

    def metrics_dict(self) -> dict[str, Any]:
        """This rank's EPLB figures, ``get_metrics()["eplb"]`` of the engine: ``steps`` seen,
        ``rebalance_interval`` and ``window_steps``, ``rebalances`` done, the last check's
        max/mean GPU load ``last_imbalance_before`` / ``last_imbalance_after`` (``None`` before
        the first), ``last_experts_received`` (this rank's, in the last move), ``moving`` and
        ``checks`` (see the class docstring).  The loads come from the all-reduced window, so
        every EP rank reports the same figures but its own ``last_experts_received``."""
        before, after = self.last_ratio if self.last_ratio is not None else (None, None)
        return {
            "steps": self.steps,
            "rebalance_interval": self.config.rebalance_interval,
            "window_steps": self.config.window_steps,
            "rebalances": self.rebalances,
            "last_imbalance_before": before,
            "last_imbalance_after": after,
            "last_experts_received": self.last_received,
            "moving": self.moving,
            "checks": [dict(c) for c in self.checks],
        }

    def _move_next(self) -> None:
        """Move the next ``layers_per_step`` changed layers (all of them without it) to the
        pending placement and publish them (the placement's other layers stay as they were)."""
        assert self._pending is not None
        current = self.placement.phy2log
        changed = [i for i in range(current.shape[0]) if not torch.equal(current[i], self._pending[i])]
        take = changed if self.layers_per_step is None else changed[: self.layers_per_step]
        target = current.clone()
        target[take] = self._pending[take]
        par = self.parallel
        self.last_received += move_expert_weights(
            current, target, local_expert_weights(self.model), par.ep_rank, par.ep_size, par.ep_group
        )
        self.placement.update(target)
        if len(take) == len(changed):
            self._pending = None
            logger.info("EPLB: weights moved (%d experts received)", self.last_received)
