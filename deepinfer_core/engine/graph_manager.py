"""The one owner of a runner's device graphs: captured and replayed by ``(family, bucket)``.

A *family* is a kind of fixed-shape step (the runner's ``decode``, ``verify`` and ``mixed``
steps, and any family a draft model captures: ``mtp``, ``dspark``, a plugin's), a *bucket*
its padded size (requests, or tokens for ``mixed``).  :meth:`GraphManager.capture` records a
list of :class:`GraphPlan` (largest first: the others reuse its memory pool) and installs them
all or none; :meth:`GraphManager.bucket` finds the smallest captured bucket holding a step and
:meth:`GraphManager.replay` runs it.  Under expert parallelism every rank keeps the same graphs
and replays the same bucket (:meth:`agree_captured`, :meth:`agree_bucket`: collectives were
captured).  The graph mechanism itself is :mod:`~deepinfer_core.engine.graphs`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.devices import synchronize
from deepinfer_core.ops.overlap import observe_branches, turn_off

from .graphs import DeviceGraph, GraphFactory, device_graph_factory


@dataclass(frozen=True)
class GraphPlan:
    """One graph to capture.

    Attributes:
        family: the family's name.
        bucket: the bucket it serves.
        size: its tokens (the capture order: largest first).
        make: prepares the step's inputs (in the runner's fixed buffers) and returns the step,
            called right before the capture.
        label: names the graph in an error (``"batch-4 decode"``).
    """

    family: str
    bucket: int
    size: int
    make: Callable[[], Callable[[], Any]]
    label: str


class GraphManager:
    """Every captured graph of one runner, by family and bucket (see the module docstring).

    Args:
        device: the runner's device.
        cpu_group: the gloo group of an expert-parallel run whose decode graphs capture
            collectives (``None`` otherwise): ranks then agree on what they capture and replay.
    """

    def __init__(self, device: torch.device, cpu_group: Any = None) -> None:
        self.device = device
        self.cpu_group = cpu_group
        self.factory: GraphFactory | None = None
        self.pool: object | None = None
        self._families: dict[str, dict[int, DeviceGraph]] = {}
        self.ep_stats = {"replayed": 0, "padded_to_peer": 0, "dummy": 0, "eager": 0}
        """Expert parallelism: steps whose agreed bucket was replayed (``replayed``;
        ``padded_to_peer`` of them to a larger bucket than this rank needed, ``dummy`` of them
        on padding rows only) and steps agreed to run eagerly (``eager``)."""

    def start(self, factory: GraphFactory | None = None, pool: object | None = None) -> str | None:
        """Choose the graph implementation (``None``: the device's own, with its shared memory
        pool); returns ``None``, or why the device has none."""
        if factory is None:
            factory, pool, reason = device_graph_factory(self.device)
            if factory is None:
                return reason
        self.factory, self.pool = factory, pool
        return None

    def graphs(self, family: str) -> dict[int, DeviceGraph]:
        """The captured graphs of ``family`` by bucket (empty when none)."""
        return self._families.get(family, {})

    def summary(self) -> dict[str, list[int]]:
        """The captured buckets of every family."""
        return {name: sorted(g) for name, g in self._families.items() if g}

    def bucket(self, family: str, n: int) -> int | None:
        """The smallest captured bucket of ``family`` holding ``n``, or ``None``."""
        return smallest_bucket(self.graphs(family), n)

    def replay(self, family: str, bucket: int) -> Any:
        """Replay ``family``'s graph of ``bucket``; its output buffers."""
        return self._families[family][bucket].replay()

    def capture(self, plans: list[GraphPlan], *, agree: bool = False) -> str | None:
        """Capture ``plans``, largest first; installed only when all were captured.  Returns
        ``None``, or why a capture failed.  ``agree``: every expert-parallel rank keeps its
        graphs or none does (:meth:`agree_captured` after each capture)."""
        assert self.factory is not None, "GraphManager.start first"
        captured: dict[str, dict[int, DeviceGraph]] = {}
        for plan in sorted(plans, key=lambda p: -p.size):
            step = plan.make()
            error = None
            try:
                captured.setdefault(plan.family, {})[plan.bucket] = self._capture_step(step, plan.label)
            except Exception as e:  # an op that cannot be captured: run eagerly, and say so
                error = f"{type(e).__name__}: {e}"
            if agree:
                error = self.agree_captured(error)
            if error is not None:
                return f"capturing the {plan.label} graph failed ({error})"
        for name, graphs in captured.items():
            self._families.setdefault(name, {}).update(graphs)
        return None

    def _capture_step(self, step: Callable[[], Any], label: str) -> DeviceGraph:
        """``step``'s graph; where its capture failed while a chain overlapped (perhaps the second
        stream), overlap is turned off for the process and the step captured again on one stream
        (the second failure raised)."""
        events: list[str] = []  # the step's overlapped branches' events
        try:
            with observe_branches(lambda event, branch: events.append(event)):
                return self._capture_once(step)
        except Exception as e:
            if "fork" not in events:
                raise
            turn_off(f"capturing the {label} graph on two streams failed ({type(e).__name__}: {e})")
            return self._capture_once(step)

    def _capture_once(self, step: Callable[[], Any]) -> DeviceGraph:
        """``step`` run once (lazy initialisation, kernel compilation), then captured."""
        step()
        synchronize(self.device)  # (capturing right after a compile can be invalidated)
        graph = self.factory(self.pool)
        graph.capture(step)
        return graph

    def capture_family(
        self,
        family: str,
        sizes: list[int],
        make: Callable[[int], Callable[[], Any]],
        label: str,
        tokens: int = 1,
    ) -> str | None:
        """:meth:`capture` of one graph per bucket in ``sizes`` (``make(bucket)`` returns the
        step, ``label.format(bucket)`` names it, ``bucket * tokens`` its size)."""
        plans = [GraphPlan(family, b, b * tokens, lambda b=b: make(b), label.format(b)) for b in sizes]
        return self.capture(plans)

    def release(self) -> None:
        """Drop every graph and wait for the device."""
        self._families = {}
        gc.collect()  # the graphs' destructors run now, not at some later collection
        synchronize(self.device)

    # ---- expert parallelism ------------------------------------------------------------------------
    def agree_captured(self, error: str | None) -> str | None:
        """After each capture: ``error``, or when this rank captured but another did not, a text
        saying so (an all-reduce MIN over ``cpu_group``)."""
        t = torch.tensor([0 if error is not None else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        if error is None and not t.item():
            return "another expert-parallel rank failed to capture it; every rank runs eagerly"
        return error

    def agree_bucket(self, family: str, want: int | None) -> int | None:
        """The bucket of ``family`` every expert-parallel rank replays this step: the largest
        any rank needs (``want``: this rank's, ``None`` = its step must run eagerly), or
        ``None`` when some rank runs eagerly (then every rank does, with the dynamic dispatch).
        One all-reduce MAX of one integer over the gloo ``cpu_group``: the graphs' fixed-shape
        dispatch needs the same capacity on every rank."""
        eager = max(self.graphs(family)) + 1
        t = torch.tensor([eager if want is None else want], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        agreed = int(t.item())
        if agreed == eager:
            self.ep_stats["eager"] += 1
            return None
        self.ep_stats["replayed"] += 1
        if want is not None and agreed > want:
            self.ep_stats["padded_to_peer"] += 1
        return agreed


def smallest_bucket(graphs: dict[int, DeviceGraph], n: int) -> int | None:
    """The smallest captured bucket holding ``n``, or ``None`` (none does)."""
    return min((b for b in graphs if b >= n), default=None)
