"""``run_server``: the engine behind the OpenAI-compatible application, served by uvicorn."""

from __future__ import annotations

import importlib
import os
from typing import Any

from deepinfer_core.errors import ConfigError

API_KEY_ENV = "DEEPINFER_API_KEY"
"""The environment variable read for the API key when ``--api-key`` is not given."""

INSTALL_HINT = "install them from a DeepInfer checkout: pip install -e '.[serve]'"


def check_installed() -> None:
    """Raise :class:`ConfigError` (one line with the install command) when FastAPI or uvicorn
    is missing."""
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ConfigError(f"serve needs {' and '.join(missing)}; {INSTALL_HINT}")


def check_address(host: str, port: int) -> None:
    """Raise :class:`ConfigError` for an empty host or a port outside 0..65535."""
    if not host.strip():
        raise ConfigError("serve --host: empty; give an address such as 127.0.0.1")
    if not 0 <= port <= 65535:
        raise ConfigError(f"serve --port={port}: must be in [0, 65535]")


def run_server(
    llm: Any, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, model: str | None = None
) -> None:
    """Serve ``llm`` (an :class:`~deepinfer_core.LLM`) until interrupted.

    Args:
        host, port: the address to listen on.
        api_key: the key clients must send; ``None`` reads :data:`API_KEY_ENV` (unset: none).
        model: the served model name; default the checkpoint path, or ``deepinfer-tiny``.
    """
    check_installed()
    check_address(host, port)
    import uvicorn

    from deepinfer_core.serve.app import build_app
    from deepinfer_core.serve.engine_loop import EngineLoop

    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    name = model or (str(llm.config.model) if llm.config.model else "deepinfer-tiny")
    app = build_app(EngineLoop(llm.client), name, api_key)
    uvicorn.run(app, host=host, port=port, log_level="info")
