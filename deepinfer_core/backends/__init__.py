"""Backends: what one is (:mod:`.base`) and how one is chosen (:mod:`.resolve`).

``resolve_backend`` is loaded on first use: :mod:`.resolve` looks backends up through the
plugin manager, which itself imports :mod:`.base`, so importing the package must not import
:mod:`.resolve`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import BackendSpec, always_available

__all__ = ["BackendSpec", "always_available", "resolve_backend"]


def __getattr__(name: str) -> Any:
    if name != "resolve_backend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module(".resolve", __name__).resolve_backend
    globals()[name] = value
    return value
