"""Logging set-up of the ``deepinfer`` logger hierarchy."""

from __future__ import annotations

import logging

_HANDLER_NAME = "deepinfer-default"


def configure_logging(level: str = "warning") -> None:
    """Set the level of the ``deepinfer`` logger and give it one stderr handler.

    The handler is added once (re-configuring only changes the level), and is skipped when
    the application already configured the root logger with handlers of its own.
    """
    logger = logging.getLogger("deepinfer")
    logger.setLevel(level.upper())
    if logging.getLogger().handlers or any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
