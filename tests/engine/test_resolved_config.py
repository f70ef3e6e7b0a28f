"""The engine's configuration is resolved once, frozen, and every part reads the same values.

Oracles: the checkpoint's own ``config.json`` (``max_position_embeddings``, compress rates) and
the page rule of ``docs/architecture.md`` (the smallest multiple of 16 and of every ratio).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from deepinfer_core.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine.resolved import ResolvedConfig
from deepinfer_core.testing.managers import core_only_manager


def _engine(tiny_dir: Path, **kw) -> LLMEngine:
    config = EngineConfig(model=str(tiny_dir), backend="reference", max_num_seqs=2, **kw)
    return LLMEngine(config, plugins=core_only_manager())


def _json(tiny_dir: Path) -> dict:
    return json.loads((tiny_dir / "config.json").read_text())


def _assert_one_view(engine: LLMEngine) -> None:
    """The engine, runner, scheduler and caches hold the resolved values, not copies of their own."""
    config, runner = engine.config, engine.runner
    assert runner.config is config
    assert (
        engine.max_model_len == runner.max_model_len == engine.scheduler.max_model_len == config.max_model_len
    )
    assert runner.page_size == runner.kv_cache.page_size == config.page_size
    assert runner.kv_cache.num_pages == config.num_cache_pages
    assert runner.inputs.block_tables.shape[1] == -(-config.max_model_len // config.page_size) + 1
    assert runner.dtype == config.torch_dtype and runner.device == torch.device(config.device)
    assert engine.scheduler.replay_tail == runner.replay_tail == config.replay_tail
    assert sorted(runner.graph_manager.graphs("decode")) == [] and list(config.graph_buckets) == [
        1,
        2,
    ]  # CPU: no graphs


def test_max_model_len_comes_from_the_model_and_is_one_value_everywhere(tiny_dir: Path):
    engine = _engine(tiny_dir)
    data = _json(tiny_dir)
    assert isinstance(engine.config, ResolvedConfig)
    assert engine.config.max_model_len == min(data["max_position_embeddings"], DEFAULT_MAX_MODEL_LEN)
    ratios = [r for r in data["compress_rates"].values() if r]
    assert engine.config.page_size == math.lcm(16, *ratios)
    assert engine.config.dtype == "float32" and engine.config.device == "cpu"  # auto on the CPU
    assert engine.config.model == str(tiny_dir) and engine.config.max_num_seqs == 2  # options read through
    _assert_one_view(engine)


def test_a_defaulted_max_model_len_lowered_to_the_cache_is_the_same_everywhere(tiny_dir: Path):
    engine = _engine(tiny_dir, num_cache_pages=3)
    page = engine.config.page_size
    assert engine.config.max_model_len == 3 * page < _json(tiny_dir)["max_position_embeddings"]
    _assert_one_view(engine)


def test_the_resolved_config_is_frozen(tiny_dir: Path):
    engine = _engine(tiny_dir)
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.config.max_model_len = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.config.max_num_seqs = 5  # an option read through: not writable here either
    for name in ("max_model_len", "page_size", "replay_tail", "num_spec_tokens"):
        with pytest.raises(AttributeError):
            setattr(engine.runner, name, 1)  # the runner only reads them
    assert engine.config.max_model_len == engine.runner.max_model_len  # nothing moved
