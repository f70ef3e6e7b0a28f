"""Placeholders for components that are registered but not implemented yet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer_core.errors import PluginError

NOT_IMPLEMENTED = "not implemented yet: deepinfer-samplers only registers a placeholder for {name}"


def not_implemented(name: str) -> tuple[Callable[[], Any], Callable[[], tuple[bool, str | None]]]:
    """``(factory, is_available)`` for a placeholder: unavailable, and the factory raises."""
    reason = NOT_IMPLEMENTED.format(name=name)

    def factory() -> Any:
        raise PluginError(f"{name} cannot be used: {reason}; choose another component or wait for it")

    def is_available() -> tuple[bool, str | None]:
        return False, reason

    return factory, is_available
