"""load_checkpoint: round trips through HF save_pretrained and our writer, dtypes, quantised formats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.loader import load_checkpoint
from deepinfer_core.models.deepseek_v4.names import is_expert_stack
from deepinfer_core.models.deepseek_v4.params import parameter_specs, target_dtype
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint
from deepinfer_core.weights.quant import dequant_fp4, dequant_fp8

transformers = pytest.importorskip("transformers")


def _assert_equal_dicts(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def test_hf_save_pretrained_loads_to_exact_state_dict(tiny: Any) -> None:
    got = load_checkpoint(tiny.saved_dir, tiny.cfg, torch.float32)
    _assert_equal_dicts(got, tiny.state_dict)
    assert list(got) == list(parameter_specs(tiny.cfg))


def test_hf_sharded_save_pretrained_loads_to_exact_state_dict(tiny: Any, tmp_path: Path) -> None:
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**tiny.cfg_dict))
    model.load_state_dict(tiny.state_dict, strict=True)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = load_checkpoint(tmp_path, tiny.cfg, torch.float32)
    _assert_equal_dicts(got, tiny.state_dict)


@pytest.mark.parametrize("names", ["hf", "native"])
def test_writer_round_trip_is_exact(tiny: Any, tmp_path: Path, names: str) -> None:
    tiny.save(tmp_path, names=names, max_shard_bytes=200_000)
    got = load_checkpoint(tmp_path, tiny.cfg, torch.float32)
    _assert_equal_dicts(got, tiny.state_dict)


def test_native_names_are_written_without_hf_spelling(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path, names="native")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())  # noqa: SIM118
        w1 = f.get_tensor("layers.1.ffn.experts.3.w1.weight")
        w3 = f.get_tensor("layers.1.ffn.experts.3.w3.weight")
        w2 = f.get_tensor("layers.1.ffn.experts.3.w2.weight")
    assert not any(k.startswith("model.") or "self_attn" in k for k in keys)
    gate_up = tiny.state_dict["model.layers.1.mlp.experts.gate_up_proj"][3]
    assert torch.equal(torch.cat([w1, w3], dim=0), gate_up)
    assert torch.equal(w2, tiny.state_dict["model.layers.1.mlp.experts.down_proj"][3])


def test_load_converts_to_target_dtypes(tiny: Any) -> None:
    got = load_checkpoint(tiny.saved_dir, tiny.cfg, torch.bfloat16)
    for name, spec in parameter_specs(tiny.cfg).items():
        assert got[name].dtype == target_dtype(spec, torch.bfloat16), name
    assert got["model.layers.0.self_attn.sinks"].dtype == torch.float32
    assert got["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(got["lm_head.weight"], tiny.state_dict["lm_head.weight"].bfloat16())


@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_fp8_fp4_native_checkpoint_loads_dequantised(tiny: Any, tmp_path: Path, scale_dtype: str) -> None:
    tiny.save(
        tmp_path,
        names="native",
        fp8_linear=True,
        fp4_experts=True,
        scale_dtype=scale_dtype,
    )
    cfg = DeepseekV4Config.from_file(tmp_path)
    assert cfg.quantization_config is not None and cfg.quantization_config["expert_dtype"] == "fp4"
    got = load_checkpoint(tmp_path, cfg, torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        wq = f.get_tensor("layers.1.attn.wq_b.weight")
        assert wq.dtype == torch.float8_e4m3fn
        exact = dequant_fp8(wq, f.get_tensor("layers.1.attn.wq_b.scale"))
        assert torch.equal(got["model.layers.1.self_attn.q_b_proj.weight"], exact)
        w3 = f.get_tensor("layers.2.ffn.experts.5.w3.weight")
        assert w3.dtype == torch.uint8 and w3.shape == (32, 32)
        exact_up = dequant_fp4(w3, f.get_tensor("layers.2.ffn.experts.5.w3.scale"))
        assert torch.equal(got["model.layers.2.mlp.experts.gate_up_proj"][5, 32:], exact_up)
    specs = parameter_specs(cfg)
    for name, want in tiny.state_dict.items():
        kind = specs[name].kind
        if kind == "linear" and name != "lm_head.weight":
            # FP8 e4m3: |err| <= 2^-4 |w| + 2^-10 s, s <= 2 * block_amax / 448
            bound = 2**-4 * want.abs() + 2**-10 * 2 * want.abs().max() / 448 + 1e-12
        elif kind == "experts":
            # FP4 e2m1: |err| <= max(|w|, s) / 4, s <= 2 * group_amax / 6
            bound = torch.maximum(want.abs(), 2 * want.abs().amax() / 6 * torch.ones_like(want)) / 4 + 1e-12
        else:
            assert torch.equal(got[name], want), name
            continue
        assert not torch.equal(got[name], want), f"{name} was expected to be quantised"
        assert ((got[name] - want).abs() <= bound).all(), name


def test_hf_named_fp8_fp4_checkpoint_loads(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path, names="hf", fp8_linear=True, fp4_experts=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())  # noqa: SIM118
    assert "model.layers.0.self_attn.q_a_proj.weight_scale_inv" in keys
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in keys
    native_dir = tmp_path / "native"
    tiny.save(native_dir, names="native", fp8_linear=True, fp4_experts=True)
    cfg = DeepseekV4Config.from_file(tmp_path)
    _assert_equal_dicts(
        load_checkpoint(tmp_path, cfg, torch.float32), load_checkpoint(native_dir, cfg, torch.float32)
    )


def test_mtp_tensors_are_skipped(tiny: Any, tmp_path: Path) -> None:
    extra = dict(tiny.state_dict)
    extra["mtp.0.attn.wq_a.weight"] = torch.ones(3, 3)
    save_checkpoint(extra, tiny.cfg_dict, tmp_path, names="native")
    got = load_checkpoint(tmp_path, tiny.cfg, torch.float32)
    assert "mtp.0.attn.wq_a.weight" not in got
    _assert_equal_dicts(got, tiny.state_dict)


def test_tied_lm_head_absence_accepted_only_when_tied(tiny: Any, tmp_path: Path) -> None:
    state = {k: v for k, v in tiny.state_dict.items() if k != "lm_head.weight"}
    tied = {**tiny.cfg_dict, "tie_word_embeddings": True}
    save_checkpoint(state, tied, tmp_path)
    cfg = DeepseekV4Config.from_file(tmp_path)
    got = load_checkpoint(tmp_path, cfg, torch.float32)
    assert torch.equal(got["lm_head.weight"], tiny.state_dict["model.embed_tokens.weight"])


def test_expert_stacks_are_filled_for_every_expert(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path, names="native")
    got = load_checkpoint(tmp_path, tiny.cfg, torch.bfloat16)
    for name, t in tiny.state_dict.items():
        if is_expert_stack(name):
            assert torch.equal(got[name], t.bfloat16()), name


@pytest.mark.parametrize("storage", [torch.int8, getattr(torch, "float4_e2m1fn_x2", torch.int8)])
def test_fp4_storage_dtypes_are_equivalent(tiny: Any, tmp_path: Path, storage: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file

    tiny.save(tmp_path, fp4_experts=True)
    cfg = DeepseekV4Config.from_file(tmp_path)
    want = load_checkpoint(tmp_path, cfg, torch.float32)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if is_expert_stack(n)]:
        assert tensors[name].dtype == torch.uint8
        tensors[name] = tensors[name].view(storage)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _assert_equal_dicts(load_checkpoint(tmp_path, cfg, torch.float32), want)


def test_bf16_checkpoint_loads_into_float32(tiny: Any, tmp_path: Path) -> None:
    bf16 = {k: v.bfloat16() if v.is_floating_point() else v for k, v in tiny.state_dict.items()}
    save_checkpoint(bf16, tiny.cfg_dict, tmp_path, names="native")
    got = load_checkpoint(tmp_path, tiny.cfg, torch.float32)
    for name, t in bf16.items():
        assert got[name].dtype == (torch.int64 if name.endswith("tid2eid") else torch.float32)
        assert torch.equal(got[name], t.to(got[name].dtype)), name


def test_keep_quantized_on_an_unquantised_checkpoint_is_a_plain_load(tiny: Any) -> None:
    """Nothing to keep: the option changes nothing (tests/weights/test_loader_keep_quantized.py covers
    the quantised checkpoints)."""
    got = load_checkpoint(tiny.saved_dir, tiny.cfg, torch.float32, keep_quantized=True)
    _assert_equal_dicts(got, tiny.state_dict)
