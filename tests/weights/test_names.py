"""Native DeepSeek <-> HF name mapping, scale-sibling detection and the reference name list."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from deepinfer_core.models.deepseek_v4.names import (
    ExpertSlice,
    expert_native_names,
    hf_to_native,
    is_expert_stack,
    is_ignorable,
    native_to_hf,
    scale_owner,
)
from deepinfer_core.models.deepseek_v4.params import parameter_specs

# The native names listed in shared/reference/deepseek-models.md ("Checkpoint: native names ...").
REFERENCE_NATIVE = [
    r"embed\.weight",
    r"head\.weight",
    r"norm\.weight",
    r"layers\.\d+\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|q_norm|kv_norm)\.weight",
    r"layers\.\d+\.attn\.attn_sink",
    r"layers\.\d+\.attn\.compressor\.(wkv\.weight|wgate\.weight|ape|norm\.weight)",
    r"layers\.\d+\.attn\.indexer\.(wq_b|weights_proj)\.weight",
    r"layers\.\d+\.attn\.indexer\.compressor\.(wkv\.weight|wgate\.weight|ape|norm\.weight)",
    r"layers\.\d+\.ffn\.gate\.(weight|bias|tid2eid)",
    r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight",
    r"layers\.\d+\.ffn\.shared_experts\.w[123]\.weight",
    r"layers\.\d+\.(attn_norm|ffn_norm)\.weight",
    r"layers\.\d+\.hc_(attn|ffn)_(fn|base|scale)",
    r"hc_head_(fn|base|scale)",
]


def test_every_hf_name_round_trips_through_native(tiny: Any) -> None:
    specs = parameter_specs(tiny.cfg)
    for hf, spec in specs.items():
        if is_expert_stack(hf):
            for e in range(spec.shape[0]):
                for part, native in expert_native_names(hf, e).items():
                    assert native_to_hf(native) == ExpertSlice(hf, e, part)
        else:
            native = hf_to_native(hf)
            assert not native.startswith("model.") and "self_attn" not in native and "mlp" not in native
            assert native_to_hf(native) == hf, (hf, native)


def test_written_native_names_match_reference_list(tiny: Any, tmp_path: Path) -> None:
    tiny.save(tmp_path, names="native")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = list(f.keys())  # noqa: SIM118
    used = set()
    for name in written:
        hits = [p for p in REFERENCE_NATIVE if re.fullmatch(p, name)]
        assert len(hits) == 1, name
        used.add(hits[0])
    assert used == set(REFERENCE_NATIVE)


@pytest.mark.parametrize(
    ("native", "hf"),
    [
        (
            "layers.3.attn.indexer.compressor.norm.weight",
            "model.layers.3.self_attn.compressor.indexer.kv_norm.weight",
        ),
        ("layers.1.attn.compressor.norm.weight", "model.layers.1.self_attn.compressor.kv_norm.weight"),
        ("layers.1.attn.indexer.wq_b.weight", "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"),
        ("layers.1.attn.wq_b.weight", "model.layers.1.self_attn.q_b_proj.weight"),
        ("layers.2.ffn.gate.bias", "model.layers.2.mlp.gate.e_score_correction_bias"),
        ("norm.weight", "model.norm.weight"),
        ("head.weight", "lm_head.weight"),
        # transformers' save_pretrained spellings
        ("model.layers.0.attn.norm.weight", "model.layers.0.self_attn.kv_norm.weight"),
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.hc_head.hc_fn", "model.hc_head.hc_fn"),
    ],
)
def test_rule_order_cases(native: str, hf: str) -> None:
    assert native_to_hf(native) == hf


def test_expert_parts_map_w1_gate_w3_up_w2_down() -> None:
    assert native_to_hf("layers.2.ffn.experts.7.w1.weight") == ExpertSlice(
        "model.layers.2.mlp.experts.gate_up_proj", 7, "gate"
    )
    assert native_to_hf("layers.2.ffn.experts.7.w3.weight").part == "up"
    assert native_to_hf("layers.2.ffn.experts.7.w2.weight") == ExpertSlice(
        "model.layers.2.mlp.experts.down_proj", 7, "down"
    )


def test_hf_names_are_not_native() -> None:
    assert native_to_hf("model.layers.0.self_attn.q_a_proj.weight") is None
    assert native_to_hf("model.layers.1.mlp.experts.gate_up_proj") is None
    assert native_to_hf("layers.0.attn.bogus.weight") is None


def test_scale_owner_requires_the_weight() -> None:
    names = frozenset(
        {"layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "model.layers.0.attn_hc.scale"}
    )
    assert scale_owner("layers.0.attn.wq_a.scale", names) == "layers.0.attn.wq_a.weight"
    assert scale_owner("model.layers.0.attn_hc.scale", names) is None
    hf = frozenset(
        {"a.q.weight", "a.q.weight_scale_inv", "m.experts.gate_up_proj", "m.experts.gate_up_proj_scale_inv"}
    )
    assert scale_owner("a.q.weight_scale_inv", hf) == "a.q.weight"
    assert scale_owner("m.experts.gate_up_proj_scale_inv", hf) == "m.experts.gate_up_proj"


def test_ignorable_names() -> None:
    assert is_ignorable("mtp.0.attn.wq_a.weight")
    assert is_ignorable("model.rotary_emb.main_inv_freq")
    assert not is_ignorable("layers.0.attn.wq_a.weight")
