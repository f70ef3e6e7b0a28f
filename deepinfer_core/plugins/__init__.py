"""Plugins: loads them, collects what they register, reports what happened.

A plugin is a module exposed in the entry-point group ``deepinfer`` of an installed
distribution; the core itself is the plugin ``core`` (:mod:`deepinfer_core.builtin_plugin`).
Loading follows these rules:

- ``DEEPINFER_PLUGINS=a,b`` loads only the entry points named ``a`` and ``b`` (and ``core``,
  always); the others are reported as disabled.
- A plugin module may declare the core API range it was built for, e.g.
  ``DEEPINFER_API = ">=1.0,<2"``; a range that excludes :data:`PLUGIN_API_VERSION` is a load
  error showing both.
- A plugin that fails to import, declares a bad range, implements an unknown hook, raises in
  a registration hook or registers a name another plugin already owns is recorded with its
  error (shown by ``deepinfer plugins`` and logged on ``deepinfer.plugins``); the others load.
- Two third-party plugins registering the same name: the name is withdrawn and using it
  raises a :class:`PluginError` naming both.  The core's names cannot be taken over.

Modules: :mod:`.versions` (API ranges), :mod:`.records` (constants, :class:`PluginInfo`,
:class:`ComponentSpec`), :mod:`.manager` (:class:`PluginManager`, the process-wide manager),
:mod:`.report` (the rows of ``deepinfer plugins``), :mod:`.lookup` (:class:`ComponentLookup`: a
registered component by name, checked, built, its failure kept).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from deepinfer_core.plugins.lookup import ComponentLookup, Unusable, subclass_of
from deepinfer_core.plugins.manager import PluginManager, get_plugins, reset_plugins
from deepinfer_core.plugins.records import (
    ALLOW_ENV,
    COMPONENT_KINDS,
    CORE_PLUGIN,
    ENTRY_POINT_GROUP,
    ComponentSpec,
    PluginInfo,
    logger,
)
from deepinfer_core.plugins.versions import PLUGIN_API_VERSION, parse_version, version_in_range

__all__ = [
    "ALLOW_ENV",
    "COMPONENT_KINDS",
    "CORE_PLUGIN",
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "ComponentLookup",
    "ComponentSpec",
    "PluginInfo",
    "PluginManager",
    "cmd_plugins",
    "get_plugins",
    "logger",
    "parse_version",
    "plugins_report",
    "reset_plugins",
    "subclass_of",
    "Unusable",
    "version_in_range",
]


def plugins_report() -> list[dict[str, Any]]:
    """What ``deepinfer plugins`` prints: see :meth:`PluginManager.report`."""
    return get_plugins().report()


def cmd_plugins(args: argparse.Namespace | None = None) -> int:
    """``deepinfer plugins``: print the plugin report as JSON; exit status 1 if a plugin failed."""
    report = plugins_report()
    print(json.dumps(report, indent=2))
    return 1 if any(row["status"] == "error" for row in report) else 0
