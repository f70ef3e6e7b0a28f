"""The plugin manager: loads plugins and holds the registries they fill."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType
from typing import Any

import pluggy

from deepinfer_core import hookspecs
from deepinfer_core.backends.base import Availability, BackendSpec, always_available
from deepinfer_core.errors import BackendError, PluginError
from deepinfer_core.plugins.records import (
    ALLOW_ENV,
    COMPONENT_KINDS,
    CORE_PLUGIN,
    DEPRECATED_HOOKS,
    ENTRY_POINT_GROUP,
    ComponentSpec,
    PluginInfo,
    logger,
)
from deepinfer_core.plugins.report import report_rows
from deepinfer_core.plugins.versions import PLUGIN_API_VERSION, version_in_range


class PluginManager:
    """Loads plugins and holds the registries they fill.

    Attributes:
        plugins: every plugin seen, by name (including failed and disabled ones).
        backends: backend name -> :class:`BackendSpec`.
        components: kind (``models``, ``logits_processors``, ``drafters``,
            ``structured_backends``, ``schedulers``) -> name -> :class:`ComponentSpec`; found
            by name through :class:`~deepinfer_core.plugins.lookup.ComponentLookup`.
        clashes: ``(kind, name)`` -> the plugins that registered it; the name is withdrawn.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.backends: dict[str, BackendSpec] = {}
        self.components: dict[str, dict[str, ComponentSpec]] = {kind: {} for kind in COMPONENT_KINDS}
        self.clashes: dict[tuple[str, str], list[str]] = {}

    # -- loading

    def load_entry_points(self, allow: str | None = None, eps: Iterable[EntryPoint] | None = None) -> None:
        """Load every plugin of the ``deepinfer`` entry-point group, honouring the allow-list.

        Args:
            allow: comma-separated entry-point names; ``None`` reads ``DEEPINFER_PLUGINS``;
                empty means all.  ``core`` is always loaded.
            eps: the entry points to load instead of the installed ones (for tests).
        """
        allow = os.environ.get(ALLOW_ENV, "") if allow is None else allow
        allowed = {name.strip() for name in allow.split(",") if name.strip()}
        for ep in entry_points(group=ENTRY_POINT_GROUP) if eps is None else eps:
            dist = getattr(ep, "dist", None)
            info = PluginInfo(
                name=ep.name,
                dist=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
                module=ep.value,
            )
            if ep.name in self.plugins:
                info.fail(f"entry point name {ep.name!r} is also used by {self.plugins[ep.name].dist!r}")
                self.plugins[f"{ep.name}@{info.dist}"] = info
                continue
            self.plugins[ep.name] = info
            if allowed and ep.name not in allowed and ep.name != CORE_PLUGIN:
                info.status = "disabled"
                info.errors.append(f"not listed in {ALLOW_ENV}={allow!r}")
                logger.info("plugin %r disabled: not listed in %s", ep.name, ALLOW_ENV)
                continue
            try:
                module = ep.load()
            except Exception as exc:
                info.fail(f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}")
                continue
            self._register_module(module, info)
        unknown = sorted(allowed - set(self.plugins) - {CORE_PLUGIN})
        if unknown:
            logger.warning(
                "%s=%r names %s that no installed plugin has; installed plugins: %s",
                ALLOW_ENV,
                allow,
                ", ".join(map(repr, unknown)),
                ", ".join(sorted(self.plugins)) or "none",
            )
        if CORE_PLUGIN not in self.plugins:  # running from a source tree without `pip install -e`
            from deepinfer_core import builtin_plugin

            info = PluginInfo(name=CORE_PLUGIN, dist="deepinfer-core", module=builtin_plugin.__name__)
            self.plugins[CORE_PLUGIN] = info
            self._register_module(builtin_plugin, info)

    def add_plugin(
        self, module: ModuleType | object, name: str, dist: str | None = None, version: str | None = None
    ) -> PluginInfo:
        """Register an already imported plugin object under ``name`` (used by tests and embedders)."""
        if name in self.plugins:
            raise PluginError(f"a plugin named {name!r} is already registered")
        info = PluginInfo(name=name, dist=dist, version=version, module=getattr(module, "__name__", None))
        self.plugins[name] = info
        self._register_module(module, info)
        return info

    def _register_module(self, module: Any, info: PluginInfo) -> None:
        api_range = getattr(module, "DEEPINFER_API", None)
        info.api_range = api_range
        if api_range is not None:
            try:
                compatible = version_in_range(PLUGIN_API_VERSION, api_range)
            except PluginError as exc:
                info.fail(f"DEEPINFER_API: {exc}")
                return
            if not compatible:
                info.fail(
                    f"built for DeepInfer plugin API {api_range!r} but this core implements "
                    f"{PLUGIN_API_VERSION}; install a version of {info.dist or info.name} made for API "
                    f"{PLUGIN_API_VERSION}"
                )
                return
        else:
            logger.warning("plugin %r does not declare DEEPINFER_API; assuming it is compatible", info.name)
        unknown = [
            attr
            for attr in dir(module)
            if attr.startswith("deepinfer_")
            and self.pm.parse_hookimpl_opts(module, attr) is not None
            and not hasattr(self.pm.hook, attr)
        ]
        if unknown:
            info.fail(f"implements unknown hooks {unknown}; known hooks: {self.hook_names()}")
            return
        try:
            self.pm.register(module, name=info.name)
        except Exception as exc:  # pluggy validation: wrong hook arguments etc.
            info.fail(f"could not be registered: {type(exc).__name__}: {exc}")
            return
        self._collect(info)

    # -- registration callbacks

    def _collect(self, info: PluginInfo) -> None:
        """Call the plugin's registration hooks with callbacks that know the plugin's name."""
        calls: dict[str, Callable[..., None]] = {
            "deepinfer_register_backends": lambda spec: self._add_backend(spec, info),
        }
        for kind in COMPONENT_KINDS:
            calls[f"deepinfer_register_{kind}"] = self._component_callback(kind, info)
        for old, kind in DEPRECATED_HOOKS.items():
            calls[old] = self._component_callback(kind, info)
        for hook_name, register in calls.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name != info.name:
                    continue
                if hook_name in DEPRECATED_HOOKS:
                    logger.warning(
                        "plugin %r implements %s, a deprecated name: rename it deepinfer_register_%s",
                        info.name,
                        hook_name,
                        DEPRECATED_HOOKS[hook_name],
                    )
                try:
                    impl.function(**{arg: register for arg in impl.argnames})
                except Exception as exc:
                    info.fail(f"{hook_name} raised {type(exc).__name__}: {exc}")

    def _component_callback(self, kind: str, info: PluginInfo) -> Callable[..., None]:
        def register(
            name: str,
            factory: Callable[[], Any],
            description: str = "",
            is_available: Callable[[], Availability] | None = None,
        ) -> None:
            if not isinstance(name, str) or not name or not callable(factory):
                raise PluginError(f"register {kind}: expected (name: str, factory: callable), got {name!r}")
            spec = ComponentSpec(name, factory, description, is_available or always_available, info.name)
            self._claim(self.components[kind], kind, name, spec, info)

        return register

    def _add_backend(self, spec: BackendSpec, info: PluginInfo) -> None:
        if not isinstance(spec, BackendSpec):
            raise PluginError(f"register backends: expected a BackendSpec, got {type(spec).__name__}")
        self._claim(self.backends, "backends", spec.name, replace(spec, plugin=info.name), info)

    def _claim(self, registry: dict[str, Any], kind: str, name: str, spec: Any, info: PluginInfo) -> None:
        owners = self.clashes.get((kind, name))
        if owners is not None:
            owners.append(info.name)
            info.fail(f"{kind} name {name!r} is registered by several plugins: {owners}")
            return
        if name not in registry:
            registry[name] = spec
            return
        owner = registry[name].plugin
        if owner == info.name:
            raise PluginError(f"{kind} name {name!r} registered twice by plugin {info.name!r}")
        if owner == CORE_PLUGIN:
            info.fail(f"{kind} name {name!r} belongs to the core; choose another name")
            return
        del registry[name]
        self.clashes[(kind, name)] = [owner, info.name]
        message = (
            f"{kind} name {name!r} is registered by both plugin {owner!r} and plugin {info.name!r}; "
            f"uninstall one or exclude it with {ALLOW_ENV}"
        )
        self.plugins[owner].fail(message)
        info.fail(message)

    # -- lookups

    def hook_names(self) -> list[str]:
        """The names of every hook spec."""
        return sorted(name for name in dir(hookspecs) if name.startswith("deepinfer_"))

    def _raise_if_clashed(self, kind: str, name: str, label: str) -> None:
        """Raise a :class:`PluginError` naming the plugins when ``name`` was withdrawn by a clash."""
        if (kind, name) in self.clashes:
            raise PluginError(
                f"{label} is registered by several plugins {self.clashes[(kind, name)]}; "
                f"uninstall one or exclude it with {ALLOW_ENV}"
            )

    def get_backend(self, name: str) -> BackendSpec:
        """The backend registered as ``name``; raises a :class:`DeepInferError` naming the options."""
        self._raise_if_clashed("backends", name, f"backend {name!r}")
        if name not in self.backends:
            raise BackendError(
                f"unknown backend {name!r}; known backends: {['auto', *sorted(self.backends)]} "
                "(run `deepinfer plugins` to see plugins that failed to load)"
            )
        return self.backends[name]

    def get_component(self, kind: str, name: str) -> ComponentSpec:
        """The component ``name`` of ``kind`` (e.g. ``("models", "deepseek_v4")``)."""
        if kind not in self.components:
            raise PluginError(f"unknown component kind {kind!r}; known kinds: {list(COMPONENT_KINDS)}")
        self._raise_if_clashed(kind, name, f"{kind} name {name!r}")
        if name not in self.components[kind]:
            raise PluginError(f"unknown {kind} entry {name!r}; known: {sorted(self.components[kind])}")
        return self.components[kind][name]

    # -- lifecycle hooks

    def configure(self, config: Any) -> None:
        """Call ``deepinfer_configure(config)`` (historic: late plugins receive it too)."""
        self.pm.hook.deepinfer_configure.call_historic(kwargs={"config": config})

    def engine_started(self, engine: Any) -> None:
        """Call ``deepinfer_engine_started(engine)``."""
        self.pm.hook.deepinfer_engine_started(engine=engine)

    def step_stats(self, stats: Any) -> None:
        """Call ``deepinfer_step_stats(stats)``."""
        self.pm.hook.deepinfer_step_stats(stats=stats)

    # -- report

    def report(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per plugin: status, errors, API range, backends and components."""
        return report_rows(self.plugins.values(), self.backends.values(), self.components)


_MANAGER: PluginManager | None = None


def get_plugins() -> PluginManager:
    """The process-wide plugin manager, loading the entry points on first call."""
    global _MANAGER
    if _MANAGER is None:
        manager = PluginManager()
        manager.load_entry_points()
        _MANAGER = manager
    return _MANAGER


def reset_plugins() -> None:
    """Forget the loaded plugins; the next :func:`get_plugins` reloads them (for tests)."""
    global _MANAGER
    _MANAGER = None
