"""The plugin manager: loading, API ranges, allow-list, load errors, name clashes, report."""

from __future__ import annotations

import json
import logging
import types
from importlib.metadata import EntryPoint

import pytest

from deepinfer_core.backends import BackendSpec
from deepinfer_core.errors import ConfigError, PluginError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.plugins import (
    PLUGIN_API_VERSION,
    ComponentLookup,
    PluginManager,
    cmd_plugins,
    get_plugins,
    subclass_of,
    version_in_range,
)


def make_plugin(name: str, api: str | None = ">=1.0,<2", **hooks) -> types.ModuleType:
    """A plugin module whose hooks are ``hooks`` (functions named after the hook)."""
    module = types.ModuleType(name)
    if api is not None:
        module.DEEPINFER_API = api
    for hook_name, fn in hooks.items():
        setattr(module, hook_name, hookimpl(fn))
    return module


def backend_plugin(name: str, *backends: str, priority: int = 10, api: str | None = ">=1.0,<2"):
    def deepinfer_register_backends(register):
        for backend in backends:
            register(BackendSpec(name=backend, device_type="cpu", priority=priority))

    return make_plugin(name, api, deepinfer_register_backends=deepinfer_register_backends)


def core_manager() -> PluginManager:
    """A manager with the core plugin only."""
    manager = PluginManager()
    manager.load_entry_points(eps=[EntryPoint("core", "deepinfer_core.builtin_plugin", "deepinfer")])
    return manager


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        ("1.0", ">=1.0,<2", True),
        ("1.9", ">=1.0,<2", True),
        ("2.0", ">=1.0,<2", False),
        ("0.9", ">=1.0", False),
        ("1.0", "==1", True),
        ("1.0", "!=1.0", False),
        ("1.10", ">1.9", True),
        ("1.0", "<=1.0, >0.5", True),
    ],
)
def test_version_in_range_compares_numerically(version, spec, expected):
    assert version_in_range(version, spec) is expected


@pytest.mark.parametrize("spec", ["", "1.0", ">=1.0,,<2", "~=1.0", ">=one"])
def test_malformed_api_range_is_a_plugin_error_naming_it(spec):
    with pytest.raises(PluginError, match="invalid"):
        version_in_range("1.0", spec)


def test_core_registers_reference_backend_and_deepseek_v4():
    manager = core_manager()
    assert manager.get_backend("reference").plugin == "core"
    assert manager.get_backend("reference").priority == 0
    model = manager.get_component("models", "deepseek_v4")
    assert model.plugin == "core"
    assert model.factory().model_type == "deepseek_v4"


def test_incompatible_api_range_is_a_load_error_showing_both_versions(caplog):
    manager = core_manager()
    with caplog.at_level(logging.ERROR, logger="deepinfer.plugins"):
        info = manager.add_plugin(backend_plugin("future", "future_gpu", api=">=2.0,<3"), "future")
    assert info.status == "error"
    assert ">=2.0,<3" in info.errors[0] and PLUGIN_API_VERSION in info.errors[0]
    assert "future_gpu" not in manager.backends
    assert any("future" in r.getMessage() and ">=2.0,<3" in r.getMessage() for r in caplog.records)


def test_plugin_without_api_range_loads_with_a_warning(caplog):
    manager = core_manager()
    with caplog.at_level(logging.WARNING, logger="deepinfer.plugins"):
        info = manager.add_plugin(backend_plugin("legacy", "legacy_gpu", api=None), "legacy")
    assert info.status == "loaded" and "legacy_gpu" in manager.backends
    assert any("DEEPINFER_API" in r.getMessage() for r in caplog.records)


def test_broken_entry_point_is_recorded_and_the_others_load():
    manager = PluginManager()
    manager.load_entry_points(
        allow="",
        eps=[
            EntryPoint("core", "deepinfer_core.builtin_plugin", "deepinfer"),
            EntryPoint("broken", "deepinfer_no_such_module_xyz.plugin", "deepinfer"),
        ],
    )
    assert manager.plugins["core"].status == "loaded"
    broken = manager.plugins["broken"]
    assert broken.status == "error"
    assert "deepinfer_no_such_module_xyz" in broken.errors[0] and "ModuleNotFoundError" in broken.errors[0]
    row = next(r for r in manager.report() if r["name"] == "broken")
    assert row["status"] == "error" and row["errors"] == broken.errors


def test_core_is_loaded_even_when_missing_from_the_allow_list_and_entry_points():
    manager = PluginManager()
    manager.load_entry_points(allow="other", eps=[])
    assert manager.plugins["core"].status == "loaded"
    assert "reference" in manager.backends


def test_allow_list_env_var_disables_unlisted_plugins(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PLUGINS", "wanted")
    manager = PluginManager()
    manager.load_entry_points(
        eps=[
            EntryPoint("core", "deepinfer_core.builtin_plugin", "deepinfer"),
            EntryPoint("wanted", "deepinfer_no_such_module_a", "deepinfer"),
            EntryPoint("unwanted", "deepinfer_no_such_module_b", "deepinfer"),
        ]
    )
    assert manager.plugins["core"].status == "loaded"
    assert manager.plugins["wanted"].status == "error"  # it was tried (and its module is missing)
    unwanted = manager.plugins["unwanted"]
    assert unwanted.status == "disabled" and "DEEPINFER_PLUGINS" in unwanted.errors[0]


def test_allow_list_naming_no_installed_plugin_warns(caplog):
    manager = PluginManager()
    with caplog.at_level("WARNING", logger="deepinfer"):
        manager.load_entry_points(
            allow="nosuch, wanted", eps=[EntryPoint("core", "deepinfer_core.builtin_plugin", "deepinfer")]
        )
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert (
        len(messages) == 1
        and "'nosuch', 'wanted'" in messages[0]
        and "installed plugins: core" in messages[0]
    )


def test_plugin_raising_in_a_register_hook_is_recorded_and_others_load():
    def deepinfer_register_backends(register):
        raise RuntimeError("kernel library exploded")

    manager = core_manager()
    bad = manager.add_plugin(
        make_plugin("bad", deepinfer_register_backends=deepinfer_register_backends), "bad"
    )
    good = manager.add_plugin(backend_plugin("good", "good_gpu"), "good")
    assert bad.status == "error" and "kernel library exploded" in bad.errors[0]
    assert good.status == "loaded" and manager.get_backend("good_gpu").plugin == "good"


def test_unknown_hook_is_a_load_error_naming_it():
    def deepinfer_register_backend(register):  # typo: missing "s"
        pass

    manager = core_manager()
    info = manager.add_plugin(
        make_plugin("typo", deepinfer_register_backend=deepinfer_register_backend), "typo"
    )
    assert info.status == "error" and "deepinfer_register_backend" in info.errors[0]
    assert "deepinfer_register_backends" in info.errors[0]  # the known hooks are listed


def test_hook_with_unknown_argument_is_a_load_error():
    def deepinfer_register_backends(register, device):
        pass

    manager = core_manager()
    info = manager.add_plugin(
        make_plugin("args", deepinfer_register_backends=deepinfer_register_backends), "args"
    )
    assert info.status == "error" and "device" in info.errors[0]


def test_registering_something_else_than_a_backend_spec_is_recorded():
    def deepinfer_register_backends(register):
        register("my_backend")

    manager = core_manager()
    info = manager.add_plugin(
        make_plugin("odd", deepinfer_register_backends=deepinfer_register_backends), "odd"
    )
    assert info.status == "error" and "BackendSpec" in info.errors[0]


def test_backend_name_clash_withdraws_the_name_and_names_both_plugins():
    manager = core_manager()
    manager.add_plugin(backend_plugin("vendor_a", "fastgpu", "only_a"), "vendor_a")
    manager.add_plugin(backend_plugin("vendor_b", "fastgpu"), "vendor_b")
    for name in ("vendor_a", "vendor_b"):
        info = manager.plugins[name]
        assert info.status == "error"
        assert (
            "'vendor_a'" in info.errors[0] and "'vendor_b'" in info.errors[0] and "fastgpu" in info.errors[0]
        )
    with pytest.raises(PluginError, match=r"fastgpu.*vendor_a.*vendor_b"):
        manager.get_backend("fastgpu")
    assert manager.get_backend("only_a").plugin == "vendor_a"  # its other names stay usable


def test_third_party_cannot_take_over_a_core_name():
    manager = core_manager()
    info = manager.add_plugin(backend_plugin("usurper", "reference"), "usurper")
    assert info.status == "error" and "core" in info.errors[0]
    assert manager.get_backend("reference").plugin == "core"
    assert manager.plugins["core"].status == "loaded"


def test_component_registrations_are_reported_per_plugin_with_availability():
    def deepinfer_register_drafters(register):
        register("lookahead", lambda: "Lookahead", description="lookahead drafter")
        register("eagle", lambda: "Eagle", is_available=lambda: (False, "needs eagle weights"))

    def deepinfer_register_schedulers(register):
        register("priority", lambda: "Priority")

    plugin = make_plugin(
        "spec",
        deepinfer_register_drafters=deepinfer_register_drafters,
        deepinfer_register_schedulers=deepinfer_register_schedulers,
    )
    manager = core_manager()
    manager.add_plugin(plugin, "spec", dist="deepinfer-spec", version="0.3")
    row = next(r for r in manager.report() if r["name"] == "spec")
    assert row["dist"] == "deepinfer-spec" and row["version"] == "0.3" and row["status"] == "loaded"
    assert {d["name"]: (d["available"], d["reason"]) for d in row["drafters"]} == {
        "lookahead": (True, None),
        "eagle": (False, "needs eagle weights"),
    }
    assert [s["name"] for s in row["schedulers"]] == ["priority"]
    assert manager.get_component("drafters", "lookahead").factory() == "Lookahead"
    with pytest.raises(PluginError, match="unknown drafters entry 'nope'"):
        manager.get_component("drafters", "nope")


def test_configure_is_historic_and_lifecycle_hooks_reach_plugins():
    seen: list[tuple[str, object]] = []

    def deepinfer_configure(config):
        seen.append(("configure", config))

    def deepinfer_engine_started(engine):
        seen.append(("started", engine))

    def deepinfer_step_stats(stats):
        seen.append(("stats", stats))

    manager = core_manager()
    manager.configure("cfg")
    # registered after configure(): still receives it (historic hook)
    manager.add_plugin(
        make_plugin(
            "watcher",
            deepinfer_configure=deepinfer_configure,
            deepinfer_engine_started=deepinfer_engine_started,
            deepinfer_step_stats=deepinfer_step_stats,
        ),
        "watcher",
    )
    manager.engine_started("engine")
    manager.step_stats({"tokens": 3})
    assert seen == [("configure", "cfg"), ("started", "engine"), ("stats", {"tokens": 3})]


def test_report_lists_backend_ops_and_availability_reason():
    def deepinfer_register_backends(register):
        register(
            BackendSpec(
                name="absent_gpu",
                device_type="cuda",
                priority=50,
                ops=lambda: {"rms_norm": lambda x, weight, eps: x},
                is_available=lambda: (False, "no frobnicator attached"),
                kv_formats={"fp8": "fp8_tile128"},
                graph_runtime=lambda device: (None, None, "none here"),
            )
        )

    manager = core_manager()
    manager.add_plugin(make_plugin("gpu", deepinfer_register_backends=deepinfer_register_backends), "gpu")
    rows = {r["name"]: r for r in manager.report()}
    [backend] = rows["gpu"]["backends"]
    assert backend["available"] is False and backend["reason"] == "no frobnicator attached"
    assert backend["ops"] == ["rms_norm"] and backend["device_type"] == "cuda" and backend["priority"] == 50
    [reference] = rows["core"]["backends"]
    assert "rms_norm" in reference["ops"] and "linear" in reference["ops"]
    assert reference["quantized_weights"] == [] and backend["quantized_weights"] == []
    assert (backend["kv_formats"], reference["kv_formats"]) == ({"fp8": "fp8_tile128"}, {})
    assert (backend["graph_runtime"], reference["graph_runtime"]) == ("the backend's", "the core's")
    assert rows["core"]["core_api"] == PLUGIN_API_VERSION


def test_cmd_plugins_prints_json_of_the_installed_plugins(capsys):
    status = cmd_plugins(None)
    report = json.loads(capsys.readouterr().out)
    names = [row["name"] for row in report]
    assert names[0] == "core"
    assert status == (1 if any(row["status"] == "error" for row in report) else 0)
    assert report == json.loads(json.dumps(get_plugins().report()))


def test_every_hook_is_documented_with_its_parameters_and_firstresult():
    import inspect

    from deepinfer_core import hookspecs

    names = PluginManager().hook_names()
    assert len(names) == 11
    for name in names:
        fn = getattr(hookspecs, name)
        doc = inspect.getdoc(fn) or ""
        for param, p in inspect.signature(fn).parameters.items():
            assert f":param {param}:" in doc, f"{name} does not document {param}"
            # its type: an annotation, or (a type of a higher layer) a :type: line naming it
            assert p.annotation != "Any" or f":type {param}: deepinfer_core." in doc, (
                f"{name}: type of {param}"
            )
        assert "firstresult" in doc, f"{name} does not say whether it is firstresult"


def test_component_lookup_builds_once_and_keeps_a_failure_with_its_reason():
    """One lookup for every kind: found by name, probed, built once; a failure is kept (the
    probe and the factory are not asked again) and a clashing name names both plugins."""
    calls = {"probe": 0, "factory": 0, "build": 0}

    def probe():
        calls["probe"] += 1
        return False, "needs a unicorn"

    def factory():
        calls["factory"] += 1
        return dict

    def deepinfer_register_schedulers(register):
        register("odd", factory)
        register("gone", factory, is_available=probe)
        register("twice", factory)

    manager = core_manager()
    manager.add_plugin(make_plugin("a", deepinfer_register_schedulers=deepinfer_register_schedulers), "a")
    manager.add_plugin(
        make_plugin("b", deepinfer_register_schedulers=lambda register: register("twice", factory)), "b"
    )

    def build(cls):
        calls["build"] += 1
        return cls(x=1)

    lookup = ComponentLookup(manager, "schedulers", "scheduler {}", build=build)
    assert lookup.get("odd") == {"x": 1} and lookup.get("odd") == {"x": 1}
    assert calls == {"probe": 0, "factory": 1, "build": 1}
    for _ in range(2):
        with pytest.raises(ConfigError, match="^scheduler 'gone' is unavailable: needs a unicorn$"):
            lookup.get("gone")
    assert calls["probe"] == 1
    with pytest.raises(
        ConfigError, match=r"scheduler 'nope' is not registered \(known: \['fcfs', 'gone', 'odd'\]\)"
    ):
        lookup.get("nope")
    with pytest.raises(PluginError, match=r"scheduler 'twice' is registered by several plugins \['a', 'b'\]"):
        lookup.get("twice")
    strict = ComponentLookup(manager, "schedulers", "scheduler {}", check=subclass_of(list))
    with pytest.raises(
        ConfigError, match="scheduler 'odd' .plugin 'a'. gave <class 'dict'>, not a subclass of builtins.list"
    ):
        strict.get("odd")
    failing = ComponentLookup(
        manager, "schedulers", "scheduler {}", error=RuntimeError, build=lambda cls: cls(1)
    )
    with pytest.raises(RuntimeError, match="^scheduler 'odd' failed to start: "):
        failing.get("odd")
