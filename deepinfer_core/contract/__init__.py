"""The engine <-> model contract: plain data the engine hands a model and its drafters.

Below the models and the engine alike (see docs/architecture.md, "Layers"): the scheduler's
chunks (:mod:`.batch`), the per-step device inputs (:mod:`.step_inputs`), a process's parallel
layout (:mod:`.parallel`) and the expert placement (:mod:`.placement`).  Modules are imported
directly; the package imports nothing.
"""
