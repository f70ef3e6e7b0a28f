"""The built-in tiny DeepSeek-V4 checkpoint: complete, loadable by transformers, deterministic."""

from __future__ import annotations

import copy
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v4 import tiny
from deepinfer_core.models.deepseek_v4.config import LAYER_TYPES, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.params import (
    MTP_SHARED,
    mtp_parameter_specs,
    parameter_specs,
    target_dtype,
)
from deepinfer_core.tokenizer import load_tokenizer

PROMPT = (
    "The lighthouse keeper woke before the gulls. He climbed the spiral stair, counted the "
    "steps as he always did, and wiped the salt from the great glass lens."
)


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def test_config_parses_in_both_parsers_and_covers_every_block_kind() -> None:
    ours = DeepseekV4Config.from_dict(tiny.TINY_CONFIG)
    assert set(ours.layer_types) == set(LAYER_TYPES)
    assert set(ours.mlp_layer_types) == {"hash_moe", "moe"}
    assert ours.rope_compress.rope_type == "yarn" and ours.rope_main.rope_type == "default"
    transformers = pytest.importorskip("transformers")
    # a deep copy: transformers adds keys to the nested rope_parameters dict it is given, and a
    # mutated TINY_CONFIG would change every later make_tiny of the session
    theirs = transformers.DeepseekV4Config(**copy.deepcopy(tiny.TINY_CONFIG))
    assert theirs.layer_types == ours.layer_types and theirs.compress_rates == ours.compress_rates
    assert theirs.rope_parameters["compress"]["factor"] == ours.rope_compress.factor


def test_checkpoint_holds_every_parameter_with_its_shape_and_dtype(tiny_dir: Path) -> None:
    """Every parameter, and the MTP layer's except its embedding and head (shared)."""
    cfg = DeepseekV4Config.from_file(tiny_dir)
    assert cfg.num_nextn_predict_layers == 1
    mtp = {n: s for n, s in mtp_parameter_specs(cfg).items() if not n.endswith(MTP_SHARED)}
    specs, tensors = {**parameter_specs(cfg), **mtp}, _read_tensors(tiny_dir)
    assert list(tensors) and set(tensors) == set(specs)
    assert any(n.startswith("model.mtp.0.mlp.experts.") for n in tensors)
    for name, spec in specs.items():
        assert tuple(tensors[name].shape) == spec.shape, name
        assert tensors[name].dtype == target_dtype(spec, torch.float32), name
        if spec.dtype_class == "float":
            assert tensors[name].isfinite().all(), name


def test_hash_routing_table_picks_distinct_valid_experts(tiny_dir: Path) -> None:
    tensors = _read_tensors(tiny_dir)
    tables = [v for k, v in tensors.items() if k.endswith("gate.tid2eid")]
    assert tables
    for t in tables:
        assert t.min() >= 0 and t.max() < tiny.TINY_CONFIG["n_routed_experts"]
        assert (t.sort(dim=-1).values.diff(dim=-1) != 0).all()  # no repeated expert in a row


def test_tokenizer_matches_config_special_ids(tiny_dir: Path) -> None:
    tok, cfg = load_tokenizer(tiny_dir), DeepseekV4Config.from_file(tiny_dir)
    assert tok.vocab_size == cfg.vocab_size
    assert tok.bos_token_id == cfg.bos_token_id and tok.eos_token_ids == cfg.eos_token_ids
    text = "Tiny models, big plans: ünïcödé 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]).endswith(tiny.ASSISTANT_TOKEN)


def test_transformers_loads_it_and_logits_are_finite_and_separated(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = load_tokenizer(tiny_dir).encode(PROMPT)
    assert len(ids) > 2 * tiny.TINY_CONFIG["compress_rates"]["heavily_compressed_attention"]
    with torch.inference_mode():
        logits = model.eval()(torch.tensor([ids])).logits[0]
    assert logits.shape == (len(ids), tiny.TINY_VOCAB_SIZE)
    assert logits.isfinite().all()
    top2 = logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    assert (gap > 1e-3).float().mean() >= 0.9, gap
    assert logits.std(dim=-1).mean() > 0.3  # not a flat distribution


def test_same_seed_gives_byte_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    again = tiny.make_tiny(tmp_path / "again")
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_other_seed_and_dtype_change_the_weights(tiny_dir: Path, tmp_path: Path) -> None:
    base = _read_tensors(tiny_dir)
    other = _read_tensors(tiny.make_tiny(tmp_path / "s1", seed=1))
    assert not torch.equal(base["lm_head.weight"], other["lm_head.weight"])
    bf16 = _read_tensors(tiny.make_tiny(tmp_path / "bf16", dtype=torch.bfloat16))
    assert bf16["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(bf16["lm_head.weight"], base["lm_head.weight"].bfloat16())  # same draw, rounded
    assert bf16["model.norm.weight"].dtype == torch.float32


def test_config_changes_reshape_the_checkpoint(tmp_path: Path) -> None:
    """``config=`` replaces keys of TINY_CONFIG: the written config and every tensor follow it."""
    path = tiny.make_tiny(tmp_path / "wide", config={"head_dim": 64, "index_head_dim": 32})
    cfg = DeepseekV4Config.from_file(path)
    assert (cfg.head_dim, cfg.index_head_dim, cfg.hidden_size) == (64, 32, tiny.TINY_CONFIG["hidden_size"])
    tensors = _read_tensors(path)
    for name, spec in parameter_specs(cfg).items():
        assert tuple(tensors[name].shape) == spec.shape, name
    with pytest.raises(ConfigError):
        tiny.make_tiny(tmp_path / "bad", config={"head_dim": 0})


def test_builtin_dir_is_cached_and_safe_under_concurrency(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(tiny.builtin_tiny_model_dir())) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    model_dir = results[0]
    assert model_dir.parent == tmp_path and model_dir.name.startswith("tiny-v4-")
    assert [p.name for p in tmp_path.iterdir()] == [model_dir.name]  # no temporary leftovers
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()

    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("the cached model must not be rebuilt")

    monkeypatch.setattr(tiny, "make_tiny", fail)
    assert tiny.builtin_tiny_model_dir() == model_dir


def _files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: (d / "config.json").unlink(), id="no-config"),
        pytest.param(
            lambda d: (d / "model.safetensors").write_bytes(b"not safetensors"), id="garbage-weights"
        ),
        pytest.param(
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]),
            id="truncated-weights",
        ),
        pytest.param(lambda d: (d / "config.json").write_text("{"), id="broken-config"),
        pytest.param(lambda d: (d / "tokenizer.json").unlink(), id="no-tokenizer"),
    ],
)
def test_a_damaged_cached_model_is_rebuilt_with_a_warning(
    damage, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    model_dir = tiny.builtin_tiny_model_dir()
    want = _files(tiny.make_tiny(tmp_path / "fresh"))  # what a complete one holds
    assert _files(model_dir) == want
    damage(model_dir)
    with caplog.at_level("WARNING", logger="deepinfer.model"):
        assert tiny.builtin_tiny_model_dir() == model_dir
    assert _files(model_dir) == want
    assert [p.name for p in cache.iterdir()] == [model_dir.name]  # nothing left aside
    [record] = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert str(model_dir) in record.getMessage() and "rebuilding it" in record.getMessage()


def test_a_cache_that_cannot_be_built_names_the_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "file" / "cache"))  # under a regular file
    with pytest.raises(ConfigError) as info:
        tiny.builtin_tiny_model_dir()
    msg = str(info.value)
    assert msg.startswith(f"cannot build the built-in tiny model in {tmp_path / 'file' / 'cache'}/tiny-v4-")
    assert "DEEPINFER_CACHE" in msg and "\n" not in msg


def test_cache_folder_and_files_have_ordinary_modes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The cache folder, its model folder and files: ``0777`` / ``0666`` under the umask, as
    ``mkdir`` and ``open`` give (here 027: 0750 / 0640)."""
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    umask = os.umask(0o027)
    try:
        model_dir = tiny.builtin_tiny_model_dir()
        (tmp_path / "plain_dir").mkdir()  # the oracle: what the OS gives new ones
        (tmp_path / "plain_file").write_text("")
    finally:
        os.umask(umask)
    dir_mode = (tmp_path / "plain_dir").stat().st_mode & 0o777
    file_mode = (tmp_path / "plain_file").stat().st_mode & 0o777
    assert (dir_mode, file_mode) == (0o750, 0o640)
    assert {d.stat().st_mode & 0o777 for d in (tmp_path / "cache", model_dir)} == {dir_mode}
    assert {p.name: p.stat().st_mode & 0o777 for p in model_dir.iterdir()} == dict.fromkeys(
        tiny.CACHED_FILES, file_mode
    )


def test_weights_are_held_once():
    """Fused projections replace their parts: the model holds exactly the checkpoint's bytes
    (the MTP layer's included; it shares the main embedding and head)."""
    from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer_core.models.deepseek_v4.params import parameter_specs
    from deepinfer_core.models.deepseek_v4.tiny import TINY_CONFIG, random_weights
    from deepinfer_core.ops import OpTable

    cfg = DeepseekV4Config.from_dict(dict(TINY_CONFIG), source="TINY_CONFIG")
    weights = random_weights(cfg, 0, torch.float32)
    expected = sum(t.numel() * t.element_size() for t in weights.values())
    assert set(parameter_specs(cfg)) < set(weights)  # and the MTP layer's
    model = DeepseekV4Model(cfg, weights, OpTable.reference())
    assert model.mtp is not None
    assert model.weight_bytes() == expected
    assert model.quantized_weight_bytes() == 0


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_quantised_weights_are_held_once(block):
    """With keep_quantized: a QuantizedTensor counts its data and scales, fused quantised parts
    are concatenated (32x32 blocks: every tiny part is whole blocks) and held once; parts that
    cannot be (128x128: 32-row parts) are held once too, dequantised."""
    from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config
    from deepinfer_core.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer_core.models.deepseek_v4.params import parameter_specs
    from deepinfer_core.models.deepseek_v4.tiny import TINY_CONFIG, random_weights
    from deepinfer_core.ops import OpTable
    from deepinfer_core.weights.quant import QuantizedTensor, quant_fp4, quant_fp8

    cfg = DeepseekV4Config.from_dict(dict(TINY_CONFIG), source="TINY_CONFIG")
    weights: dict = random_weights(cfg, 0, torch.float32)
    for name, spec in parameter_specs(cfg).items():
        if spec.kind == "linear" and name != "lm_head.weight":
            weights[name] = QuantizedTensor(*quant_fp8(weights[name], block), "fp8", block)
        elif spec.kind == "experts":
            weights[name] = QuantizedTensor(*quant_fp4(weights[name], 32, "ue8m0"), "fp4", (1, 32))
    fused = ("self_attn.q_a_proj.weight", "self_attn.kv_proj.weight", "mlp.shared_experts.gate_proj.weight")
    fused += ("mlp.shared_experts.up_proj.weight",)
    parts = [weights[f"model.layers.{i}.{n}"] for i in range(cfg.num_hidden_layers) for n in fused]
    # what fusion dequantises at load (128x128 only): these parts' bytes, as float32 values instead
    forced_q = sum(w.nbytes for w in parts) if block == (128, 128) else 0
    forced_plain = sum(w.shape.numel() * 4 for w in parts) if block == (128, 128) else 0
    quantized = sum(w.nbytes for w in weights.values() if isinstance(w, QuantizedTensor))
    plain = sum(w.numel() * w.element_size() for w in weights.values() if isinstance(w, torch.Tensor))
    model = DeepseekV4Model(cfg, weights, OpTable.reference())
    assert model.weight_bytes() == plain + quantized - forced_q + forced_plain
    assert model.quantized_weight_bytes() == quantized - forced_q
