"""Where the routed experts live under expert parallelism: the physical expert slots of every
MoE layer and the logical expert each one holds.

Every MoE layer has ``P = num_experts + num_redundant`` physical slots spread over the
``ep_size`` ranks of the expert-parallel group, ``slots_per_rank = P / ep_size`` contiguous
slots a rank (rank ``r`` holds slots ``[r * S, (r + 1) * S)``).  ``phy2log[l, p]`` is the
logical expert held by slot ``p`` of layer ``l``; every logical expert has at least one slot
and the redundant slots hold *replicas* of (hot) experts.  Derived from it:

- ``log2phy [L, E, R]``: the slots of each logical expert, ascending, ``-1`` padded to
  ``R = num_redundant + 1`` (the most replicas an expert can have, so a new layout has the
  same shape);
- ``logcnt [L, E]``: how many slots each logical expert has.

A token's (token, expert) pair goes to replica ``(row + salt) % logcnt`` of its expert
(:meth:`ExpertPlacement.physical`): deterministic, computed on the device, spreading the rows
of a batch over the replicas.  Replicas hold identical weights, so the choice never changes a
result.

The load balancer (EPLB) computes a new ``phy2log`` and swaps the placement in between two
steps (:meth:`ExpertPlacement.update`); the MoE blocks hold a reference to the one placement of
their model and read it at each step.
"""

from __future__ import annotations

import torch

EXPERT_PLACEMENT_KEY = "expert_placement"
"""Key of the :class:`ExpertPlacement` in the weights an expert-parallel load returns (the
model's MoE blocks share it)."""


class ExpertPlacement:
    """The physical expert slots of every MoE layer and the logical expert each holds.

    Attributes:
        num_layers, num_experts, ep_size, num_redundant: the layout's sizes.
        num_slots: ``num_experts + num_redundant`` physical slots per layer.
        slots_per_rank: slots each EP rank holds (contiguous).
        phy2log: ``[L, P]`` int64, the logical expert of each slot.
        log2phy: ``[L, E, R]`` int64, each expert's slots ascending, ``-1`` padded.
        logcnt: ``[L, E]`` int64, each expert's number of slots.

    No ``__dict__`` (slots): the model's weight accounting, which walks object attributes,
    does not count the layout's small tables as weights.
    """

    __slots__ = (
        "num_layers", "num_experts", "ep_size", "num_slots", "num_redundant", "slots_per_rank",
        "phy2log", "log2phy", "logcnt", "_device",
    )  # fmt: skip

    def __init__(self, phy2log: torch.Tensor, num_experts: int, ep_size: int):
        """Validate ``phy2log`` (``[L, P]`` integer, every expert of ``[0, num_experts)`` in
        every layer, ``P`` a multiple of ``ep_size``) and derive ``log2phy`` / ``logcnt``.

        Raises ``ValueError`` naming the field and the first bad layer.
        """
        if num_experts < 1 or ep_size < 1:
            raise ValueError(
                f"ExpertPlacement: num_experts ({num_experts}) and ep_size ({ep_size}) must be >= 1"
            )
        if not isinstance(phy2log, torch.Tensor) or phy2log.dim() != 2 or phy2log.is_floating_point():
            raise ValueError("ExpertPlacement: phy2log must be an integer tensor [num_layers, num_slots]")
        num_layers, num_slots = phy2log.shape
        if num_slots < num_experts or num_slots % ep_size:
            raise ValueError(
                f"ExpertPlacement: phy2log has {num_slots} slots a layer; needs >= num_experts "
                f"({num_experts}) and a multiple of ep_size ({ep_size})"
            )
        phy2log = phy2log.to(device="cpu", dtype=torch.int64).contiguous()
        logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        for layer in range(num_layers):
            row = phy2log[layer]
            bad = (row < 0) | (row >= num_experts)
            if bool(bad.any()):
                slot = int(bad.nonzero()[0])
                raise ValueError(
                    f"ExpertPlacement: phy2log[{layer}, {slot}] = {int(row[slot])} is not an expert of "
                    f"[0, {num_experts})"
                )
            logcnt[layer] = torch.bincount(row, minlength=num_experts)
            if bool((logcnt[layer] == 0).any()):
                missing = int((logcnt[layer] == 0).nonzero()[0])
                raise ValueError(f"ExpertPlacement: phy2log layer {layer} has no slot for expert {missing}")
        replicas = num_slots - num_experts + 1  # the most any expert can have: a fixed shape
        log2phy = torch.full((num_layers, num_experts, replicas), -1, dtype=torch.int64)
        for layer in range(num_layers):
            order = torch.sort(phy2log[layer], stable=True)  # slots ascending within an expert
            starts = torch.cumsum(logcnt[layer], 0) - logcnt[layer]
            rank = torch.arange(num_slots) - starts.index_select(0, order.values)
            log2phy[layer, order.values, rank] = order.indices
        self.num_layers, self.num_experts, self.ep_size = num_layers, num_experts, ep_size
        self.num_slots, self.num_redundant = num_slots, num_slots - num_experts
        self.slots_per_rank = num_slots // ep_size
        self.phy2log, self.log2phy, self.logcnt = phy2log, log2phy, logcnt
        self._device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def default(
        cls, num_layers: int, num_experts: int, ep_size: int, num_redundant: int = 0
    ) -> ExpertPlacement:
        """Experts in order over the ranks (slot ``p`` holds expert ``p``), the
        ``num_redundant`` extra slots replicas of experts ``0, 1, ...`` (``num_experts +
        num_redundant`` must divide by ``ep_size``)."""
        if num_redundant < 0:
            raise ValueError(f"ExpertPlacement: num_redundant ({num_redundant}) must be >= 0")
        if (num_experts + num_redundant) % max(ep_size, 1):
            raise ValueError(
                f"ExpertPlacement: num_experts + num_redundant ({num_experts} + {num_redundant}) must be a "
                f"multiple of the EP size ({ep_size})"
            )
        row = torch.arange(num_experts + num_redundant, dtype=torch.int64) % max(num_experts, 1)
        return cls(row.expand(num_layers, -1).clone(), num_experts, ep_size)

    def rank_slots(self, rank: int) -> range:
        """The physical slots rank ``rank`` holds."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"ExpertPlacement: rank {rank} outside the EP group of {self.ep_size}")
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def local_logical(self, layer: int, rank: int) -> list[int]:
        """The logical expert of each of rank ``rank``'s slots in layer ``layer`` (slot order:
        the local expert ids the rank's weight stacks are indexed by)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"ExpertPlacement: layer {layer} outside [0, {self.num_layers})")
        slots = self.rank_slots(rank)
        return self.phy2log[layer, slots.start : slots.stop].tolist()

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._device:
            self._device[device] = (self.log2phy.to(device), self.logcnt.to(device))
        return self._device[device]

    def physical(self, layer: int, ids: torch.Tensor, salt: int = 0) -> torch.Tensor:
        """The physical slots ``[T, k]`` of logical expert ids ``ids [T, k]`` in layer
        ``layer``: replica ``(row + salt) % logcnt[e]`` of expert ``e`` for the pair in row
        ``row`` (deterministic, on the device, no host sync)."""
        log2phy, logcnt = self._on(ids.device)
        ids = ids.long()
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + salt
        replica = rows % logcnt[layer].index_select(0, ids.reshape(-1)).view(ids.shape)
        return log2phy[layer][ids, replica]

    def update(self, phy2log: torch.Tensor) -> None:
        """Replace the layout by a new ``phy2log`` of the same shape (validated as in the
        constructor); the caller moves the weights of the slots that changed."""
        new = ExpertPlacement(phy2log, self.num_experts, self.ep_size)
        if new.phy2log.shape != self.phy2log.shape:
            raise ValueError(
                f"ExpertPlacement.update: phy2log shape {tuple(new.phy2log.shape)} differs from "
                f"{tuple(self.phy2log.shape)}"
            )
        self.phy2log, self.log2phy, self.logcnt = new.phy2log, new.log2phy, new.logcnt
        for log2phy, logcnt in self._device.values():  # in place: captured graphs read the new layout
            log2phy.copy_(new.log2phy)
            logcnt.copy_(new.logcnt)

    def __repr__(self) -> str:
        return (
            f"ExpertPlacement(layers={self.num_layers}, experts={self.num_experts}, "
            f"redundant={self.num_redundant}, ep_size={self.ep_size})"
        )
