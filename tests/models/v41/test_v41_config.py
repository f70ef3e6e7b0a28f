"""DeepSeek-V4.1 config parsing: the released config.json, its checks, and the family's refusals."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v41.config import DeepseekV41Config
from deepinfer_core.models.deepseek_v41.config_layout import SHAPE_FIELDS
from deepinfer_core.models.deepseek_v41.family import FAMILY, replay_tail
from deepinfer_core.models.deepseek_v41.tiny import TINY_CONFIG, tiny_config

RELEASED = Path(__file__).with_name("released_config.json")


def released() -> dict:
    """The released checkpoint's config.json (every key of transformers-main's config classes,
    with the released values)."""
    return json.loads(RELEASED.read_text())


def test_the_released_config_parses_with_every_key():
    cfg = DeepseekV41Config.from_dict(released(), "config.json")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (129280, 5120, 40, 512)
    assert cfg.compress_ratios == [0, 0] + [2] * 18 + [1] * 20
    assert cfg.draft_compress_ratios == [0, 0, 0]  # the 3 DSpark layers' entries, split off
    assert cfg.kv_source_layer_ids == [2, 8, 14, 20]
    assert cfg.index_source_layer_ids == [2, 8, 14, 20, 24, 28, 32, 36]
    assert cfg.candidate_source_layer_id == 20
    assert (cfg.candidate_topk_blocks, cfg.candidate_block_size) == (2048, 8)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 512)
    assert cfg.engram_layer_ids == [1, 14] and cfg.engram_num_embeddings == [384006168, 384016682]
    assert (cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_head_dim) == (4, 8, 256)
    assert (cfg.engram_pad_id, cfg.engram_compressed_vocab_size) == (2, 99092)
    assert cfg.engram_vocab_size == 16000000
    assert (cfg.num_nextn_predict_layers, cfg.dspark_block_size, cfg.dspark_noise_token_id) == (3, 5, 128799)
    assert cfg.dspark_target_layer_ids == [37, 38, 39]
    assert (cfg.dspark_markov_rank, cfg.dspark_n_routed_experts) == (256, 128)
    assert cfg.dspark_num_experts_per_tok == 3
    assert cfg.rms_norm_eps == 1e-20 and cfg.expert_dtype == "fp4" and cfg.n_routed_experts == 384
    quant = cfg.quant
    assert quant is not None and quant.weight_block_size == (32, 32) and quant.scale_fmt == "ue8m0"
    assert cfg.rope_compress.rope_type == "yarn" and cfg.rope_compress.factor == 16
    assert cfg.rope_compress.rope_theta == 160000 and cfg.rope_main.rope_type == "default"
    # the CED layout as the engine reads it
    assert [cfg.kv_source(i) for i in (2, 7, 8, 19, 20, 39)] == [2, 2, 8, 14, 20, 20]
    assert [cfg.index_source(i) for i in (20, 23, 24, 27, 39)] == [20, 20, 24, 24, 36]
    assert not cfg.uses_candidates(20) and cfg.uses_candidates(24) and not cfg.uses_candidates(14)
    assert cfg.eos_token_ids == [1]


def test_the_released_engram_pad_token_id_is_read_as_engram_pad_id():
    """The release spells transformers' ``engram_pad_id`` ``engram_pad_token_id``."""
    data = released()
    del data["text_config"]["engram_pad_id"]
    data["text_config"]["engram_pad_token_id"] = 7
    assert DeepseekV41Config.from_dict(data, "config.json").engram_pad_id == 7
    data["text_config"]["engram_pad_id"] = 7  # both, agreeing
    assert DeepseekV41Config.from_dict(data, "config.json").engram_pad_id == 7
    data["text_config"]["engram_pad_id"] = 2
    with pytest.raises(ConfigError, match=r"json: .*engram_pad_token_id \(7\) and engram_pad_id \(2\)"):
        DeepseekV41Config.from_dict(data, "config.json")


def test_vision_keys_are_ignored_with_one_log_line(caplog):
    with caplog.at_level(logging.DEBUG, logger="deepinfer.model"):
        DeepseekV41Config.from_dict(released(), "ckpt/config.json")
    vision = [r for r in caplog.records if "vision" in r.getMessage()]
    assert len(vision) == 1 and vision[0].levelno == logging.INFO
    assert "ckpt/config.json" in vision[0].getMessage()
    # every released key is known: nothing listed as unknown
    assert not [r for r in caplog.records if "does not use" in r.getMessage()]


def test_unknown_keys_are_listed_once_at_debug(caplog):
    data = released()
    data["text_config"]["brand_new_key"] = 1
    data["another_top_level"] = True
    with caplog.at_level(logging.DEBUG, logger="deepinfer.model"):
        DeepseekV41Config.from_dict(data, "config.json")
    unknown = [r for r in caplog.records if "does not use" in r.getMessage()]
    assert len(unknown) == 2 and all(r.levelno == logging.DEBUG for r in unknown)
    assert "brand_new_key" in unknown[0].getMessage() + unknown[1].getMessage()
    assert "another_top_level" in unknown[0].getMessage() + unknown[1].getMessage()


@pytest.mark.parametrize("field", SHAPE_FIELDS)
def test_a_missing_shape_field_is_named_with_the_file(field):
    data = released()
    del data["text_config"][field]
    with pytest.raises(ConfigError, match=f"ckpt/config.json: missing {field}") as e:
        DeepseekV41Config.from_dict(data, "ckpt/config.json")
    assert "\n" not in str(e.value)


def test_engram_sizes_are_required_only_with_engram_layers():
    data = released()
    del data["text_config"]["engram_head_dim"]
    with pytest.raises(ConfigError, match="missing engram_head_dim"):
        DeepseekV41Config.from_dict(data, "config.json")
    data["text_config"]["engram_layer_ids"] = []
    data["text_config"]["engram_num_embeddings"] = []
    assert DeepseekV41Config.from_dict(data, "config.json").engram_layer_ids == []


def test_a_bare_text_config_parses_and_the_wrapper_is_checked():
    text = released()["text_config"]
    assert DeepseekV41Config.from_dict(copy.deepcopy(text), "t").num_hidden_layers == 40
    wrong = released()
    wrong["text_config"]["model_type"] = "deepseek_v4"
    with pytest.raises(ConfigError, match="text_config.model_type is 'deepseek_v4'"):
        DeepseekV41Config.from_dict(wrong, "config.json")
    with pytest.raises(ConfigError, match="missing text_config"):
        DeepseekV41Config.from_dict({"model_type": "deepseek_v41"}, "config.json")
    with pytest.raises(ConfigError, match="not a DeepSeek-V4.1 config"):
        DeepseekV41Config.from_dict({**text, "model_type": "deepseek_v4"}, "config.json")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kv_source_layer_ids": [2, 8, 14, 21]}, "reads the compressed cache of kv source"),
        ({"kv_source_layer_ids": [1, 8]}, "must have compress_ratios"),
        ({"index_source_layer_ids": [2, 8, 20, 24]}, r"kv source layers \[14\] are not in index_source"),
        ({"candidate_source_layer_id": 21}, "must be in index_source_layer_ids"),
        ({"compress_ratios": [0] * 40 + [0, 0, 0, 0]}, "compress_ratios has 44 entries"),
        ({"compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [2, 0, 0]}, "draft layers"),
        ({"engram_num_embeddings": [1]}, "engram_num_embeddings has 1 entries"),
        ({"num_key_value_heads": 2}, "one shared KV head"),
    ],
)
def test_the_layout_is_checked(changes, message):
    data = released()
    data["text_config"].update(changes)
    with pytest.raises(ConfigError, match=message):
        DeepseekV41Config.from_dict(data, "config.json")


def test_the_candidate_source_defaults_to_the_last_kv_source():
    data = released()
    del data["text_config"]["candidate_source_layer_id"]
    assert DeepseekV41Config.from_dict(data, "c").candidate_source_layer_id == 20
    data["text_config"]["candidate_source_layer_id"] = -1  # one-level top-k
    cfg = DeepseekV41Config.from_dict(data, "c")
    assert not any(cfg.uses_candidates(i) for i in range(40))


def test_the_family_refuses_what_it_cannot_run_yet_in_one_line(tmp_path):
    data = released()
    data["text_config"]["norm_topk_prob"] = False
    cfg = FAMILY.parse_config(data, "config.json")
    for call in (
        lambda: FAMILY.build_model(cfg, {}, None),
        lambda: FAMILY.load_weights(tmp_path, cfg, None, None, ()),
    ):
        with pytest.raises(ConfigError) as e:
            call()
        assert str(e.value).startswith("model family 'deepseek_v41': not implemented yet: routing without")
        assert "\n" not in str(e.value)


def test_the_engram_hash_layout_reproduces_the_released_table_sizes(tmp_path):
    """Primes drawn in order above engram_vocab_size, never reused: each layer's table has the sum
    of its 3 n-gram sizes x 8 heads primes -- exactly the released engram_num_embeddings."""
    from deepinfer_core.models.deepseek_v41.engram import EngramLayout, hash_multipliers

    cfg = DeepseekV41Config.from_dict(released(), "config.json")
    layout = EngramLayout.from_config(cfg)
    assert list(layout.rows) == cfg.engram_num_embeddings == [384006168, 384016682]
    flat = [p for layer in layout.primes for per_n in layer for p in per_n]
    assert len(set(flat)) == 48 and min(flat) > 16000000 and flat == sorted(flat)
    mult = hash_multipliers(cfg.engram_layer_ids, 4, cfg.engram_compressed_vocab_size)
    assert mult.shape == (2, 4) and bool((mult % 2 == 1).all())
    assert bool((mult < torch.iinfo(torch.int64).max // cfg.engram_compressed_vocab_size).all())
    data = released()
    data["text_config"]["engram_num_embeddings"] = [384006168, 1]
    bad = DeepseekV41Config.from_dict(data, "config.json")
    with pytest.raises(ConfigError, match="does not match the hash layout's table sizes"):
        FAMILY.load_weights(tmp_path, bad, None, None, ())


def test_the_tiny_config_covers_every_layer_kind():
    cfg = DeepseekV41Config.from_dict(copy.deepcopy(TINY_CONFIG), "tiny")
    kinds = set()
    for i in range(cfg.num_hidden_layers):
        r = cfg.compress_ratio(i)
        kind = "sliding" if r == 0 else ("source" if cfg.is_kv_source(i) else "consumer")
        kind += "" if r == 0 else (f"/r{r}" + ("/index" if cfg.is_index_source(i) else "/reuse"))
        kinds.add(kind + ("/candidates" if cfg.is_index_source(i) and cfg.uses_candidates(i) else ""))
    assert kinds == {
        "sliding",
        "source/r2/index",
        "consumer/r2/reuse",
        "consumer/r2/index",
        "source/r1/index",
        "consumer/r1/reuse",
        "consumer/r1/index/candidates",
    }
    assert FAMILY.cache_ratios(cfg) == [1, 2]
    # every layer keeps a window: the exact replay bound grows a window per layer
    assert replay_tail(cfg, 16) == 96
    assert DeepseekV41Config.from_dict(tiny_config(head_dim=24), "t").head_dim == 24
