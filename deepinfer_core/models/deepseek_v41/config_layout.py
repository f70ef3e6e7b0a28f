"""The layout of a DeepSeek-V4.1 ``config.json``: the released wrapper (``model_type:
deepseek_v41`` with ``text_config`` and ``vision_config``) unwrapped to its text config, the
shape fields required, the keys known besides the config's fields (see
:mod:`deepinfer_core.models.deepseek_v41.config`)."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from deepinfer_core.errors import ConfigError
from deepinfer_core.models.config_utils import check_fields, check_model_type

LABEL = "DeepSeek-V4.1"
MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"

SHAPE_FIELDS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "qk_rope_head_dim",
    "o_groups",
    "o_lora_rank",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "hc_mult",
    "sliding_window",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "engram_layer_ids",
)
"""Text-config fields without a default: they decide tensor or cache shapes (which layers own a
compressor, an indexer or an engram table).  With a non-empty ``engram_layer_ids`` the
:data:`ENGRAM_SHAPE_FIELDS` are required too."""

ENGRAM_SHAPE_FIELDS: tuple[str, ...] = (
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
)

# keys consumed by the normalisation, and transformers' bookkeeping: known, not listed as unknown
LAYOUT_KEYS = frozenset(
    {
        "architectures",
        "transformers_version",
        "dtype",
        "rope_parameters",
        "rope_scaling",
        "layer_types",  # derived by transformers from kv_source_layer_ids; recomputed here
        "engram_pad_token_id",  # the released config's name of engram_pad_id
        "attribute_map",
        "use_cache",
        "initializer_range",
        "attention_bias",
        "attention_dropout",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "keys_to_ignore_at_inference",
    }
)
# keys of the wrapper config (model_type deepseek_v41) besides text_config / vision_config
WRAPPER_KEYS = frozenset(
    {
        "model_type",
        "text_config",
        "vision_config",
        "quantization_config",
        "image_token_id",
        "tie_word_embeddings",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    }
)

logger = logging.getLogger("deepinfer.model")


def unwrap_text_config(data: Any, source: str) -> dict[str, Any]:
    """The text config of ``data`` with the wrapper's quantisation config and token ids merged in."""
    if check_model_type(data, source, LABEL, MODEL_TYPE, also=(TEXT_MODEL_TYPE,)) == TEXT_MODEL_TYPE:
        return dict(data)
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(
            f"invalid {LABEL} config in {source}: missing text_config (the text backbone's config)"
        )
    inner = text.get("model_type", TEXT_MODEL_TYPE)
    if inner != TEXT_MODEL_TYPE:
        raise ConfigError(
            f"invalid {LABEL} config in {source}: text_config.model_type is {inner!r}, expected "
            f"{TEXT_MODEL_TYPE!r}"
        )
    if data.get("vision_config") is not None:
        logger.info("%s: vision_config ignored (DeepInfer serves the text backbone only)", source)
    unknown = sorted(k for k in data if k not in WRAPPER_KEYS)
    if unknown:
        logger.debug(
            "%s: top-level keys a DeepSeek-V4.1 config does not use, ignored: %s", source, ", ".join(unknown)
        )
    merged = dict(text)
    for key in ("quantization_config", "image_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
        if data.get(key) is not None and merged.get(key) is None:
            merged[key] = data[key]
    if merged.get("torch_dtype") is None and merged.get("dtype") is None:
        merged["torch_dtype"] = data.get("torch_dtype") or data.get("dtype")
    merged["model_type"] = MODEL_TYPE
    return merged


def check_text_keys(data: dict[str, Any], source: str, fields: Collection[str]) -> None:
    """The shape fields of the text config checked; its keys in neither ``fields`` (the
    config's) nor :data:`LAYOUT_KEYS` logged."""
    missing = [n for n in SHAPE_FIELDS if data.get(n) is None]
    if data.get("engram_layer_ids"):
        missing += [n for n in ENGRAM_SHAPE_FIELDS if data.get(n) is None]
    check_fields(data, source, LABEL, missing, set(fields) | LAYOUT_KEYS)
