"""Models are plugins of the core: families resolved by ``model_type``, configs checked.

A third-party plugin registers a second family (the V4 classes under ``toy_v4``, its model
wrapped to count the calls) and the engine serves a checkpoint whose ``config.json`` names
it, through the family interface only.
"""

from __future__ import annotations

import json
import logging
import shutil
import types
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import ConfigError, PluginError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.models.deepseek_v4.config import SHAPE_FIELDS, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.family import FAMILY
from deepinfer_core.models.deepseek_v4.tiny import TINY_CONFIG
from deepinfer_core.models.registry import ModelFamily, resolve_family
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.testing.managers import core_only_manager, manager_with_plugin

PROMPT = [0, 17, 42, 99, 7, 256, 311, 5, 64, 128, 3]


class CountingModel:
    """A V4 model wrapped to count what the runner calls on it."""

    def __init__(self, inner: Any):
        self.inner, self.calls = inner, Counter()

    def __getattr__(self, name: str) -> Any:  # only the Model interface is forwarded
        if name not in ("cache_specs", "step_metadata", "forward", "weight_bytes", "quantized_weight_bytes"):
            raise AttributeError(name)
        fn = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return call


def toy_family() -> tuple[ModelFamily, list[CountingModel]]:
    """``toy_v4``: the V4 classes behind another ``model_type``; the models it built."""
    built: list[CountingModel] = []

    def parse(data: dict[str, Any], source: str) -> DeepseekV4Config:
        assert data["model_type"] == "toy_v4"
        return DeepseekV4Config.from_dict({**data, "model_type": "deepseek_v4"}, source)

    def build(cfg: DeepseekV4Config, weights: dict[str, Any], ops: Any) -> CountingModel:
        built.append(CountingModel(FAMILY.build_model(cfg, weights, ops)))
        return built[-1]

    family = replace(FAMILY, model_type="toy_v4", parse_config=parse, build_model=build, description="toy")
    return family, built


def family_plugin(family: ModelFamily) -> types.ModuleType:
    """A third-party plugin module registering ``family``."""
    module = types.ModuleType("toy_models")
    module.DEEPINFER_API = ">=1.0,<2"

    def deepinfer_register_models(register):
        register(family.model_type, lambda: family, description=family.description)

    module.deepinfer_register_models = hookimpl(deepinfer_register_models)
    return module


def checkpoint_as(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of checkpoint ``src`` whose ``config.json`` has ``changes`` (``None`` deletes a key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def greedy(engine: LLMEngine, n: int = 6) -> list[int]:
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    [out] = outputs
    return out.outputs[0].token_ids


def engine_on(model_dir: Path, plugins: Any) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), backend="reference", max_num_seqs=2, max_model_len=128)
    return LLMEngine(config, plugins=plugins)


def test_core_registers_deepseek_v4_as_a_family():
    spec = core_only_manager().get_component("models", "deepseek_v4")
    assert spec.plugin == "core" and spec.factory() is FAMILY


def test_engine_serves_a_third_party_family_through_the_interface(tiny_dir, tmp_path):
    family, built = toy_family()
    plugins = manager_with_plugin(family_plugin(family), "toy")
    toy_dir = checkpoint_as(tiny_dir, tmp_path / "toy", model_type="toy_v4")
    engine = engine_on(toy_dir, plugins)
    assert engine.family is family and engine.runner.family is family
    [model] = built
    assert engine.runner.model is model and model.calls["cache_specs"] == 1
    tokens = greedy(engine)
    assert model.calls["forward"] >= 6 and model.calls["step_metadata"] == model.calls["forward"]
    # the same weights under the core's own family give the same tokens
    assert tokens == greedy(engine_on(tiny_dir, core_only_manager()))
    assert {row["name"]: row for row in plugins.report()}["toy"]["status"] == "loaded"


def test_unknown_model_type_lists_the_families(tiny_dir, tmp_path):
    llama = checkpoint_as(tiny_dir, tmp_path / "llama", model_type="llama")
    plugins = manager_with_plugin(family_plugin(toy_family()[0]), "toy")
    with pytest.raises(ConfigError) as err:
        resolve_family(llama, plugins)
    message = str(err.value)
    assert "\n" not in message and "'llama'" in message and str(llama / "config.json") in message
    assert "['deepseek_v4', 'deepseek_v41', 'toy_v4']" in message and "plugin" in message
    with pytest.raises(ConfigError, match="'llama'"):
        engine_on(llama, core_only_manager())


def test_missing_model_type_names_the_file(tiny_dir, tmp_path):
    bare = checkpoint_as(tiny_dir, tmp_path / "bare", model_type=None)
    with pytest.raises(ConfigError, match=r"config\.json has no model_type.*deepseek_v4"):
        resolve_family(bare, core_only_manager())
    with pytest.raises(ConfigError, match="has no model_type"):
        DeepseekV4Config.from_file(bare)


def test_v4_config_refuses_another_model_type():
    with pytest.raises(ConfigError, match="'llama' is not a DeepSeek-V4 config"):
        DeepseekV4Config.from_dict({**TINY_CONFIG, "model_type": "llama"}, source="x.json")


@pytest.mark.parametrize("field", ["sliding_window", "hidden_size", "n_routed_experts", "layer_types"])
def test_missing_shape_field_is_named_with_the_file(tiny_dir, tmp_path, field):
    broken = checkpoint_as(tiny_dir, tmp_path / "broken", **{field: None})
    with pytest.raises(ConfigError) as err:
        resolve_family(broken, core_only_manager())
    message = str(err.value)
    assert field in message and str(broken / "config.json") in message and "\n" not in message


def test_shape_fields_accept_the_native_layout_names():
    native = {k: v for k, v in TINY_CONFIG.items() if k not in ("layer_types", "mlp_layer_types")}
    native.update(compress_ratios=[0, 4, 16, 4], num_hash_layers=1)
    cfg = DeepseekV4Config.from_dict(native)
    assert [cfg.compress_ratio(i) for i in range(4)] == [0, 4, 16, 4]
    assert cfg.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    no_rate = {**TINY_CONFIG, "compress_rates": {"compressed_sparse_attention": 4}}
    with pytest.raises(ConfigError, match="heavily_compressed_attention"):
        DeepseekV4Config.from_dict(no_rate)
    assert all(any(n in TINY_CONFIG for n in names) for names in SHAPE_FIELDS)


def test_unknown_keys_are_listed_once_at_debug(tiny_dir, tmp_path, caplog):
    extra = checkpoint_as(tiny_dir, tmp_path / "extra", frobnicate=1, zz_custom="x")
    with caplog.at_level(logging.DEBUG, logger="deepinfer.model"):
        resolve_family(extra, core_only_manager())
    lines = [r for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG
    assert "zz_custom" in lines[0].getMessage() and "hidden_size" not in lines[0].getMessage()


def test_factory_must_return_a_family_of_its_model_type(tiny_dir, tmp_path):
    module = types.ModuleType("bad_models")
    module.DEEPINFER_API = ">=1.0,<2"
    module.deepinfer_register_models = hookimpl(lambda register: register("toy_v4", lambda: object()))
    toy_dir = checkpoint_as(tiny_dir, tmp_path / "toy", model_type="toy_v4")
    with pytest.raises(PluginError, match="expected a ModelFamily"):
        resolve_family(toy_dir, manager_with_plugin(module, "bad"))


def test_the_models_hook_has_a_consumer(tiny_dir, tmp_path):
    """Without the plugin, the same checkpoint is refused: the engine resolves families only
    through what ``deepinfer_register_models`` registered."""
    toy_dir = checkpoint_as(tiny_dir, tmp_path / "toy", model_type="toy_v4")
    with pytest.raises(ConfigError, match="toy_v4"):
        resolve_family(toy_dir, core_only_manager())
    family, _ = toy_family()
    resolved, cfg = resolve_family(toy_dir, manager_with_plugin(family_plugin(family), "toy"))
    assert resolved is family and cfg.num_hidden_layers == TINY_CONFIG["num_hidden_layers"]
