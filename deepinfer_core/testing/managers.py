"""Plugin managers for tests: the core alone, or the core plus the plugin under test."""

from __future__ import annotations

from types import ModuleType

from deepinfer_core.errors import PluginError
from deepinfer_core.plugins import PluginManager


def core_only_manager() -> PluginManager:
    """A fresh :class:`PluginManager` with only the core loaded (installed plugins are ignored)."""
    manager = PluginManager()
    manager.load_entry_points(allow="", eps=[])
    return manager


def manager_with_plugin(plugin: ModuleType | object, name: str) -> PluginManager:
    """The core plus ``plugin`` registered as ``name``; raises :class:`PluginError` if it fails to load."""
    manager = core_only_manager()
    info = manager.add_plugin(plugin, name)
    if info.status != "loaded":
        raise PluginError(f"plugin {name!r} did not load: {info.errors}")
    return manager
