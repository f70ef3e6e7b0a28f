"""What the samplers plugin registers: a logits processor and two structured-output backends,
and no drafter (the DSpark block drafter is the core's ``dspark``)."""

from __future__ import annotations

import pytest
from deepinfer_samplers import plugin

from deepinfer_core.plugins import PluginManager, get_plugins
from deepinfer_core.testing import manager_with_plugin


@pytest.fixture
def manager() -> PluginManager:
    return manager_with_plugin(plugin, "samplers")


def test_registers_its_components_and_no_drafter(manager):
    row = next(r for r in manager.report() if r["name"] == "samplers")
    assert [e["name"] for e in row["logits_processors"]] == ["no_repeat_ngram"]
    assert sorted(e["name"] for e in row["structured_backends"]) == ["llguidance", "xgrammar"]
    assert row.get("drafters", []) == []
    assert not hasattr(plugin, "deepinfer_register_drafters")


def test_the_dspark_drafter_is_the_cores(manager):
    spec = manager.get_component("drafters", "dspark")
    assert spec.plugin == "core"
    assert spec.factory().__module__ == "deepinfer_core.speculative.dspark"


def test_entry_point_is_installed():
    row = next((r for r in get_plugins().report() if r["name"] == "samplers"), None)
    assert row is not None, "install the plugin: pip install -e plugins/samplers"
    assert row["status"] == "loaded" and row["dist"] == "deepinfer-samplers"
    assert row.get("drafters", []) == []
