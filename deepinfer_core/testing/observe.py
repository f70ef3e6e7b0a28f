"""Observing an engine's model from tests and benchmarks (no effect on what it computes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def counting_context_parallel_forwards(model: Any) -> Iterator[list[int]]:
    """Count, in the yielded ``[n]``, the forwards of ``model`` (this process's) whose step
    metadata carries a context-parallel plan (``md.cp``: the step's rows were split over the
    ranks); the model's own ``forward`` is restored on exit."""
    count = [0]
    forward = model.forward

    def observed(md: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += getattr(md, "cp", None) is not None
        return forward(md, *args, **kwargs)

    model.forward = observed
    try:
        yield count
    finally:
        del model.forward  # the instance attribute: the class's method shows again


def record_replays(graphs_by_kind: dict[str, dict[int, Any]], into: list[str]) -> None:
    """Append ``kind`` to ``into`` on every replay of the graphs of each kind (``{kind: {bucket:
    graph}}``, e.g. a runner's decode / verify / MTP graphs); the graphs replay as before."""
    for kind, by_bucket in graphs_by_kind.items():
        for graph in by_bucket.values():
            inner = graph.replay
            graph.replay = lambda inner=inner, kind=kind: into.append(kind) or inner()
