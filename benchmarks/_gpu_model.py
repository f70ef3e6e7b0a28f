"""The benchmark model of ``gpu_e2e.py``: a truncated DeepSeek-V4-Flash with random weights, written
as a native FP8 / FP4 checkpoint, and its weight / KV-cache read and FLOP accounting (the model and
the roofline's assumptions: docs/benchmarks.md, ``benchmarks/gpu_e2e.py``)."""

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

from deepinfer_core.distributed.cost_model import expected_distinct
from deepinfer_core.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_core.models.deepseek_v4.params import ParamSpec, parameter_specs, target_dtype
from deepinfer_core.models.deepseek_v4.writer import save_checkpoint
from deepinfer_core.ops.kv_format import fp8_row_bytes

MARKER = "gpu_e2e_model.json"  # written last: a directory holding it is a complete checkpoint
FP8_BLOCK = 128  # non-expert linears: one scale per 128x128 tile (save_checkpoint's default)
FP4_GROUP = 32  # routed experts: one scale per 32 inputs
SCALES = "ue8m0"  # the release's scale storage: V4-Flash's FP8 linears and MXFP4 experts carry
SCALE_BYTES = 1  # UE8M0 (float8_e8m0fnu) scales, one byte each


def flash_config(layers: int = 4, experts: int = 64, smoke: bool = False) -> dict[str, Any]:
    """The ``config.json`` dict (HF names): V4-Flash widths cut to ``layers`` layers ``[sliding,
    CSA, HCA, CSA, HCA, ...]`` and ``experts`` routed experts; ``smoke``: the same at test widths."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    num_hash = min(3, layers)  # V4: the first num_hash_layers=3 layers route by token id
    kinds = [SLIDING] + [CSA if i % 2 == 0 else HCA for i in range(layers - 1)]
    cfg: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    cfg |= dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=layers)
    cfg |= dict(num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024)
    cfg |= dict(partial_rotary_factor=64 / 512, n_routed_experts=experts, n_shared_experts=1)
    cfg |= dict(num_experts_per_tok=6, scoring_func="sqrtsoftplus", norm_topk_prob=True)
    cfg |= dict(routed_scaling_factor=1.5, layer_types=kinds, compress_rates={CSA: 4, HCA: 128})
    cfg |= dict(mlp_layer_types=["hash_moe"] * num_hash + ["moe"] * (layers - num_hash), sliding_window=128)
    cfg |= dict(o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512)
    cfg |= dict(hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, rms_norm_eps=1e-6)
    cfg |= dict(hidden_act="silu", rope_theta=10000.0, compress_rope_theta=160000.0)
    yarn = dict(
        rope_type="yarn", factor=16.0, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1
    )
    cfg |= dict(rope_parameters=yarn, max_position_embeddings=1048576)  # = factor * original, as YaRN expects
    cfg |= dict(num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if smoke:  # the same structure at test widths (>= 8 indexer heads: see the tiny model's note)
        cfg |= dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4)
        cfg |= dict(
            head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=min(2, experts)
        )
        cfg |= dict(compress_rates={CSA: 4, HCA: 16}, sliding_window=8, o_groups=2, o_lora_rank=16)
        cfg |= dict(index_n_heads=8, index_head_dim=16, index_topk=4, max_position_embeddings=4096)
        cfg["rope_parameters"] = {**yarn, "original_max_position_embeddings": 256}
    if cfg["num_experts_per_tok"] > experts:
        raise ValueError(f"experts={experts} is below the {cfg['num_experts_per_tok']} routed per token")
    DeepseekV4Config.from_dict(cfg, source="flash_config")  # validate
    return cfg


# ---- random weights --------------------------------------------------------------------------------
LEAF_STD = dict(base=0.1, hc_base=0.1, sinks=0.1, position_bias=0.1, e_score_correction_bias=0.01)


def init_param(name: str, spec: ParamSpec, cfg: DeepseekV4Config, g: torch.Generator, device: Any):
    """One random parameter, drawn on ``device``: fan-in-scaled linears (activations and logits
    stay O(1)), unit norms, small mHC / sink / bias terms, a random expert table for hash layers."""
    shape, leaf = spec.shape, name.rsplit(".", 1)[-1]
    if spec.kind == "int":  # tid2eid: k distinct experts per token id
        ranks = torch.rand(shape[0], cfg.n_routed_experts, generator=g, device=device)
        return ranks.argsort(dim=-1)[:, : shape[1]]
    if spec.kind in ("embedding", "linear", "linear_bf16", "experts"):
        std = 1.0 if spec.kind == "embedding" else shape[-1] ** -0.5
    elif leaf in ("weight", "scale", "hc_scale"):  # RMSNorm gains, mHC scales
        return torch.ones(shape, device=device)
    else:  # mHC mixing logits ~ N(0, 0.3^2) on RMS-normalised streams; sinks, biases
        std = 0.3 * shape[-1] ** -0.5 if leaf in ("fn", "hc_fn") else LEAF_STD.get(leaf)
    if std is None:
        raise ValueError(f"no init rule for parameter {name} ({spec.kind})")
    return torch.randn(shape, generator=g, device=device).mul_(std)


def write_checkpoint(
    model_dir: Path, cfg_dict: dict[str, Any], seed: int, device: torch.device,
    dtype: torch.dtype = torch.bfloat16, log: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    """The random checkpoint of ``cfg_dict`` and ``seed`` (native names, FP8 linears, FP4 experts,
    UE8M0 scales as in the release) in ``model_dir``: reused when it is there whole and of these
    scales, else written (a folder of other files is
    refused), a shard per layer (and one of the rest) drawn and quantised on ``device``; returns
    what was written (without the config) and whether it was ``reused``."""
    try:
        info = json.loads((model_dir / MARKER).read_text()) | {"reused": True}
    except (OSError, json.JSONDecodeError):
        info = {}
    same = info.get("config") == json.loads(json.dumps(cfg_dict)) and info.get("seed") == seed
    if same and info.get("scales") == SCALES:
        log(f"reusing the checkpoint in {model_dir}")
        return {k: v for k, v in info.items() if k != "config"}
    if model_dir.is_dir() and any(model_dir.iterdir()) and not (model_dir / "config.json").is_file():
        raise SystemExit(f"--model-dir {model_dir} holds other files; give an empty or new folder")
    log(f"writing the checkpoint to {model_dir} (weights drawn on {device})")
    t0 = time.perf_counter()
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / MARKER).unlink(missing_ok=True)
    cfg = DeepseekV4Config.from_dict(cfg_dict, source="benchmark config")
    specs = parameter_specs(cfg)
    groups: list[list[str]] = [[] for _ in range(cfg.num_hidden_layers + 1)]
    for name in specs:
        groups[int(name.split(".")[2]) + 1 if name.startswith("model.layers.") else 0].append(name)
    weight_map: dict[str, str] = {}
    total = 0
    scratch = Path(tempfile.mkdtemp(prefix=".shard-", dir=model_dir))
    try:
        for i, names in enumerate(groups, start=1):
            tensors = {}
            for name in names:
                g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                t = init_param(name, specs[name], cfg, g, device)
                tensors[name] = t.to(target_dtype(specs[name], dtype))
            kw = dict(names="native", fp8_linear=True, fp4_experts=True, scale_dtype=SCALES)
            try:
                save_checkpoint(tensors, cfg_dict, scratch, **kw)
            except (RuntimeError, TypeError, ValueError) as e:  # e.g. no device-tensor serialisation
                if device.type == "cpu":
                    raise
                log(f"  save_checkpoint on {device} failed ({type(e).__name__}: {e}); retrying on the CPU")
                save_checkpoint({k: v.cpu() for k, v in tensors.items()}, cfg_dict, scratch, **kw)
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
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    info = {"config": cfg_dict, "seed": seed, "scales": SCALES, "files": len(groups), "bytes_on_disk": total}
    info["write_s"] = time.perf_counter() - t0
    (model_dir / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    log(f"checkpoint: {total / 2**30:.2f} GiB in {info['write_s']:.1f} s")
    return {k: v for k, v in info.items() if k != "config"} | {"reused": False}


# ---- accounting ------------------------------------------------------------------------------------
def param_counts(cfg: DeepseekV4Config) -> dict[str, int]:
    """Parameter counts: ``total``, ``routed_experts``, ``embedding``, ``dense`` (the rest) and
    ``active_per_token`` (matmul weights one token uses: dense linears, top-k experts, the head)."""
    counts = {"total": 0, "routed_experts": 0, "embedding": 0, "dense": 0}
    linear = 0
    for spec in parameter_specs(cfg).values():
        n = math.prod(spec.shape)
        counts["total"] += n
        kind = {"experts": "routed_experts", "embedding": "embedding"}.get(spec.kind, "dense")
        counts[kind] += n
        linear += n if spec.kind in ("linear", "linear_bf16") else 0
    per_expert = counts["routed_experts"] // (cfg.n_routed_experts * cfg.num_hidden_layers)
    counts["active_per_token"] = linear + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert
    return counts


def weight_bytes_per_step(cfg: DeepseekV4Config, tokens: int, fmt: str) -> float:
    """Bytes of weights one forward step over ``tokens`` tokens reads, each weight once, in
    ``fmt`` ``"bf16"`` (as loaded dequantised) or ``"fp8_fp4"`` (as the checkpoint stores them);
    routed experts count the expected distinct experts of uniform routing per layer
    (:func:`~deepinfer_core.distributed.cost_model.expected_distinct`), the embedding its rows."""
    if fmt not in ("bf16", "fp8_fp4"):
        raise ValueError(f"fmt must be 'bf16' or 'fp8_fp4', got {fmt!r}")
    experts = expected_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, tokens)
    total = 0.0
    for name, spec in parameter_specs(cfg).items():
        n, rows = math.prod(spec.shape), min(tokens, spec.shape[0])
        if spec.kind in ("int", "embedding"):  # tid2eid (int64) or embedding (bf16) rows of the tokens
            total += rows * spec.shape[1] * (8 if spec.kind == "int" else 2)
        elif spec.kind == "fp32":
            total += n * 4
        elif spec.kind == "linear" and fmt == "fp8_fp4" and name != "lm_head.weight":  # + block scales
            blocks = math.ceil(spec.shape[0] / FP8_BLOCK) * math.ceil(spec.shape[1] / FP8_BLOCK)
            total += n + blocks * SCALE_BYTES
        elif spec.kind in ("linear", "linear_bf16"):  # bf16: every one as loaded, the head always
            total += n * 2
        elif spec.kind == "experts":
            total += experts * n / spec.shape[0] * (2.0 if fmt == "bf16" else 0.5 + SCALE_BYTES / FP4_GROUP)
        else:
            raise ValueError(f"unknown parameter kind {spec.kind} of {name}")
    return total


def kv_row_bytes(cfg: DeepseekV4Config, kv_cache_dtype: str, dtype_bytes: int) -> dict[str, int]:
    """Bytes of one cache row by pool (``window`` ring, ``ckv`` compressed entries, ``ikv``
    indexer keys) in the core's formats: ``fp8`` packs the window and entries, not the keys."""
    fp8 = fp8_row_bytes(cfg.head_dim, cfg.rope_dim)
    attended = cfg.head_dim * dtype_bytes if kv_cache_dtype == "auto" else fp8
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
