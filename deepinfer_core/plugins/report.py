"""The load report printed by ``deepinfer plugins``: one JSON-ready row per plugin."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from deepinfer_core.backends.base import BackendSpec
from deepinfer_core.errors import BackendError
from deepinfer_core.plugins.records import COMPONENT_KINDS, CORE_PLUGIN, ComponentSpec, PluginInfo
from deepinfer_core.plugins.versions import PLUGIN_API_VERSION


def report_rows(
    plugins: Iterable[PluginInfo],
    backends: Iterable[BackendSpec],
    components: Mapping[str, Mapping[str, ComponentSpec]],
) -> list[dict[str, Any]]:
    """One dict per plugin (the core first): status, errors, API range, backends and components."""
    backends = list(backends)
    rows = []
    for info in sorted(plugins, key=lambda i: (i.name != CORE_PLUGIN, i.name)):
        row: dict[str, Any] = {
            "name": info.name,
            "dist": info.dist,
            "version": info.version,
            "module": info.module,
            "api_range": info.api_range,
            "core_api": PLUGIN_API_VERSION,
            "status": info.status,
            "errors": list(info.errors),
            "backends": [backend_row(b) for b in backends if b.plugin == info.name],
        }
        for kind in COMPONENT_KINDS:
            row[kind] = [component_row(c) for c in components[kind].values() if c.plugin == info.name]
        rows.append(row)
    return rows


def backend_row(spec: BackendSpec) -> dict[str, Any]:
    """The report row of one backend, with its availability and the ops it implements."""
    available, reason = spec.availability()
    row: dict[str, Any] = {
        "name": spec.name,
        "device_type": spec.device_type,
        "priority": spec.priority,
        "available": available,
        "reason": reason,
        "supports_graph_capture": spec.supports_graph_capture,
        "graph_runtime": "the backend's" if spec.graph_runtime is not None else "the core's",
        "batch_invariant_devices": list(spec.batch_invariant_devices),
        "quantized_weights": list(spec.quantized_weights),
        "kv_formats": dict(spec.kv_formats),
        "description": spec.description,
    }
    try:
        row["ops"] = sorted(spec.load_ops())
    except BackendError as exc:
        row["ops"] = []
        row["ops_error"] = str(exc)
    return row


def component_row(spec: ComponentSpec) -> dict[str, Any]:
    """The report row of one component, with its availability."""
    available, reason = spec.availability()
    return {"name": spec.name, "available": available, "reason": reason, "description": spec.description}
