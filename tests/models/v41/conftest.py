"""Fixtures of the DeepSeek-V4.1 tests: tiny checkpoints and an engine over them.

``v41_dir`` is ``make-tiny --arch deepseek_v41`` (head and indexer dims are whole blocks of the
release's KV formats, so the FP8/FP4 KV numerics run); ``v41_plain_dir`` shrinks the head dims
below a block, so the numerics are skipped as transformers skips them for such shapes and the
engine can be compared with the oracle at float32 round-off.  Comparisons on ``v41_dir`` run
in batch-invariant mode: a quantisation rounding decided by the last bit of an fp32 sum would
otherwise make two equally right runs differ.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.llm import LLM
from deepinfer_core.models.deepseek_v41.family import FAMILY
from deepinfer_core.models.deepseek_v41.tiny import make_tiny, tiny_config
from deepinfer_core.testing.managers import core_only_manager, manager_with_plugin

PLAIN_CHANGES = {"head_dim": 24, "index_head_dim": 16}


@pytest.fixture(scope="session")
def v41_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("v41"))


@pytest.fixture(scope="session")
def v41_plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("v41_plain"), config=tiny_config(**PLAIN_CHANGES))


def v41_plugins() -> Any:
    """The core's plugin manager, with the ``deepseek_v41`` family added when the core does not
    register it."""
    manager = core_only_manager()
    if "deepseek_v41" in manager.components["models"]:
        return manager
    module = types.ModuleType("v41_models")
    module.DEEPINFER_API = ">=1.0,<2"

    def deepinfer_register_models(register):
        register("deepseek_v41", lambda: FAMILY, description=FAMILY.description)

    module.deepinfer_register_models = hookimpl(deepinfer_register_models)
    return manager_with_plugin(module, "v41")


def v41_llm(model_dir: Path, **options: Any) -> LLM:
    """An ``LLM`` (reference backend, float32) over a tiny V4.1 checkpoint."""
    cfg = EngineConfig(model=str(model_dir), backend="reference", dtype="float32", **options)
    return LLM.from_engine(LLMEngine(cfg, plugins=v41_plugins()))


def prefix_hit_and_cold_run(
    model_dir: Path, first: list[int], second: list[int], **options: Any
) -> tuple[Any, Any]:
    """``second``'s output from a prefix-caching engine that served ``first`` before (a cache
    hit, asserted) and from a cold engine without prefix caching: greedy, 4 tokens, logprobs,
    batch invariant; ``options``: more engine options of both."""
    from deepinfer_core.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    warm = v41_llm(model_dir, batch_invariant=True, enable_prefix_caching=True, max_num_seqs=1, **options)
    warm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    [hit] = warm.generate([{"prompt_token_ids": second}], params, use_tqdm=False)
    assert warm.get_metrics()["num_prefix_hit_tokens"] > 0
    cold = v41_llm(model_dir, batch_invariant=True, enable_prefix_caching=False, max_num_seqs=1, **options)
    [ref] = cold.generate([{"prompt_token_ids": second}], params, use_tqdm=False)
    return hit, ref


@pytest.fixture(scope="session")
def v41_dspark_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny V4.1 checkpoint with the DSpark drafter (``make_tiny(dspark=True)``), head dims
    below a block (the oracle comparison at float32 round-off, as ``v41_plain_dir``)."""
    return make_tiny(tmp_path_factory.mktemp("v41_dspark"), config=tiny_config(**PLAIN_CHANGES), dspark=True)


@pytest.fixture(scope="session")
def v41_dspark_mixed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As ``v41_dspark_dir`` with ``dspark_target_layer_ids = [5, 8, 10]``: an encoder layer
    (before the prefill tail's decoder layers), a decoder layer and id ``L`` (the last layer's
    output streams)."""
    config = tiny_config(**PLAIN_CHANGES, dspark_target_layer_ids=[5, 8, 10])
    return make_tiny(tmp_path_factory.mktemp("v41_dspark_mixed"), config=config, dspark=True)


HF_ENGRAM_HEAD_DIM = 32
"""The Engram row width of :func:`hf_named_checkpoint`'s model: one 32-channel scale per row, the
``[rows, 1]`` float32 scale transformers writes with such a table."""


def hf_named_checkpoint(out: Path, seed: int = 0) -> Path:
    """A tiny V4.1 checkpoint as transformers-main's ``DeepseekV41ForCausalLM.save_pretrained``
    writes it: every native name behind ``model.``, the head as ``lm_head.weight``, a float
    Engram table with its float32 ``embed.scale`` (``[rows, head_dim / 32]``; random here:
    transformers applies it to e4m3 rows only, so no value may change a float table), and every
    router's image-token bias ``ffn.gate.bias_vl`` (random: text tokens never route with it).
    Head dims below a block, as ``v41_plain_dir``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    make_tiny(out, seed, config=tiny_config(**PLAIN_CHANGES, engram_head_dim=HF_ENGRAM_HEAD_DIM))
    shard = out / "model.safetensors"
    with safe_open(str(shard), "pt") as st:
        native = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 (safe_open is not a dict)
    g = torch.Generator().manual_seed(seed + 1)
    hf: dict[str, torch.Tensor] = {}
    for name, t in native.items():
        hf["lm_head.weight" if name == "head.weight" else "model." + name] = t
        if name.endswith("engram.embed.weight"):
            rows, width = t.shape
            scale = 0.5 + torch.rand(rows, width // 32, generator=g)
            hf["model." + name.removesuffix(".weight") + ".scale"] = scale
        if name.endswith("ffn.gate.bias"):
            hf["model." + name + "_vl"] = torch.randn(t.shape, generator=g)
    save_file(hf, str(shard), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def v41_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_named_checkpoint(tmp_path_factory.mktemp("v41_hf"))
