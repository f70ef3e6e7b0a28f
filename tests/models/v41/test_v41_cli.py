"""``deepinfer make-tiny --arch deepseek_v41`` and the core's registration of the family."""

from __future__ import annotations

import json

from safetensors import safe_open

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.cli import main
from deepinfer_core.models.deepseek_v41.family import FAMILY
from deepinfer_core.testing.managers import core_only_manager


def test_the_core_registers_deepseek_v41_and_plugins_shows_it(capsys):
    spec = core_only_manager().get_component("models", "deepseek_v41")
    assert spec.plugin == "core" and spec.factory() is FAMILY
    assert main(["plugins"]) in (0, 1)
    core = next(p for p in json.loads(capsys.readouterr().out) if p["name"] == "core")
    [row] = [m for m in core["models"] if m["name"] == "deepseek_v41"]
    assert row["available"] and "DSpark drafter 'dspark'" in row["description"]


def test_make_tiny_arch_deepseek_v41_writes_a_servable_checkpoint(tmp_path, capsys):
    out = tmp_path / "v41"
    assert main(["make-tiny", "--arch", "deepseek_v41", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert (
        config["model_type"] == "deepseek_v41" and config["text_config"]["model_type"] == "deepseek_v41_text"
    )
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        names = set(st.keys())  # noqa: SIM118 (safe_open is not a dict)
    assert "layers.0.attn.wq_a.weight" in names and "layers.3.ffn.experts.7.w2.weight" in names
    assert "layers.1.engram.embed.weight" in names and not any(n.endswith(".scale") for n in names)
    llm = LLM(model=str(out), backend="reference", max_num_seqs=2)  # resolved through the core's registry
    [result] = llm.generate(
        "The lighthouse keeper", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False
    )
    assert len(result.outputs[0].token_ids) == 4


def test_make_tiny_quantized_writes_the_release_formats(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["make-tiny", "--arch", "deepseek_v41", "--quantized", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    assert (
        config["quantization_config"]["scale_fmt"] == "ue8m0"
        and config["text_config"]["expert_dtype"] == "fp4"
    )
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        assert str(st.get_tensor("layers.0.attn.wq_a.weight").dtype) == "torch.float8_e4m3fn"
        assert str(st.get_tensor("layers.0.attn.wq_a.scale").dtype) == "torch.float8_e8m0fnu"
        assert str(st.get_tensor("layers.2.ffn.experts.0.w1.weight").dtype) == "torch.uint8"
        assert str(st.get_tensor("layers.1.engram.embed.weight").dtype) == "torch.float8_e4m3fn"


def test_make_tiny_writes_the_dspark_drafter_unless_told_not_to(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["make-tiny", "--arch", "deepseek_v41", str(out)]) == 0
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["num_nextn_predict_layers"], text["dspark_noise_token_id"]) == (3, 510)
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        names = set(st.keys())  # noqa: SIM118 (safe_open is not a dict)
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.head.weight", "mtp.2.confidence_head.weight"} < names
    assert "mtp.1.ffn.experts.3.w2.weight" in names
    bare = tmp_path / "n"
    assert main(["make-tiny", "--arch", "deepseek_v41", "--no-dspark", str(bare)]) == 0
    with safe_open(str(bare / "model.safetensors"), "pt") as st:
        assert not any(name.startswith("mtp.") for name in st.keys())  # noqa: SIM118


def test_make_tiny_quantized_needs_deepseek_v41(tmp_path, capsys):
    assert main(["make-tiny", "--quantized", str(tmp_path / "x")]) == 2
    assert "only with --arch deepseek_v41" in capsys.readouterr().err
    assert main(["make-tiny", "--dspark", str(tmp_path / "z")]) == 2
    assert "--dspark: only with --arch deepseek_v41" in capsys.readouterr().err
    assert main(["make-tiny", "--arch", "llama", str(tmp_path / "y")]) == 2
    assert "invalid choice: 'llama'" in capsys.readouterr().err
