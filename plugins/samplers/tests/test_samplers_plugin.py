"""The samplers plugin registers placeholders that say plainly they are not implemented."""

from __future__ import annotations

import pytest
from deepinfer_samplers import plugin

from deepinfer_core.errors import PluginError
from deepinfer_core.plugins import PluginManager, get_plugins
from deepinfer_core.testing import manager_with_plugin


@pytest.fixture
def manager() -> PluginManager:
    return manager_with_plugin(plugin, "samplers")


@pytest.mark.parametrize(("kind", "name"), [("drafters", "dspark")])
def test_placeholder_is_reported_unavailable_as_not_implemented(manager, kind, name):
    row = next(r for r in manager.report() if r["name"] == "samplers")
    [entry] = row[kind]
    assert entry["name"] == name and entry["available"] is False
    assert entry["reason"].startswith("not implemented yet")
    assert entry["description"].startswith("NOT IMPLEMENTED YET")


def test_calling_a_placeholder_factory_raises_a_plugin_error(manager):
    with pytest.raises(PluginError, match=r"drafter 'dspark' cannot be used: not implemented yet"):
        manager.get_component("drafters", "dspark").factory()


def test_entry_point_is_installed():
    row = next((r for r in get_plugins().report() if r["name"] == "samplers"), None)
    assert row is not None, "install the plugin: pip install -e plugins/samplers"
    assert row["status"] == "loaded" and row["dist"] == "deepinfer-samplers"
    assert [d["name"] for d in row["drafters"]] == ["dspark"]
