"""Choosing the backend of an engine and resolving its op table.

``backend`` is ``"auto"``, ``"reference"`` or the name of a backend registered by a plugin:

- ``"auto"``: the available backend with the highest priority.  Two available third-party
  backends sharing the top priority are refused (the user must pick one by name); a
  third-party backend sharing the top priority with the core's wins over it.
- a name: that backend, which must be registered and available.

Ops the chosen backend lacks fall back to the reference (logged) unless ``strict_ops``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deepinfer_core.errors import BackendError
from deepinfer_core.ops.table import OpTable
from deepinfer_core.plugins import get_plugins

from .base import BackendSpec

if TYPE_CHECKING:
    from deepinfer_core.plugins import PluginManager

logger = logging.getLogger("deepinfer.backends")

CORE_PLUGIN = "core"


def pick_auto(backends: list[BackendSpec]) -> BackendSpec:
    """The backend ``"auto"`` selects among ``backends``, or a :class:`BackendError` saying why none."""
    available: list[BackendSpec] = []
    unavailable: list[str] = []
    for spec in backends:
        ok, reason = spec.availability()
        if ok:
            available.append(spec)
        else:
            unavailable.append(f"{spec.name}: {reason}")
    if not available:
        raise BackendError(f"backend 'auto': no backend is available ({'; '.join(unavailable)})")
    top = max(spec.priority for spec in available)
    leaders = [spec for spec in available if spec.priority == top]
    third_party = [spec for spec in leaders if spec.plugin != CORE_PLUGIN]
    if len(third_party) > 1:
        names = ", ".join(f"{spec.name!r} (plugin {spec.plugin!r})" for spec in third_party)
        raise BackendError(
            f"backend 'auto' is ambiguous: backends {names} are available with the same priority {top}; "
            "select one explicitly with backend=... / --backend"
        )
    chosen = third_party[0] if third_party else leaders[0]
    if unavailable:
        logger.info("backend 'auto': skipped unavailable backends: %s", "; ".join(unavailable))
    return chosen


def resolve_backend(
    name: str, strict_ops: bool = False, plugins: PluginManager | None = None
) -> tuple[BackendSpec, OpTable]:
    """Select backend ``name`` and resolve its :class:`OpTable`.

    Args:
        name: ``"auto"``, ``"reference"`` or a registered backend name.
        strict_ops: raise :class:`OpNotSupportedError` when the backend lacks an op instead of
            falling back to the reference implementation.
        plugins: the :class:`~deepinfer_core.plugins.PluginManager` to use (default: the
            process-wide one).

    Raises:
        BackendError: unknown name (the message lists the known backends), unavailable
            backend (with the probe's reason), ambiguous ``auto``, or ops that fail to load.
        OpNotSupportedError: ``strict_ops`` and the backend lacks ops.
    """
    if plugins is None:
        plugins = get_plugins()
    if not isinstance(name, str) or not name:
        raise BackendError(f"backend must be 'auto', 'reference' or a backend name, got {name!r}")
    if name == "auto":
        spec = pick_auto(list(plugins.backends.values()))
    else:
        spec = plugins.get_backend(name)
        ok, reason = spec.availability()
        if not ok:
            raise BackendError(
                f"backend {name!r} (plugin {spec.plugin!r}) is not available: {reason}; "
                f"choose another with backend=... / --backend (available: {_available_names(plugins)})"
            )
    table = OpTable(spec.load_ops(), backend=spec.name, strict=strict_ops)
    provided = sum(source != "reference" for source in table.sources.values())
    logger.info(
        "using backend %r (plugin %r, device %s, priority %d%s): %d of %d ops from the backend",
        spec.name,
        spec.plugin,
        spec.device_type,
        spec.priority,
        ", chosen by 'auto'" if name == "auto" else "",
        provided,
        len(table.sources),
    )
    return spec, table


def _available_names(plugins: PluginManager) -> list[str]:
    return sorted(name for name, spec in plugins.backends.items() if spec.availability()[0])
