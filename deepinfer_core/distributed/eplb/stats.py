"""Per-expert load statistics over a sliding window of steps."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ExpertLoadWindow:
    """The last ``window_steps`` steps of per-layer per-expert token counts, on the device.

    A ring buffer ``[window_steps, L, E]`` (int64): :meth:`record` copies one step's ``[L, E]``
    counts (the MoE's step buffer) into the next row, on the device and without reading
    anything back to the host, so it can sit on the step path (and after a captured graph).
    :meth:`load` sums the window; :meth:`global_load` adds every rank's window (an all-reduce,
    done at rebalancing time only).

    Args:
        window_steps: steps kept.
        num_layers, num_experts: the ``[L, E]`` shape of one step's counts.
        device: where the ring lives (that of the step buffer).
    """

    def __init__(
        self, window_steps: int, num_layers: int, num_experts: int, device: torch.device | str = "cpu"
    ):
        if window_steps < 1:
            raise ValueError(f"ExpertLoadWindow: window_steps={window_steps} must be >= 1")
        self.window_steps = window_steps
        self.ring = torch.zeros(window_steps, num_layers, num_experts, dtype=torch.int64, device=device)
        self.steps = 0  # steps recorded so far (host counter: no device read)

    @property
    def shape(self) -> tuple[int, int]:
        """``(L, E)``: the shape of one step's counts."""
        return (self.ring.shape[1], self.ring.shape[2])

    def record(self, counts: torch.Tensor, reset: bool = False) -> None:
        """Store one step's counts ``[L, E]`` (overwriting the oldest step once the window is
        full); ``reset``: then zero ``counts`` (a step buffer the MoE accumulates into)."""
        if tuple(counts.shape) != self.shape:
            shape = tuple(counts.shape)
            raise ValueError(f"ExpertLoadWindow.record: counts have shape {shape}, need {self.shape}")
        self.ring[self.steps % self.window_steps].copy_(counts, non_blocking=True)
        if reset:
            counts.zero_()
        self.steps += 1

    def load(self) -> torch.Tensor:
        """``[L, E]`` int64 tokens per expert over the window (this rank's), on the ring's device."""
        return self.ring.sum(0)

    def global_load(self, group: Any = None) -> torch.Tensor:
        """:meth:`load` summed over the ranks of ``group`` (a ``torch.distributed`` process group;
        ``None`` with no default group initialised = this rank's load alone)."""
        total = self.load()
        if group is not None or (dist.is_available() and dist.is_initialized()):
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    def clear(self) -> None:
        """Forget every recorded step."""
        self.ring.zero_()
        self.steps = 0
