"""load_checkpoint(keep_quantized=...): FP8 block dense weights and FP4 experts stay quantised, and
dequantise to bitwise the tensors of a plain load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_core.errors import WeightLoadError
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
from deepinfer_core.models.deepseek_v4.loader import load_checkpoint
from deepinfer_core.models.deepseek_v4.params import parameter_specs
from deepinfer_core.models.deepseek_v4.tiny import TINY_CONFIG, random_weights
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint
from deepinfer_core.weights import QuantizedTensor
from deepinfer_core.weights.quant import QUANTIZED_FORMATS, UE8M0_DTYPE, dequant_fp4

CFG = DeepseekV4Config.from_dict(dict(TINY_CONFIG), source="TINY_CONFIG")


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return random_weights(CFG, seed=3)


def _save(state: dict[str, torch.Tensor], out: Path, **options: object) -> DeepseekV4Config:
    save_checkpoint(state, dict(TINY_CONFIG), out, **options)
    return DeepseekV4Config.from_file(out)


def _expected_format(name: str, kind: str, fp8: bool, fp4: bool) -> str | None:
    """What the writer quantised (and keep_quantized=True keeps): the loader's contract."""
    if kind == "linear" and name != "lm_head.weight" and fp8:
        return "fp8"
    if kind == "experts" and fp4:
        return "fp4"
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("names", "scale_dtype"), [("native", "fp32"), ("hf", "ue8m0"), ("native", "ue8m0")])
def test_quantised_weights_are_kept_and_dequantise_to_the_plain_load(
    state, tmp_path: Path, names: str, scale_dtype: str, dtype: torch.dtype
) -> None:
    cfg = _save(state, tmp_path, names=names, fp8_linear=True, fp4_experts=True, scale_dtype=scale_dtype)
    plain = load_checkpoint(tmp_path, cfg, dtype)
    kept = load_checkpoint(tmp_path, cfg, dtype, keep_quantized=True)
    assert list(kept) == list(plain)
    want_scale = UE8M0_DTYPE if scale_dtype == "ue8m0" else torch.float32
    for name, spec in parameter_specs(cfg).items():
        fmt = _expected_format(name, spec.kind, True, True)
        got = kept[name]
        if fmt is None:
            assert isinstance(got, torch.Tensor), name
            assert got.dtype == plain[name].dtype and torch.equal(got, plain[name]), name
            continue
        assert isinstance(got, QuantizedTensor), name
        assert got.fmt == fmt and got.shape == spec.shape and got.scale.dtype == want_scale, name
        if fmt == "fp8":
            assert got.block == (128, 128) and got.data.dtype == torch.float8_e4m3fn, name
        else:
            assert got.block == (1, 32) and got.data.dtype == torch.uint8, name
            assert got.data.shape == (*spec.shape[:-1], spec.shape[-1] // 2), name
        deq = got.dequantize(dtype)
        assert deq.dtype == plain[name].dtype and torch.equal(deq, plain[name]), name


def test_native_experts_are_stacked_byte_for_byte(state, tmp_path: Path) -> None:
    cfg = _save(state, tmp_path, names="native", fp4_experts=True)
    kept = load_checkpoint(tmp_path, cfg, torch.float32, keep_quantized=True)
    stored = load_file(str(tmp_path / "model.safetensors"))
    gate_up = kept["model.layers.2.mlp.experts.gate_up_proj"]
    down = kept["model.layers.2.mlp.experts.down_proj"]
    assert isinstance(gate_up, QuantizedTensor) and isinstance(down, QuantizedTensor)
    inter = CFG.moe_intermediate_size
    for e in range(CFG.n_routed_experts):
        p = f"layers.2.ffn.experts.{e}."
        assert torch.equal(gate_up.data[e, :inter], stored[p + "w1.weight"])
        assert torch.equal(gate_up.data[e, inter:], stored[p + "w3.weight"])
        assert torch.equal(gate_up.scale[e, inter:], stored[p + "w3.scale"])
        assert torch.equal(down.data[e], stored[p + "w2.weight"])
    assert torch.equal(
        gate_up.dequantize()[5, inter:],
        dequant_fp4(stored["layers.2.ffn.experts.5.w3.weight"], stored["layers.2.ffn.experts.5.w3.scale"]),
    )


@pytest.mark.parametrize("formats", [["fp4_experts"], ["fp8_block"], []])
def test_keep_only_the_named_formats(state, tmp_path: Path, formats: list[str]) -> None:
    cfg = _save(state, tmp_path, names="native", fp8_linear=True, fp4_experts=True)
    plain = load_checkpoint(tmp_path, cfg, torch.float32)
    kept = load_checkpoint(tmp_path, cfg, torch.float32, keep_quantized=formats)
    for name, spec in parameter_specs(cfg).items():
        fmt = _expected_format(name, spec.kind, "fp8_block" in formats, "fp4_experts" in formats)
        assert isinstance(kept[name], QuantizedTensor) == (fmt is not None), name
        if fmt is None:
            assert torch.equal(kept[name], plain[name]), name


def test_unquantised_checkpoint_loads_normally(state, tmp_path: Path) -> None:
    cfg = _save(state, tmp_path, names="native")
    plain = load_checkpoint(tmp_path, cfg, torch.float32)
    kept = load_checkpoint(tmp_path, cfg, torch.float32, keep_quantized=True)
    assert list(kept) == list(plain)
    for name, t in plain.items():
        assert isinstance(kept[name], torch.Tensor) and torch.equal(kept[name], t), name


@pytest.mark.parametrize("storage", [torch.int8, getattr(torch, "float4_e2m1fn_x2", torch.int8)])
def test_fp4_storage_dtypes_are_kept_as_bytes(state, tmp_path: Path, storage: torch.dtype) -> None:
    cfg = _save(state, tmp_path, fp4_experts=True)
    want = load_checkpoint(tmp_path, cfg, torch.float32, keep_quantized=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        tensors[name] = tensors[name].view(storage)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = load_checkpoint(tmp_path, cfg, torch.float32, keep_quantized=True)
    name = "model.layers.1.mlp.experts.down_proj"
    assert got[name].data.dtype == torch.uint8
    assert torch.equal(got[name].data, want[name].data) and torch.equal(got[name].scale, want[name].scale)


def test_an_expert_stack_of_mixed_formats_is_refused_only_when_kept(state, tmp_path: Path) -> None:
    cfg = _save(state, tmp_path, names="native", fp4_experts=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    odd = "layers.1.ffn.experts.3.w1.weight"
    tensors[odd] = state["model.layers.1.mlp.experts.gate_up_proj"][3, : CFG.moe_intermediate_size].clone()
    del tensors["layers.1.ffn.experts.3.w1.scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    load_checkpoint(tmp_path, cfg, torch.float32)  # dequantised: any mix is fine
    with pytest.raises(WeightLoadError, match=r"experts\.3\.w1\.weight.*another format"):
        load_checkpoint(tmp_path, cfg, torch.float32, keep_quantized=True)


def test_unknown_format_name_is_refused(state, tmp_path: Path) -> None:
    cfg = _save(state, tmp_path)
    with pytest.raises(ValueError, match="int4"):
        load_checkpoint(tmp_path, cfg, torch.float32, keep_quantized=["int4"])
    assert set(QUANTIZED_FORMATS) == {"fp8_block", "fp4_experts"}
