"""Backends: named sets of op implementations registered by plugins, and how one is chosen."""

from .base import BackendSpec, always_available
from .resolve import resolve_backend

__all__ = ["BackendSpec", "always_available", "resolve_backend"]
