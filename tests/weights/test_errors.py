"""Every way a checkpoint can be wrong gives a WeightLoadError naming the culprit tensor/file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from deepinfer_core.errors import WeightLoadError
from deepinfer_core.models.deepseek_v4.loader import load_checkpoint
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint
from deepinfer_core.weights.safetensors_io import discover_shards

INDEX = "model.safetensors.index.json"


def _load(tiny: Any, path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path, tiny.cfg, torch.float32)


def _sharded(tiny: Any, path: Path, names: str = "hf") -> dict[str, Any]:
    tiny.save(path, names=names, max_shard_bytes=200_000)
    return json.loads((path / INDEX).read_text())


def _first_shard(index: dict[str, Any]) -> str:
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    return shards[1]


def _write_index(path: Path, index: dict[str, Any]) -> None:
    (path / INDEX).write_text(json.dumps(index))


def test_missing_shard_file(tiny: Any, tmp_path: Path) -> None:
    shard = _first_shard(_sharded(tiny, tmp_path))
    (tmp_path / shard).unlink()
    with pytest.raises(WeightLoadError, match=rf"{re.escape(shard)}.*does not exist"):
        _load(tiny, tmp_path)


@pytest.mark.parametrize("entry", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors"])
def test_shard_paths_outside_model_dir_are_refused(tiny: Any, tmp_path: Path, entry: str) -> None:
    index = _sharded(tiny, tmp_path / "m")
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "m" / _first_shard(index)).read_bytes())
    index["weight_map"]["model.norm.weight"] = entry
    _write_index(tmp_path / "m", index)
    with pytest.raises(WeightLoadError, match=re.escape(repr(entry))) as e:
        _load(tiny, tmp_path / "m")
    assert "model.norm.weight" in str(e.value)


def test_symlinked_shard_escaping_model_dir_is_refused(tiny: Any, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shard = _first_shard(_sharded(tiny, model))
    os.replace(model / shard, tmp_path / "elsewhere.safetensors")
    (model / shard).symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(WeightLoadError, match="outside the model directory") as e:
        _load(tiny, model)
    assert shard in str(e.value)


def test_symlink_inside_model_dir_is_fine(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path)
    (tmp_path / "real.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes())
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").symlink_to("real.safetensors")
    assert torch.equal(_load(tiny, tmp_path)["lm_head.weight"], tiny.state_dict["lm_head.weight"])


def test_truncated_file_names_the_file(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match=r"model\.safetensors.*truncated or corrupt"):
        _load(tiny, tmp_path)


def test_an_indexed_shard_without_a_readable_header_names_the_file(tiny: Any, tmp_path: Path) -> None:
    """Shapes are checked from the headers before any data is read: a shard whose header cannot
    be read is named there."""
    shard = _first_shard(_sharded(tiny, tmp_path))
    (tmp_path / shard).write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(WeightLoadError, match=rf"header of .*{re.escape(shard)}.*truncated or corrupt"):
        _load(tiny, tmp_path)


def test_tensor_in_index_but_absent_from_shard(tiny: Any, tmp_path: Path) -> None:
    index = _sharded(tiny, tmp_path)
    owner = index["weight_map"]["model.norm.weight"]
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != owner)
    index["weight_map"]["model.norm.weight"] = wrong
    _write_index(tmp_path, index)
    with pytest.raises(
        WeightLoadError, match=rf"'model\.norm\.weight'.*{re.escape(wrong)}.*does not contain"
    ):
        _load(tiny, tmp_path)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(WeightLoadError, match=r"no safetensors weights.*pytorch_model\.bin"):
        discover_shards(tmp_path)


def test_missing_tensor_names_it_and_files_searched(tiny: Any, tmp_path: Path) -> None:
    state = {k: v for k, v in tiny.state_dict.items() if k != "model.layers.2.self_attn.o_b_proj.weight"}
    save_checkpoint(state, tiny.cfg_dict, tmp_path)
    with pytest.raises(
        WeightLoadError, match=r"model\.layers\.2\.self_attn\.o_b_proj\.weight.*model\.safetensors"
    ):
        _load(tiny, tmp_path)


def test_missing_native_expert_is_named(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path, names="native")
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.3.ffn.experts.6.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        WeightLoadError, match=r"model\.layers\.3\.mlp\.experts\.gate_up_proj \(expert 6 up\)"
    ):
        _load(tiny, tmp_path)


def test_missing_lm_head_is_an_error_when_untied(tiny: Any, tmp_path: Path) -> None:
    state = {k: v for k, v in tiny.state_dict.items() if k != "lm_head.weight"}
    save_checkpoint(state, tiny.cfg_dict, tmp_path)
    with pytest.raises(WeightLoadError, match=r"lm_head\.weight"):
        _load(tiny, tmp_path)


@pytest.mark.parametrize("names", ["hf", "native"])
def test_unexpected_tensor_names_it_and_its_file(tiny: Any, tmp_path: Path, names: str) -> None:
    extra = {**tiny.state_dict, "model.layers.9.self_attn.q_a_proj.weight": torch.zeros(32, 64)}
    index = _sharded(tiny, tmp_path, names)
    stray = "model.layers.9.self_attn.q_a_proj.weight" if names == "hf" else "layers.9.attn.wq_a.weight"
    save_file({stray: extra["model.layers.9.self_attn.q_a_proj.weight"]}, str(tmp_path / "extra.safetensors"))
    index["weight_map"][stray] = "extra.safetensors"
    _write_index(tmp_path, index)
    with pytest.raises(WeightLoadError, match=rf"unexpected.*'{re.escape(stray)}' \(in extra\.safetensors\)"):
        _load(tiny, tmp_path)


def test_wrong_shape_reports_expected_and_found(tiny: Any, tmp_path: Path) -> None:
    state = {**tiny.state_dict, "model.layers.1.self_attn.q_a_proj.weight": torch.zeros(31, 64)}
    save_checkpoint(state, tiny.cfg_dict, tmp_path, names="native")
    with pytest.raises(
        WeightLoadError,
        match=r"'layers\.1\.attn\.wq_a\.weight'.*model\.safetensors has shape \(31, 64\), "
        r"expected \(32, 64\)",
    ):
        _load(tiny, tmp_path)


def test_float_tid2eid_is_a_dtype_error(tiny: Any, tmp_path: Path) -> None:
    state = {**tiny.state_dict}
    state["model.layers.0.mlp.gate.tid2eid"] = state["model.layers.0.mlp.gate.tid2eid"].float()
    save_checkpoint(state, tiny.cfg_dict, tmp_path)
    with pytest.raises(
        WeightLoadError, match=r"'model\.layers\.0\.mlp\.gate\.tid2eid'.*torch\.float32.*integer"
    ):
        _load(tiny, tmp_path)


def test_integer_weight_is_a_dtype_error(tiny: Any, tmp_path: Path) -> None:
    state = {**tiny.state_dict, "model.norm.weight": torch.ones(64, dtype=torch.int32)}
    save_checkpoint(state, tiny.cfg_dict, tmp_path)
    with pytest.raises(WeightLoadError, match=r"'model\.norm\.weight'.*integer dtype torch\.int32"):
        _load(tiny, tmp_path)


def test_fp8_weight_without_scale(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path, names="native", fp8_linear=True)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.0.attn.wo_b.scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"'layers\.0\.attn\.wo_b\.weight'.*float8_e4m3fn.*no scale"):
        _load(tiny, tmp_path)


def test_mixed_naming_schemes(tiny: Any, tmp_path: Path) -> None:
    index = _sharded(tiny, tmp_path)
    save_file({"layers.0.attn.wq_a.weight": torch.zeros(32, 64)}, str(tmp_path / "native.safetensors"))
    index["weight_map"]["layers.0.attn.wq_a.weight"] = "native.safetensors"
    _write_index(tmp_path, index)
    with pytest.raises(
        WeightLoadError, match=r"mixes HF names.*'layers\.0\.attn\.wq_a\.weight' \(in native\.safetensors\)"
    ):
        _load(tiny, tmp_path)


def test_duplicate_spellings_of_one_parameter(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path, names="native")
    save_file({"layers.0.attn.norm.weight": torch.ones(32)}, str(tmp_path / "dup.safetensors"))
    (tmp_path / "model.safetensors").rename(tmp_path / "a.safetensors")
    with pytest.raises(
        WeightLoadError,
        match=r"'layers\.0\.attn\.kv_norm\.weight'.*'layers\.0\.attn\.norm\.weight'|'layers\.0\.attn\.norm\.weight'.*'layers\.0\.attn\.kv_norm\.weight'",
    ):
        _load(tiny, tmp_path)
