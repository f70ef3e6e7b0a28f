"""``LLM`` drives an ``EngineClient``: the single-process engine and the distributed
coordinator both implement the protocol, member by member and signature by signature."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from deepinfer_core.config import EngineConfig
from deepinfer_core.distributed.coordinator import Coordinator
from deepinfer_core.engine.client import EngineClient
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.llm import LLM
from deepinfer_core.testing.managers import core_only_manager

ROOT = Path(__file__).resolve().parents[1]


def _members() -> dict[str, object]:
    """The protocol's own members (methods and properties), by name."""
    return {
        name: value
        for name, value in vars(EngineClient).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def _params(fn: object) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("cls", [LLMEngine, Coordinator])
def test_each_client_has_every_member_with_a_compatible_signature(cls: type):
    members = _members()
    assert {"add_request", "step", "has_unfinished", "abort_request", "shutdown"} <= set(members)
    for name, spec in members.items():
        impl = inspect.getattr_static(cls, name, None)
        if isinstance(spec, property):
            # a property, or (LLMEngine) an attribute set in __init__
            assert impl is None or isinstance(impl, property), f"{cls.__name__}.{name} is not a property"
            if impl is None:
                assigned = re.search(rf"self\.{name}\b[^=\n]*= ", inspect.getsource(cls.__init__))
                assert assigned, f"{cls.__name__} lacks {name}"
            continue
        assert callable(impl), f"{cls.__name__} lacks {name}()"
        want, have = _params(spec), _params(impl)
        # the protocol's parameters come first, same names, kinds and defaults; an
        # implementation may add optional ones after them
        assert have[: len(want)] == want, f"{cls.__name__}.{name}{inspect.signature(impl)} vs {spec}"
        assert all(d is not inspect.Parameter.empty for _, _, d in have[len(want) :]), name


def test_a_running_engine_is_an_engine_client(tiny_dir: Path):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), max_num_seqs=2), plugins=core_only_manager())
    assert isinstance(engine, EngineClient)
    assert engine.kv_cache_capacity_tokens == engine.config.capacity_tokens
    assert engine.get_metrics()["kv_cache_capacity_tokens"] == engine.kv_cache_capacity_tokens
    llm = LLM.from_engine(engine)
    assert llm.client is engine and llm.config is engine.config
    assert not isinstance(object(), EngineClient)


def test_llm_calls_only_the_protocol():
    """Every ``self.client.<name>`` in ``llm.py`` is a protocol member, and ``LLM`` reaches its
    engine's internals through nothing else."""
    tree = ast.parse((ROOT / "deepinfer_core" / "llm.py").read_text())
    used, engine_uses = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            owner = node.value
            if isinstance(owner.value, ast.Name) and owner.value.id == "self":
                if owner.attr == "client":
                    used.add(node.attr)
                elif owner.attr == "engine":
                    engine_uses.append(node.attr)
    assert used and used <= set(_members()), used - set(_members())
    assert not engine_uses, engine_uses
