"""Placeholders for components that are registered but not implemented yet."""

from __future__ import annotations

import importlib.util
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


def llguidance_placeholder() -> tuple[Callable[[], Any], Callable[[], tuple[bool, str | None]]]:
    """Placeholder of the llguidance structured-output backend; its reason also covers the library."""
    factory, _ = not_implemented("structured outputs 'llguidance'")

    def is_available() -> tuple[bool, str | None]:
        reason = NOT_IMPLEMENTED.format(name="structured outputs 'llguidance'")
        if importlib.util.find_spec("llguidance") is None:
            reason += "; it will also need llguidance (pip install deepinfer-samplers[structured])"
        return False, reason

    return factory, is_available
