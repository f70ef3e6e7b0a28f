"""Fixtures shared by the test modules: the tiny checkpoints and an LLM on the random tiny model.

Session-scoped fixtures write their checkpoint once per run; treat what they return as
read-only.  ``tests/weights/conftest.py`` adds the weight tests' own HF model (``tiny``).
See docs/testing.md for the layout, the ``slow`` marker and the fast tier.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deepinfer_core import LLM
from deepinfer_core.models.deepseek_v4 import tiny
from tests.models.hf_oracle import build_hf_model, save_hf_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V4 checkpoint of ``make_tiny`` (default seed and dtype), written once."""
    return tiny.make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, Path]]:
    """``hf_model(name)``: the HF oracle model of ``hf_oracle.CONFIGS[name]`` and the directory
    it was saved to, built and saved once per session (transformers is imported on first use)."""
    cache: dict[str, tuple[Any, Path]] = {}

    def get(name: str) -> tuple[Any, Path]:
        if name not in cache:
            model = build_hf_model(name)
            cache[name] = model, save_hf_model(model, tmp_path_factory.mktemp(f"hf_{name}"))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def llm() -> LLM:
    """``LLM(backend="reference")`` on the random tiny model (``builtin_tiny_model_dir()``: the
    tests' oracles were written on its outputs and vocabulary), one per test module (the
    modules' tests share its engine, as they did with their private copies)."""
    return LLM(model=str(tiny.builtin_tiny_model_dir()), backend="reference")
