"""The released checkpoints' tensor inventories against the engine's loaders (no weights needed).

Each inventory is rebuilt from the byte-exact released ``config.json``
(``released_configs/``, sha256 checked) by ``released_inventory.py`` (written from published
facts about the shard headers, not from the engine's parameter tables; V4-Flash's has the
published tensor count) and written as header-only shards: the loaders' ``check_*`` functions
run every check they run before reading tensor data (names, missing and duplicate tensors,
shapes from the headers).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest

from deepinfer_core.errors import ConfigError, WeightLoadError
from deepinfer_core.models.deepseek_v4.checkpoint_plan import check_checkpoint, check_mtp_checkpoint
from deepinfer_core.models.deepseek_v4.family import FAMILY as V4
from deepinfer_core.models.deepseek_v41.family import FAMILY as V41
from deepinfer_core.models.deepseek_v41.weights import check_dspark_weights, check_weights
from tests.weights.released_inventory import (
    v4_dspark_inventory,
    v4_inventory,
    v41_inventory,
    write_headers,
)

CONFIGS = Path(__file__).with_name("released_configs")
V4_FLASH = CONFIGS / "deepseek-v4-flash.config.json"
V4_FLASH_0731 = CONFIGS / "deepseek-v4-flash-0731.config.json"
V41_FLASH = CONFIGS / "deepseek-v4.1-flash.config.json"
SHA256 = {  # the published digests (first and last hex digits)
    V4_FLASH: ("b628e633", "d818"),
    V4_FLASH_0731: ("6c8f3d2d", "a023"),
    V41_FLASH: ("8be45ce0", "1879"),
}
V4_FLASH_TENSORS = 69_187  # the published count of V4-Flash's shard headers


def _config(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", list(SHA256), ids=lambda p: p.name)
def test_the_configs_are_the_released_bytes(path):
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    first, last = SHA256[path]
    assert digest.startswith(first) and digest.endswith(last), digest


def test_the_released_configs_parse_and_0731_declares_dspark_stages(caplog):
    import logging

    with caplog.at_level(logging.DEBUG, logger="deepinfer.model"):
        flash = V4.parse_config(_config(V4_FLASH), "v4-flash")
        flash_0731 = V4.parse_config(_config(V4_FLASH_0731), "v4-flash-0731")
        v41 = V41.parse_config(_config(V41_FLASH), "v4.1-flash")
    assert not flash.has_dspark_stages and V4.unsupported_draft_layers(flash) is None
    assert flash_0731.has_dspark_stages and flash_0731.dspark_target_layer_ids == [40, 41, 42]
    assert "not support" in V4.unsupported_draft_layers(flash_0731)
    unknown = " ".join(r.getMessage() for r in caplog.records if "does not use" in r.getMessage())
    assert "dspark" not in unknown and "engram_pad_token_id" not in unknown, unknown
    assert v41.engram_pad_id == 2 and v41.num_nextn_predict_layers == 3


def test_the_rebuilt_v4_flash_inventory_has_the_published_tensor_count():
    assert len(v4_inventory(_config(V4_FLASH))) == V4_FLASH_TENSORS


@pytest.fixture(scope="module")
def v4_flash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_headers(tmp_path_factory.mktemp("v4_flash"), V4_FLASH, v4_inventory(_config(V4_FLASH)), 46)


@pytest.mark.slow
def test_v4_flash_maps_onto_the_main_model_and_its_mtp_layer(v4_flash):
    cfg = V4.from_file(v4_flash)
    check_checkpoint(v4_flash, cfg)
    check_mtp_checkpoint(v4_flash, cfg)


@pytest.mark.slow
def test_a_mis_shaped_tensor_is_named_from_its_header_alone(tmp_path):
    """The shapes come from the headers: a wrong one is refused before any data is read (there
    is none to read)."""
    inventory = v4_inventory(_config(V4_FLASH))
    dtype, (rows, cols) = inventory["layers.7.ffn.experts.100.w2.weight"]
    inventory["layers.7.ffn.experts.100.w2.weight"] = (dtype, (rows, cols + 16))
    model_dir = write_headers(tmp_path, V4_FLASH, inventory, 46)
    with pytest.raises(
        WeightLoadError,
        match=r"expert tensor 'layers\.7\.ffn\.experts\.100\.w2\.weight' in .* "
        r"has shape \(4096, 2080\), expected \(4096, 2048\)",
    ):
        check_checkpoint(model_dir, V4.from_file(model_dir))


@pytest.mark.slow
def test_v41_flash_maps_onto_the_text_model_and_the_dspark_drafter(tmp_path):
    model_dir = write_headers(tmp_path, V41_FLASH, v41_inventory(_config(V41_FLASH)), 48)
    cfg = V41.from_file(model_dir)
    assert cfg.engram_pad_id == _config(V41_FLASH)["text_config"]["engram_pad_token_id"]
    check_weights(model_dir, cfg)
    check_dspark_weights(model_dir, cfg)


@pytest.fixture(scope="module")
def v4_flash_0731(tmp_path_factory: pytest.TempPathFactory) -> Path:
    inventory = v4_dspark_inventory(_config(V4_FLASH_0731))
    return write_headers(tmp_path_factory.mktemp("v4_flash_0731"), V4_FLASH_0731, inventory, 46)


UNSUPPORTED = (
    r"mtp\.\* tensors are DSpark block-drafter stages .*DeepInfer does not support DeepSeek-V4's DSpark "
    r"drafter .*the main model serves without a drafter"
)


@pytest.mark.slow
def test_v4_flash_0731s_main_model_maps(v4_flash_0731):
    check_checkpoint(v4_flash_0731, V4.from_file(v4_flash_0731))


@pytest.mark.slow
def test_v4_flash_0731s_dspark_stages_are_refused_as_unsupported_in_one_line(v4_flash_0731, tmp_path):
    """Its ``mtp.*`` are DSpark stages, which no drafter here runs: the MTP loader says so from
    the tensors even when ``config.json`` does not declare them, and the engine refuses both
    drafters that use draft layers from the config, before loading (the shards hold no data)."""
    from deepinfer_core import LLM

    inventory = v4_dspark_inventory(_config(V4_FLASH_0731))
    undeclared = write_headers(tmp_path / "undeclared", V4_FLASH_0731, inventory, 46)
    config = {k: v for k, v in _config(V4_FLASH_0731).items() if not k.startswith("dspark_")}
    (undeclared / "config.json").write_text(json.dumps(config))
    cfg = V4.from_file(undeclared)
    assert not cfg.has_dspark_stages and V4.from_file(v4_flash_0731).has_dspark_stages
    with pytest.raises(
        ConfigError, match=r"drafter='mtp': .* has mtp\.0\.main_norm\.weight: this .*" + UNSUPPORTED
    ) as e:
        check_mtp_checkpoint(undeclared, cfg)
    assert "\n" not in str(e.value)
    for drafter in ("mtp", "dspark"):
        with pytest.raises(
            ConfigError, match=rf"^speculative\.drafter='{drafter}': this DeepSeek-V4 .*{UNSUPPORTED}"
        ):
            LLM(model=str(v4_flash_0731), backend="reference", speculative={"drafter": drafter})


@pytest.mark.slow
def test_the_cli_refuses_v4_flash_0731s_drafter_with_one_error_line(v4_flash_0731):
    from deepinfer_core.cli import main

    argv = [
        "generate",
        "--model",
        str(v4_flash_0731),
        "--backend",
        "reference",
        "--drafter",
        "mtp",
        "--prompt",
        "Hi",
    ]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    lines = err.getvalue().splitlines()
    assert code == 2 and out.getvalue() == ""
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:]
    assert "does not support DeepSeek-V4's DSpark drafter" in lines[-1]
