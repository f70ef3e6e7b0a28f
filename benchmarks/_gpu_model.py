"""The benchmark model of ``gpu_e2e.py``: a truncated DeepSeek-V4-Flash, random weights, and its
weight-read / FLOP accounting.

:func:`flash_config` is the V4-Flash width (hidden 4096, 64 heads x 512, q/o LoRA 1024, 8 output
groups, indexer 64 x 128 top-512, window 128, CSA ratio 4 / HCA ratio 128, hash routing on the
first 3 layers, mHC with 4 streams, vocab 129280) cut to ``layers`` layers ``[sliding, CSA, HCA,
CSA, HCA, ...]`` and ``experts`` routed experts (top-6, width 2048, one shared expert).  With
``smoke=True`` the same structure at test widths runs on a CPU in seconds.

:func:`write_checkpoint` draws every parameter of
:func:`~deepinfer_core.models.deepseek_v4.params.parameter_specs` on ``device`` (seeded per name)
and writes it through :func:`deepinfer_core.models.deepseek_v4.writer.save_checkpoint` (native names,
FP8 dense linears, FP4 routed experts) one layer at a time, as shards of one indexed checkpoint: the
quantisation runs where the tensors are, and host memory holds one layer at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from deepinfer_core.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.params import ParamSpec, parameter_specs, target_dtype
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint
from deepinfer_core.ops.kv_format import fp8_row_bytes

MARKER = "gpu_e2e_model.json"  # written last: a directory holding it is a complete checkpoint
INDEX_FILE = "model.safetensors.index.json"
FP8_BLOCK = 128  # non-expert linears: one fp32 scale per 128x128 tile (save_checkpoint's default)
FP4_GROUP = 32  # routed experts: one fp32 scale per 32 inputs


def layer_types(n: int) -> list[str]:
    """``[sliding, CSA, HCA, CSA, HCA, ...]`` of length ``n``."""
    return [SLIDING] + [CSA if i % 2 == 0 else HCA for i in range(n - 1)]


def flash_config(layers: int = 4, experts: int = 64, smoke: bool = False) -> dict[str, Any]:
    """The ``config.json`` dict (HF field names) of the benchmark model."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    num_hash = min(3, layers)  # V4: the first num_hash_layers=3 layers route by token id
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "hidden_size": 4096,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "q_lora_rank": 1024,
        "partial_rotary_factor": 64 / 512,  # qk_rope_head_dim 64
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "layer_types": layer_types(layers),
        "compress_rates": {CSA: 4, HCA: 128},
        "mlp_layer_types": ["hash_moe"] * num_hash + ["moe"] * (layers - num_hash),
        "sliding_window": 128,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,  # = factor * original, as YaRN expects
        "num_nextn_predict_layers": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }
    if smoke:  # the same structure at test widths (>= 8 indexer heads: see the tiny model's note)
        cfg.update(
            vocab_size=512,
            hidden_size=64,
            moe_intermediate_size=32,
            num_attention_heads=4,
            head_dim=32,
            q_lora_rank=32,
            partial_rotary_factor=0.25,
            num_experts_per_tok=min(2, experts),
            compress_rates={CSA: 4, HCA: 16},
            sliding_window=8,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=4,
            rope_parameters={**cfg["rope_parameters"], "original_max_position_embeddings": 256},
            max_position_embeddings=4096,
        )
    if cfg["num_experts_per_tok"] > experts:
        raise ValueError(f"experts={experts} is below the {cfg['num_experts_per_tok']} routed per token")
    DeepseekV4Config.from_dict(cfg, source="flash_config")  # validate
    return cfg


# ---- random weights --------------------------------------------------------------------------------
def init_param(
    name: str, spec: ParamSpec, cfg: DeepseekV4Config, g: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One random parameter, drawn on ``device``: fan-in-scaled linears (activations and logits
    stay O(1)), unit norms, small mHC / sink / bias terms, a random expert table for hash layers."""
    shape, leaf = spec.shape, name.rsplit(".", 1)[-1]

    def noise(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device).mul_(std)

    if spec.kind == "int":  # tid2eid: k distinct experts per token id
        ranks = torch.rand(shape[0], cfg.n_routed_experts, generator=g, device=device)
        return ranks.argsort(dim=-1)[:, : shape[1]]
    if spec.kind == "embedding":
        return noise(1.0)
    if spec.kind in ("linear", "linear_bf16", "experts"):
        return noise(shape[-1] ** -0.5)
    if leaf == "weight":  # RMSNorm gains
        return torch.ones(shape, device=device)
    if leaf in ("fn", "hc_fn"):  # mHC mixing logits ~ N(0, 0.3^2) on RMS-normalised streams
        return noise(0.3 * shape[-1] ** -0.5)
    if leaf in ("base", "hc_base", "sinks", "position_bias"):
        return noise(0.1)
    if leaf in ("scale", "hc_scale"):
        return torch.ones(shape, device=device)
    if leaf == "e_score_correction_bias":
        return noise(0.01)
    raise ValueError(f"no init rule for parameter {name} ({spec.kind})")


def _groups(specs: dict[str, ParamSpec], num_layers: int) -> list[list[str]]:
    """Parameter names by shard: the non-layer tensors, then one shard per layer."""
    per_layer: list[list[str]] = [[] for _ in range(num_layers)]
    top: list[str] = []
    for name in specs:
        if name.startswith("model.layers."):
            per_layer[int(name.split(".")[2])].append(name)
        else:
            top.append(name)
    return [top, *per_layer]


def model_ready(model_dir: Path, cfg_dict: dict[str, Any], seed: int) -> bool:
    """Whether ``model_dir`` holds a complete checkpoint written for ``cfg_dict`` and ``seed``."""
    try:
        info = json.loads((model_dir / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return info.get("config") == json.loads(json.dumps(cfg_dict)) and info.get("seed") == seed


def write_checkpoint(
    model_dir: Path,
    cfg_dict: dict[str, Any],
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Write the random checkpoint (native names, FP8 linears, FP4 experts) to ``model_dir``.

    Each shard's tensors are drawn in ``dtype`` on ``device`` and quantised there by
    ``save_checkpoint`` (into a scratch folder, then renamed into ``model_dir`` as
    ``model-0000i-of-0000n.safetensors``); a ``model.safetensors.index.json`` maps every stored
    tensor to its shard.  Returns what was written (files, bytes, seconds).
    """
    t0 = time.perf_counter()
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / MARKER).unlink(missing_ok=True)
    cfg = DeepseekV4Config.from_dict(cfg_dict, source="benchmark config")
    specs = parameter_specs(cfg)
    groups = _groups(specs, cfg.num_hidden_layers)
    weight_map: dict[str, str] = {}
    total = 0
    scratch = Path(tempfile.mkdtemp(prefix=".shard-", dir=model_dir))
    try:
        for i, names in enumerate(groups, start=1):
            tensors = {}
            for name in names:
                spec = specs[name]
                g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                t = init_param(name, spec, cfg, g, device)
                tensors[name] = t.to(target_dtype(spec, dtype)).contiguous()
            try:
                save_checkpoint(tensors, cfg_dict, scratch, names="native", fp8_linear=True, fp4_experts=True)
            except (RuntimeError, TypeError, ValueError) as e:
                if device.type == "cpu":
                    raise
                # e.g. a safetensors that cannot serialise device tensors: quantise on the host
                log(f"  save_checkpoint on {device} failed ({type(e).__name__}: {e}); retrying on the CPU")
                tensors = {k: v.cpu() for k, v in tensors.items()}
                save_checkpoint(tensors, cfg_dict, scratch, names="native", fp8_linear=True, fp4_experts=True)
            del tensors
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            os.replace(scratch / "model.safetensors", model_dir / fname)
            with safe_open(str(model_dir / fname), framework="pt") as f:
                weight_map.update(dict.fromkeys(f.keys(), fname))
            total += (model_dir / fname).stat().st_size
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log(f"  shard {i}/{len(groups)} written ({total / 2**30:.2f} GiB so far)")
        shutil.copyfile(scratch / "config.json", model_dir / "config.json")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    info = {
        "config": cfg_dict,
        "seed": seed,
        "files": len(groups),
        "bytes_on_disk": total,
        "write_s": time.perf_counter() - t0,
    }
    (model_dir / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return info


# ---- accounting ------------------------------------------------------------------------------------
def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct routed experts that ``tokens`` tokens touch in one layer, each
    choosing ``top_k`` of ``num_experts`` uniformly at random: ``E * (1 - (1 - k/E)**T)``
    (``k`` at one token, ``-> E`` for large batches; at most ``min(E, T*k)``)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def param_counts(cfg: DeepseekV4Config) -> dict[str, int]:
    """Parameter counts: ``total``, ``routed_experts``, ``embedding``, ``dense`` (the rest) and
    ``active_per_token`` (matmul weights one token uses: dense linears, ``top_k`` experts per
    layer and the output head; the embedding is a lookup)."""
    counts = {"total": 0, "routed_experts": 0, "embedding": 0, "dense": 0}
    linear = 0
    for spec in parameter_specs(cfg).values():
        n = math.prod(spec.shape)
        counts["total"] += n
        if spec.kind == "experts":
            counts["routed_experts"] += n
        elif spec.kind == "embedding":
            counts["embedding"] += n
        else:
            counts["dense"] += n
            linear += n if spec.kind in ("linear", "linear_bf16") else 0
    per_expert = counts["routed_experts"] // (cfg.n_routed_experts * cfg.num_hidden_layers)
    counts["active_per_token"] = linear + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert
    return counts


def weight_bytes_per_step(cfg: DeepseekV4Config, tokens: int, fmt: str) -> float:
    """Bytes of weights one forward step over ``tokens`` tokens reads, each weight read once.

    ``fmt="bf16"``: as DeepInfer loads them today (matmul weights and the embedding in bf16,
    norms / mHC / sinks / biases in fp32).  ``fmt="fp8_fp4"``: as the checkpoint stores them
    (non-expert linears FP8 + one fp32 scale per 128x128 tile, routed experts packed FP4 + one
    fp32 scale per 32, compressor / indexer / router projections and the output head bf16).
    Routed experts count :func:`expected_distinct_experts` experts per layer; the embedding
    counts the ``tokens`` rows looked up; KV-cache reads are not counted.
    """
    if fmt not in ("bf16", "fp8_fp4"):
        raise ValueError(f"fmt must be 'bf16' or 'fp8_fp4', got {fmt!r}")
    experts = expected_distinct_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, tokens)
    total = 0.0
    for name, spec in parameter_specs(cfg).items():
        n = math.prod(spec.shape)
        if spec.kind == "int":  # tid2eid rows of the step's tokens
            total += min(tokens, spec.shape[0]) * spec.shape[1] * 8
        elif spec.kind == "fp32":
            total += n * 4
        elif spec.kind == "embedding":
            total += min(tokens, spec.shape[0]) * spec.shape[1] * 2
        elif spec.kind == "linear_bf16" or (spec.kind == "linear" and name == "lm_head.weight"):
            total += n * 2
        elif spec.kind == "linear":
            if fmt == "bf16":
                total += n * 2
            else:
                out, inp = spec.shape
                total += n + math.ceil(out / FP8_BLOCK) * math.ceil(inp / FP8_BLOCK) * 4
        elif spec.kind == "experts":
            per_expert = n / spec.shape[0]
            bpe = 2.0 if fmt == "bf16" else 0.5 + 4 / FP4_GROUP
            total += experts * per_expert * bpe
        else:
            raise ValueError(f"unknown parameter kind {spec.kind} of {name}")
    return total


def step_token_counts(total_tokens: int, chunk: int) -> list[int]:
    """Tokens per step when ``total_tokens`` prompt tokens are prefilled ``chunk`` at a time."""
    full, rest = divmod(total_tokens, chunk)
    return [chunk] * full + ([rest] if rest else [])


def kv_row_bytes(cfg: DeepseekV4Config, kv_cache_dtype: str, dtype_bytes: int) -> dict[str, int]:
    """Bytes of one cache row by pool (``window`` ring, ``ckv`` compressed entries, ``ikv``
    indexer keys) in the core's formats: ``fp8`` packs the window and entries, not the keys."""
    plain = cfg.head_dim * dtype_bytes
    attended = plain if kv_cache_dtype == "auto" else fp8_row_bytes(cfg.head_dim, cfg.rope_dim)
    return {"window": attended, "ckv": attended, "ikv": cfg.index_head_dim * dtype_bytes}


def kv_bytes(cfg: DeepseekV4Config, context: int, rows: dict[str, int], read: bool = True) -> float:
    """KV-cache bytes of one sequence at ``context`` tokens: what a decode step reads
    (``read=True``: per layer the window's rows, plus top-k of the CSA entries and the indexer
    keys of all of them, or all HCA entries) or what the cache stores (``read=False``)."""
    total = 0.0
    for kind in cfg.layer_types:
        total += (min(context, cfg.sliding_window) if read else cfg.sliding_window) * rows["window"]
        if kind != SLIDING:
            n = context // cfg.compress_rates[kind]
            total += (min(n, cfg.index_topk) if read and kind == CSA else n) * rows["ckv"]
            total += n * rows["ikv"] if kind == CSA else 0
    return total
