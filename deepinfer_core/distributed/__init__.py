"""Distributed execution on ``torch.distributed``: Attention DP, MoE expert parallelism (with
EPLB) and balanced context parallelism.  See ``docs/distributed.md``.

The parallel layout of a run is one :class:`~deepinfer_core.distributed.state.ParallelState`
per process; the engine, the model runner, the loader and the model receive it explicitly
(``None`` = a single process).
"""

from .state import ParallelState

__all__ = ["ParallelState"]
