"""Distributed execution on ``torch.distributed``: Attention DP, MoE expert parallelism (with
EPLB) and balanced context parallelism.  See ``docs/distributed.md``.

The parallel layout of a run is one :class:`~deepinfer_core.contract.parallel.ParallelState`
per process; the engine, the model runner, the loader and the model receive it explicitly
(``None`` = a single process).  Process-group set-up (:mod:`.init`) and load balancing
(:mod:`.eplb`) sit below the engine, which drives them; the coordinator and the workers
(:mod:`.coordinator`, :mod:`.worker` and their parts: :mod:`.protocol`, :mod:`.serve`,
:mod:`.processes`, :mod:`.diagnosis`, :mod:`.metrics`, :mod:`.faults`) sit above it and drive
engines.
"""
