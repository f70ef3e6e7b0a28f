"""A DeepSeek-V4.1 checkpoint as transformers-main's ``save_pretrained`` writes it loads as it is.

transformers names the tensors ``model.`` + the native name, but the head ``lm_head.weight``; it
writes a float32 ``embed.scale`` with every Engram table and applies it to e4m3 rows only; and
every router carries the image-token bias ``gate.bias_vl``.  The engine's greedy continuations on
such a checkpoint are the independent oracle's (full recompute, written from transformers-main),
cold and after a prefix-cache hit.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer_core.errors import WeightLoadError
from deepinfer_core.models.deepseek_v41.family import FAMILY
from deepinfer_core.models.deepseek_v41.tiny import make_tiny, tiny_config
from deepinfer_core.models.deepseek_v41.weights import load_weights
from tests.models.v41.conftest import HF_ENGRAM_HEAD_DIM, PLAIN_CHANGES, prefix_hit_and_cold_run
from tests.models.v41.oracle import OracleV41


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_transformers_names_load_the_native_checkpoints_weights(v41_hf_dir, tmp_path, caplog):
    """Every weight equals the one the same model's native checkpoint gives (the float tables'
    scales and the image-token biases unread), and each unapplied scale is logged."""
    config = tiny_config(**PLAIN_CHANGES, engram_head_dim=HF_ENGRAM_HEAD_DIM)
    native = make_tiny(tmp_path / "native", config=config)
    cfg = FAMILY.from_file(v41_hf_dir)
    with caplog.at_level(logging.INFO, logger="deepinfer.model"):
        got = load_weights(v41_hf_dir, cfg, torch.float32)
    want = load_weights(native, cfg, torch.float32)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    unapplied = [r.getMessage() for r in caplog.records if "is not applied" in r.getMessage()]
    assert len(unapplied) == len(cfg.engram_layer_ids) == 2
    assert "model.layers.1.engram.embed.scale" in unapplied[0] + unapplied[1]


def test_head_under_both_names_is_refused(v41_hf_dir, tmp_path):
    out = tmp_path / "both"
    out.mkdir()
    for f in v41_hf_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    with safe_open(str(v41_hf_dir / "model.safetensors"), "pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
    tensors["head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="both provide 'head.weight'"):
        load_weights(out, FAMILY.from_file(out), torch.float32)


@pytest.mark.slow
def test_greedy_continuations_equal_the_oracle_cold_and_after_a_prefix_hit(v41_hf_dir):
    shared = _ids(5, 128)
    first, second = shared + _ids(6, 5), shared + _ids(7, 9)
    hit, cold = prefix_hit_and_cold_run(v41_hf_dir, first, second)
    want = OracleV41(v41_hf_dir).greedy(second, 4)
    assert cold.outputs[0].token_ids == want
    assert hit.outputs[0].token_ids == want
