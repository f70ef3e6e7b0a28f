"""The released checkpoints' tensor inventories against the engine's loaders (no weights needed).

Each inventory is rebuilt from the byte-exact released ``config.json``
(``released_configs/``, sha256 checked) by ``released_inventory.py`` (written from published
facts about the shard headers, not from the engine's parameter tables; V4-Flash's has the
published tensor count) and written as header-only shards: the loaders' ``check_*`` functions
run every check they run before reading tensor data (names, missing and duplicate tensors,
shapes from the headers).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from deepinfer_core.errors import WeightLoadError
from deepinfer_core.models.deepseek_v4.family import FAMILY as V4
from deepinfer_core.models.deepseek_v41.family import FAMILY as V41
from deepinfer_core.models.deepseek_v41.weights import check_dspark_weights, check_weights
from deepinfer_core.weights import check_checkpoint, check_mtp_checkpoint
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


@pytest.mark.slow
def test_v4_flash_0731s_main_model_maps(tmp_path):
    model_dir = write_headers(tmp_path, V4_FLASH_0731, v4_dspark_inventory(_config(V4_FLASH_0731)), 46)
    check_checkpoint(model_dir, V4.from_file(model_dir))
