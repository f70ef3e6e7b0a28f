"""What the plugin manager records: the constants of loading, plugins and their components."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.backends.base import Availability, always_available

ENTRY_POINT_GROUP = "deepinfer"
"""The entry-point group plugins are exposed in."""
CORE_PLUGIN = "core"
"""The name of the core's own plugin; always loaded, and its names cannot be taken over."""
ALLOW_ENV = "DEEPINFER_PLUGINS"
"""Environment variable: comma-separated allow-list of entry-point names."""
COMPONENT_KINDS = (
    "models",
    "logits_processors",
    "drafters",
    "verify_policies",
    "structured_backends",
    "schedulers",
)
"""The kinds of component a plugin can register besides backends (``deepinfer_register_<kind>``)."""
DEPRECATED_HOOKS = {"deepinfer_register_samplers": "logits_processors"}
"""Old names of registration hooks -> the kind they register (each use logs one deprecation line)."""

logger = logging.getLogger("deepinfer.plugins")


@dataclass(frozen=True)
class ComponentSpec:
    """A model, logits processor, drafter, structured-output backend or scheduler registered by a plugin.

    Attributes:
        name: the name it is selected by (for models, the ``model_type``).
        factory: zero-argument callable returning the implementation (imports lazily).
        description: one line shown by ``deepinfer plugins``.
        is_available: zero-argument probe returning ``(available, reason)``.
        plugin: the plugin that registered it.
    """

    name: str
    factory: Callable[[], Any]
    description: str = ""
    is_available: Callable[[], Availability] = always_available
    plugin: str | None = None

    def availability(self) -> Availability:
        """Run the probe; a probe that raises counts as unavailable with its error."""
        try:
            available, reason = self.is_available()
        except Exception as exc:
            return False, f"availability probe raised {type(exc).__name__}: {exc}"
        return bool(available), (None if available else str(reason or "no reason given"))


@dataclass
class PluginInfo:
    """What is known about one plugin, loaded or not.

    Attributes:
        name: the entry-point name (or the name given to :meth:`PluginManager.add_plugin`).
        dist: the distribution that provides it, when known.
        version: that distribution's version, when known.
        module: the module path of the plugin.
        api_range: its declared ``DEEPINFER_API`` range, if any.
        status: ``"loaded"``, ``"error"`` or ``"disabled"``.
        errors: why it failed or was disabled, one message each.
    """

    name: str
    dist: str | None = None
    version: str | None = None
    module: str | None = None
    api_range: str | None = None
    status: str = "loaded"  # "loaded" | "error" | "disabled"
    errors: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        """Record a load error (and log it: nothing is skipped silently)."""
        self.status = "error"
        self.errors.append(message)
        logger.error("plugin %r (%s %s): %s", self.name, self.dist, self.version, message)
