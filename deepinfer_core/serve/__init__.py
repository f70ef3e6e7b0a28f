"""``deepinfer serve``: an OpenAI-compatible HTTP server over the engine.

:mod:`.engine_loop` steps the engine on a background thread and hands each request its
incremental text; :mod:`.completions` answers one completion request through it (reusing the
OpenAI translation of :mod:`deepinfer_core.openai`); :mod:`.app` is the FastAPI application;
:mod:`.server` checks the optional dependencies and runs uvicorn; :mod:`.metrics` is the
Prometheus text of ``/metrics``.  FastAPI and uvicorn are the ``[serve]`` extra.
"""
