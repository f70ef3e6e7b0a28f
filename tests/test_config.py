"""EngineConfig: validation, sources and precedence."""

from __future__ import annotations

import pytest

from deepinfer_core.config import EngineConfig, did_you_mean, env_var_name, read_config_file
from deepinfer_core.errors import ConfigError


def test_defaults():
    c = EngineConfig.load(env={})
    assert c == EngineConfig()
    assert (c.backend, c.dtype, c.max_num_seqs, c.max_num_batched_tokens, c.seed) == (
        "auto",
        "auto",
        64,
        2048,
        0,
    )
    assert c.max_model_len is None and c.page_size is None and c.enable_chunked_prefill


def test_precedence_defaults_file_env_args(tmp_path):
    f = tmp_path / "engine.toml"
    f.write_text('max_num_seqs = 4\nmax_num_batched_tokens = 100\nbackend = "reference"\nseed = 3\n')
    env = {"DEEPINFER_MAX_NUM_BATCHED_TOKENS": "200", "DEEPINFER_SEED": "5"}
    c = EngineConfig.load(config_file=f, env=env, seed=7, max_model_len=None)
    assert c.max_num_seqs == 4  # file over default
    assert c.max_num_batched_tokens == 200  # env over file
    assert c.seed == 7  # argument over env
    assert c.backend == "reference"  # file, untouched by the rest
    assert c.max_model_len is None  # a None argument does not override


def test_yaml_file(tmp_path):
    f = tmp_path / "engine.yaml"
    f.write_text(
        "max_num_seqs: 2\nenable_chunked_prefill: false\nmax_model_len: 512\nmax_num_batched_tokens: 512\n"
    )
    c = EngineConfig.load(config_file=f, env={})
    assert (c.max_num_seqs, c.enable_chunked_prefill, c.max_model_len) == (2, False, 512)


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("max_num_seq = 4\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(config_file=f, env={})
    assert "max_num_seq" in str(e.value) and str(f) in str(e.value)


def test_misspelt_keys_get_the_field_they_resemble(tmp_path):
    f = tmp_path / "typo.yaml"
    f.write_text("max_num_seq: 4\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(config_file=f, env={})
    assert str(e.value) == f"config file {f}: unknown key 'max_num_seq'; did you mean 'max_num_seqs'?"
    f.write_text("kv-cache-dtype: fp8\nbackned: reference\nmax_num_seqs: 2\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(config_file=f, env={})
    assert str(e.value) == (
        f"config file {f}: unknown keys ['backned', 'kv-cache-dtype']; did you mean 'backend' for "
        "'backned'?; did you mean 'kv_cache_dtype' for 'kv-cache-dtype'?"
    )
    f.write_text("colour: blue\n")  # like no field: the known keys are listed instead
    with pytest.raises(ConfigError, match=r"unknown key 'colour'; known keys: \['async_scheduling'"):
        EngineConfig.load(config_file=f, env={})
    with pytest.raises(
        ConfigError, match=r"^unknown engine option 'data_paralel_size'; did you mean 'data_parallel_size'\?$"
    ):
        EngineConfig.load(env={}, data_paralel_size=2)
    for name in EngineConfig.model_fields:  # every field is its own nearest name
        assert did_you_mean(name[:-1], EngineConfig.model_fields).startswith(f"; did you mean {name!r}")


def test_bad_value_names_field_and_source(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("max_num_seqs: 0\n")
    with pytest.raises(ConfigError, match=r"max_num_seqs=0 \(from config file .*bad.yaml\).*>= 1"):
        EngineConfig.load(config_file=f, env={})
    with pytest.raises(
        ConfigError, match=r"max_num_seqs='lots' \(from environment variable DEEPINFER_MAX_NUM_SEQS\)"
    ):
        EngineConfig.load(env={"DEEPINFER_MAX_NUM_SEQS": "lots"})
    with pytest.raises(ConfigError, match=r"dtype='fp8' \(from argument\)"):
        EngineConfig.load(env={}, dtype="fp8")


def test_env_vars_are_parsed_by_field_type():
    env = {
        "DEEPINFER_MAX_NUM_SEQS": "8",
        "DEEPINFER_STRICT_OPS": "yes",
        "DEEPINFER_ENABLE_CHUNKED_PREFILL": "0",
        "DEEPINFER_KV_CACHE_MEMORY_GB": "1.5",
        "DEEPINFER_MAX_MODEL_LEN": "none",
        "DEEPINFER_MAX_NUM_BATCHED_TOKENS": "4096",
        "DEEPINFER_BACKEND": "reference",
        "DEEPINFER_PLUGINS": "core",  # not an engine field: ignored
    }
    c = EngineConfig.load(env=env)
    assert c.max_num_seqs == 8 and c.strict_ops is True and c.enable_chunked_prefill is False
    assert c.kv_cache_memory_gb == 1.5 and c.max_model_len is None and c.backend == "reference"
    with pytest.raises(ConfigError, match="DEEPINFER_STRICT_OPS='maybe'.*yes/no, on/off"):
        EngineConfig.load(env={"DEEPINFER_STRICT_OPS": "maybe"})
    assert EngineConfig.load(env={"DEEPINFER_ASYNC_SCHEDULING": "off"}).async_scheduling is False
    # an optional bool: on/off as the others, or none for "not set" (the backend decides)
    assert EngineConfig.load(env={"DEEPINFER_KEEP_QUANTIZED": "on"}).keep_quantized is True
    assert EngineConfig.load(env={"DEEPINFER_KEEP_QUANTIZED": "0"}).keep_quantized is False
    assert EngineConfig.load(env={"DEEPINFER_KEEP_QUANTIZED": "none"}).keep_quantized is None
    assert (
        EngineConfig.load(env={"DEEPINFER_KEEP_QUANTIZED": "1"}, keep_quantized=False).keep_quantized is False
    )
    with pytest.raises(ConfigError, match="DEEPINFER_KEEP_QUANTIZED='fp8'"):
        EngineConfig.load(env={"DEEPINFER_KEEP_QUANTIZED": "fp8"})
    assert env_var_name("max_num_seqs") == "DEEPINFER_MAX_NUM_SEQS"


def test_unknown_argument_is_rejected():
    with pytest.raises(ConfigError, match="'max_seqs'"):
        EngineConfig.load(env={}, max_seqs=3)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_config_file(tmp_path / "missing.toml")
    ini = tmp_path / "c.ini"
    ini.write_text("x=1")
    with pytest.raises(ConfigError, match="unsupported extension"):
        read_config_file(ini)
    broken = tmp_path / "c.toml"
    broken.write_text("max_num_seqs = = 3")
    with pytest.raises(ConfigError, match="could not be parsed"):
        read_config_file(broken)


def test_unchunked_prefill_needs_budget_for_a_whole_prompt():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048)
    assert EngineConfig(enable_chunked_prefill=False, max_model_len=2048, max_num_batched_tokens=2048)
    with pytest.raises(ConfigError, match=r"max_num_seqs=-1: must be >= 1"):
        EngineConfig(max_num_seqs=-1)


def test_resolved_values():
    c = EngineConfig()
    assert c.resolved_page_size([0, 4, 128, 4]) == 128
    assert c.resolved_page_size([0, 4, 8]) == 16
    assert c.resolved_page_size([0, 0]) == 16
    assert c.resolved_page_size([4, 24]) == 48
    assert EngineConfig(page_size=256).resolved_page_size([4, 128]) == 256
    with pytest.raises(
        ConfigError, match="page_size=64 is not a multiple of the model's compress ratios \\[128\\]"
    ):
        EngineConfig(page_size=64).resolved_page_size([4, 128])
    assert c.resolved_max_model_len(1_048_576) == 8192 and c.resolved_max_model_len(4096) == 4096
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        EngineConfig(max_model_len=5000).resolved_max_model_len(4096)
    assert c.resolved_dtype("cpu") == "float32" and c.resolved_dtype("cuda") == "bfloat16"
    assert EngineConfig(dtype="float16").resolved_dtype("cpu") == "float16"
    assert c.keep_quantized is None and c.resolved_quantized_formats() == ()
    assert c.resolved_quantized_formats(("fp4_experts",)) == ("fp4_experts",)
    assert EngineConfig(keep_quantized=True).resolved_quantized_formats() == ("fp8_block", "fp4_experts")
    assert EngineConfig(keep_quantized=False).resolved_quantized_formats(("fp8_block",)) == ()


def test_device_timeout_is_a_non_negative_number_of_seconds():
    """``device_timeout_s``: 600 by default, 0 turns the limit off; a negative, NaN or infinite
    value is refused naming the field, from an argument or its environment variable."""
    assert EngineConfig().device_timeout_s == 600.0 and EngineConfig(device_timeout_s=0).device_timeout_s == 0
    assert EngineConfig.load(env={"DEEPINFER_DEVICE_TIMEOUT_S": "2.5"}).device_timeout_s == 2.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="device_timeout_s.*must be >= 0"):
            EngineConfig(device_timeout_s=bad)
    with pytest.raises(ConfigError, match=r"'-3' \(from environment variable DEEPINFER_DEVICE_TIMEOUT_S\)"):
        EngineConfig.load(env={"DEEPINFER_DEVICE_TIMEOUT_S": "-3"})
