"""save_checkpoint: config.json, quantisation metadata, scale dtypes and sharding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def _dtypes(files: list[Path]) -> dict[str, torch.dtype]:
    out: dict[str, torch.dtype] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k).dtype for k in f.keys()})  # noqa: SIM118
    return out


def test_unquantised_checkpoint_has_no_quantization_config(tiny: Any, tmp_path: Path) -> None:
    files = tiny.save(tmp_path)
    assert files == [tmp_path / "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 4 and config["model_type"] == "deepseek_v4"
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_quantised_native_checkpoint_formats_and_config(tiny: Any, tmp_path: Path) -> None:
    before = {k: v.clone() for k, v in tiny.state_dict.items()}
    files = tiny.save(
        tmp_path,
        names="native",
        fp8_linear=True,
        fp4_experts=True,
        scale_dtype="ue8m0",
    )
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["fmt"] == "e4m3" and qc["scale_fmt"] == "ue8m0" and qc["weight_block_size"] == [128, 128]
    assert qc["expert_dtype"] == "fp4" and qc["linear_dtype"] == "fp8"
    dt = _dtypes(files)
    assert dt["layers.0.attn.wq_a.weight"] == torch.float8_e4m3fn
    assert dt["layers.0.attn.wq_a.scale"] == torch.float8_e8m0fnu
    assert dt["layers.1.ffn.experts.0.w2.weight"] == torch.uint8
    assert dt["layers.1.ffn.experts.0.w2.scale"] == torch.float8_e8m0fnu
    # kept in full precision: output head, linear_bf16 projections, norms, mHC, int tables
    assert dt["head.weight"] == torch.float32
    assert dt["layers.1.attn.compressor.wkv.weight"] == torch.float32
    assert dt["layers.1.ffn.gate.weight"] == torch.float32
    assert dt["layers.0.hc_attn_scale"] == torch.float32
    assert dt["layers.0.ffn.gate.tid2eid"] == torch.int64
    assert all(torch.equal(before[k], v) for k, v in tiny.state_dict.items())  # inputs untouched


def test_sharding_respects_max_bytes_and_writes_index(tiny: Any, tmp_path: Path) -> None:
    limit = 150_000
    files = tiny.save(tmp_path, names="native", max_shard_bytes=limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == [f.name for f in files]
    total = 0
    for path in files:
        with safe_open(str(path), "pt") as f:
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()]  # noqa: SIM118
            assert all(index["weight_map"][k] == path.name for k in f.keys())  # noqa: SIM118
        assert sum(sizes) <= limit or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
