"""A tiny, random DeepSeek-V4.1 checkpoint (``deepinfer make-tiny --arch deepseek_v41``).

:data:`TINY_CONFIG` is the released ``config.json`` layout (``model_type: deepseek_v41`` with a
``text_config`` and a ``vision_config``) shrunk to milliseconds on a CPU while keeping every
layer kind of the causal encoder-decoder:

====  =====  ===========================================================
layer  ratio  role
====  =====  ===========================================================
0, 1   0      sliding window only (``main`` rope)
2      2      encoder kv + index source (group A)
3      2      Reuse (group A)
4      2      encoder kv + index source (group B)
5      2      Reindex (group B, one-level top-k)
6      1      decoder kv + index source, candidate source (full resolution)
7      1      Reuse
8      1      Reindex inside the candidate blocks (two-level top-k)
9      1      Reuse
====  =====  ===========================================================

with ``index_topk`` 4 and 3 candidate blocks of 2 entries, so both levels of the top-k select
within a few dozen tokens; head and indexer dims are whole blocks of the release's KV formats
(FP8 window records per 32, FP4 entries per 16, FP4 indexer keys per 32), so their numerics
are exercised.  Layers 1 and 4 have Engram tables (2..4-grams x 2 heads of 16 channels; the
table sizes and the normalised vocabulary follow from the config and the tokenizer).  Weights
use the native names (:mod:`.params`), routed experts stored per expert; ``fp8_linear`` /
``fp4_experts`` write the release's MXFP8 (32x32 ue8m0 block scales) dense linears, e4m3
Engram rows and MXFP4 experts.  The tokenizer is the V4 tiny one.
"""

from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.models.deepseek_v4.tiny import TINY_VOCAB_SIZE, write_tokenizer_files
from deepinfer_core.weights.quant import QuantizedTensor, quant_fp4, quant_fp8
from deepinfer_core.weights.writer import save_safetensors

from .config import DeepseekV41Config
from .family import parse_config
from .params import EXPERT_STACKS, ParamSpec, dspark_parameter_specs, parameter_specs, target_dtype
from .weights import load_weights

TINY_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 10,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 64,
    },
    "max_position_embeddings": 1024,
    "sliding_window": 8,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0],  # + one draft layer, as released
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 5, 6, 8],
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 2,
    "index_n_heads": 8,  # >= 8: with fewer heads the indexer's relu scores tie too often
    "index_head_dim": 32,
    "index_topk": 4,
    "o_groups": 2,
    "o_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "gate_temp": 1.0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc",
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 4],  # a sliding-only layer and a kv source, as the release's 1 and 14
    "engram_vocab_size": 100,
    "engram_num_embeddings": [660, 864],  # the sums of each layer's primes (EngramLayout)
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 16,
    "engram_pad_id": 2,
    "engram_compressed_vocab_size": 421,  # the tiny tokenizer's normalised vocabulary
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-20,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": TINY_TEXT_CONFIG,
    "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 32, "num_hidden_layers": 1},
    "image_token_id": TINY_VOCAB_SIZE - 1,
    "tie_word_embeddings": False,
}
MXFP8_BLOCK = (32, 32)
TINY_DSPARK_CHANGES: dict[str, Any] = {
    "num_nextn_predict_layers": 3,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],  # + the three draft layers
    "dspark_block_size": 5,
    "dspark_noise_token_id": TINY_VOCAB_SIZE - 2,  # 510 (511 is image_token_id)
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}
"""Text-config changes of a tiny checkpoint with the DSpark drafter (``make_tiny(dspark=True)``);
``dspark_target_layer_ids`` keeps its default, ``[7, 8, 9]`` (the last three non-source layers)."""


def tiny_config(**text_changes: Any) -> dict[str, Any]:
    """A deep copy of :data:`TINY_CONFIG` with ``text_changes`` applied to its ``text_config``."""
    cfg = copy.deepcopy(TINY_CONFIG)
    cfg["text_config"].update(text_changes)
    return cfg


def all_specs(cfg: DeepseekV41Config, dspark: bool = False) -> dict[str, ParamSpec]:
    """:func:`~.params.parameter_specs`, with ``dspark`` also the drafter's
    (:func:`~.params.dspark_parameter_specs`)."""
    specs = parameter_specs(cfg)
    if dspark:
        specs.update(dspark_parameter_specs(cfg))
    return specs


def random_weights(
    cfg: DeepseekV41Config, seed: int = 0, dtype: torch.dtype = torch.float32, dspark: bool = False
) -> dict[str, torch.Tensor]:
    """Random weights for every entry of :func:`~.params.parameter_specs` (inventory names),
    with ``dspark`` also the drafter's, each from its own generator seeded by ``seed`` and its
    name."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in all_specs(cfg, dspark).items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        out[name] = _init_param(name, spec, g).to(target_dtype(spec, dtype)).contiguous()
    return out


def _init_param(name: str, spec: ParamSpec, g: torch.Generator) -> torch.Tensor:
    shape = spec.shape

    def noise(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    leaf = name.rsplit(".", 1)[-1]
    if spec.kind in ("embedding", "engram_table"):
        return noise(1.0)
    if name.endswith(("markov_head.head.weight", "confidence_head.weight")):  # fp32 matmul weights
        return noise(shape[-1] ** -0.5)
    if spec.kind in ("linear", "linear_bf16", "experts"):
        return noise(shape[-1] ** -0.5)  # fan-in scaling
    if leaf == "weight":  # RMSNorm gains
        return 1.0 + noise(0.05)
    if leaf.endswith("_fn"):
        return noise(0.02)
    if leaf.endswith("_base"):
        return noise(0.1)
    if leaf.endswith("_scale"):
        return 1.0 + noise(0.1)
    if leaf == "attn_sink":
        return noise(0.1)
    if leaf == "bias":
        return noise(0.01)
    if leaf in ("q_weight", "k_weight"):
        return 1.0 + noise(0.1)
    raise ValueError(f"tiny init has no rule for fp32 parameter {name}")


def native_tensors(
    weights: dict[str, torch.Tensor],
    cfg: DeepseekV41Config,
    fp8_linear: bool = False,
    fp4_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of ``weights`` (inventory names, the drafter's ``mtp.*`` too):
    expert stacks split per expert (``w1``/``w3``/``w2``), and optionally quantised as the
    release stores them: dense ``linear`` weights MXFP8 (e4m3, ue8m0 scales per 32x32 tile,
    ``X.scale``) and routed experts MXFP4 (packed e2m1, one ue8m0 scale per 32 inputs)."""
    specs = all_specs(cfg, dspark=any(name.startswith("mtp.") for name in weights))
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        spec = specs[name]
        if spec.kind == "experts":
            stack, inter = name.rsplit(".", 1)[1], cfg.moe_intermediate_size
            for native, (target, part) in EXPERT_STACKS.items():
                if target != stack:
                    continue
                for e in range(t.shape[0]):
                    rows = t[e, inter:] if part == "up" else (t[e, :inter] if part == "gate" else t[e])
                    key = f"{name.rsplit('.', 1)[0]}.{e}.{native}.weight"
                    if fp4_experts:
                        packed, scale = quant_fp4(rows.float(), 32, "ue8m0")
                        out[key], out[key.removesuffix(".weight") + ".scale"] = packed, scale
                    else:
                        out[key] = rows.contiguous()
        elif fp8_linear and spec.kind == "linear":
            data, scale = quant_fp8(t.float(), MXFP8_BLOCK, "ue8m0")
            out[name], out[name.removesuffix(".weight") + ".scale"] = data, scale
        elif fp8_linear and spec.kind == "engram_table":  # e4m3 rows, a scale per 32 channels
            data, scale = quant_fp8(t.float(), (1, min(32, t.shape[1])), "ue8m0")
            out[name], out[name.removesuffix(".weight") + ".scale"] = data, scale
        else:
            out[name] = t
    return out


def dequantized_weights(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The weights of a (possibly quantised) tiny checkpoint as plain tensors by inventory name."""
    cfg = parse_config(json.loads((Path(model_dir) / "config.json").read_text()), str(model_dir))
    weights = load_weights(model_dir, cfg, dtype)
    return {k: v.dequantize(dtype) if isinstance(v, QuantizedTensor) else v for k, v in weights.items()}


def make_tiny(
    outdir: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    config: dict[str, Any] | None = None,
    fp8_linear: bool = False,
    fp4_experts: bool = False,
    dspark: bool = False,
) -> Path:
    """Write a complete tiny DeepSeek-V4.1 checkpoint (config, native-named weights, tokenizer) to
    ``outdir``; same arguments give the same files.  ``config``: another wrapper config (default
    :data:`TINY_CONFIG`).  ``dspark``: with the DSpark drafter's ``mtp.*`` tensors, its text
    config changed by :data:`TINY_DSPARK_CHANGES` (the keys ``config`` leaves at the tiny defaults)."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = copy.deepcopy(config if config is not None else TINY_CONFIG)
    if dspark:
        text = cfg_dict["text_config"]
        for key, value in TINY_DSPARK_CHANGES.items():
            if text.get(key) == TINY_TEXT_CONFIG.get(key):  # not set otherwise by ``config``
                text[key] = copy.deepcopy(value)
    cfg = DeepseekV41Config.from_dict(cfg_dict, source="tiny config")
    if dspark:
        cfg.check_dspark("tiny config")
    write_tokenizer_files(out)
    weights = random_weights(cfg, seed, dtype, dspark=dspark)
    tensors = native_tensors(weights, cfg, fp8_linear, fp4_experts)
    if fp8_linear or fp4_experts:
        cfg_dict["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(MXFP8_BLOCK),
        }
        cfg_dict["text_config"]["expert_dtype"] = "fp4" if fp4_experts else "fp8"
    cfg_dict["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n", encoding="utf-8")
    return out
