"""The engine: request state, scheduler, KV-cache bookkeeping, model runner and the loop.

Modules are imported directly (``from deepinfer_core.engine.scheduler import Scheduler``) so that
importing the package does not load the model code.
"""
