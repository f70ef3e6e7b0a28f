"""The parallel layout of one process: ranks, sizes and process groups.

Ranks are laid out ``rank = dp_rank * cp_size + cp_rank``: each data-parallel replica is a
context-parallel group of ``cp_size`` consecutive ranks (one scheduler, on its ``cp_rank`` 0);
with ``enable_expert_parallel`` the expert-parallel group is the whole world (every rank holds
``1 / world_size`` of the experts and runs every step, real or dummy, so the dispatch and
combine collectives line up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelState:
    """One process's place in a distributed run.

    Attributes:
        rank, world_size: in the default process group.
        dp_rank, dp_size: the data-parallel replica (a CP group) and the number of replicas.
        cp_rank, cp_size: the rank inside its context-parallel group, and the group's size.
        ep_rank, ep_size: the rank in the expert-parallel group and its size (``ep_size == 1``:
            every rank holds every expert).
        device: this rank's torch device.
        device_group: the default group on the device backend (``nccl`` / ``hccl`` / ``gloo``):
            tensor collectives of the forward (EP dispatch/combine, CP exchanges).
        cpu_group: a ``gloo`` group over every rank for host-side messages (requests, outputs,
            load statistics); the device group itself when that is gloo.
        cp_group: the device group of this rank's context-parallel group (``None`` when
            ``cp_size == 1``).
        ep_group: the device group of the expert-parallel ranks (``None`` when ``ep_size == 1``).
    """

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    device_group: Any = None
    cpu_group: Any = None
    cp_group: Any = None
    ep_group: Any = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: the process the offline API (``LLM``) runs in."""
        return self.rank == 0

    @property
    def is_cp_leader(self) -> bool:
        """The rank of its CP group that schedules the group's requests."""
        return self.cp_rank == 0

    @property
    def expert_parallel(self) -> bool:
        """Whether experts are sharded across ranks."""
        return self.ep_size > 1

    @staticmethod
    def layout(rank: int, dp_size: int, cp_size: int, expert_parallel: bool) -> dict[str, int]:
        """The sizes and ranks of ``rank`` in a ``dp_size x cp_size`` world (no groups)."""
        world = dp_size * cp_size
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world} ({dp_size} DP x {cp_size} CP)")
        return {
            "rank": rank,
            "world_size": world,
            "dp_rank": rank // cp_size,
            "dp_size": dp_size,
            "cp_rank": rank % cp_size,
            "cp_size": cp_size,
            "ep_rank": rank if expert_parallel else 0,
            "ep_size": world if expert_parallel else 1,
        }
