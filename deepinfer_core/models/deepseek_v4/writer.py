"""Write a checkpoint directory from HF-named tensors (the inverse of :func:`load_checkpoint`).

Used by tests and ``deepinfer make-tiny``: HF or native DeepSeek names, optionally FP8
(non-expert linears, 128x128 block scales) and FP4 (routed experts, per-32 scales), optionally
sharded with a ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

from deepinfer_core.weights.quant import DEFAULT_FP4_GROUP, DEFAULT_FP8_BLOCK, quant_fp4, quant_fp8
from deepinfer_core.weights.safetensors_io import INDEX_FILE, SINGLE_FILE
from deepinfer_core.weights.writer import save_safetensors

from .config import DeepseekV4Config
from .names import expert_native_names, hf_to_native, is_expert_stack
from .params import mtp_parameter_specs, parameter_specs

# Kept unquantised even with fp8_linear, as DeepSeek's own checkpoints keep the output head.
_NEVER_QUANTISED = frozenset({"lm_head.weight"})


def _scale_name(name: str, names: str) -> str:
    if names == "native":
        return name[: -len(".weight")] + ".scale"
    return name[: -len(".weight")] + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def _quantised(
    name: str,
    t: torch.Tensor,
    fmt: str | None,
    names: str,
    scale_dtype: str,
    fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK,
) -> dict[str, torch.Tensor]:
    """``{name: data, scale name: scale}`` for ``fmt`` in ``fp8``/``fp4``, else ``{name: t}``."""
    if fmt is None:
        return {name: t}
    data, scale = (
        quant_fp8(t, fp8_block, scale_dtype) if fmt == "fp8" else quant_fp4(t, DEFAULT_FP4_GROUP, scale_dtype)
    )
    return {name: data, _scale_name(name, names): scale}


def _convert(
    tensors: dict[str, torch.Tensor],
    kinds: dict[str, str],
    names: str,
    fp8: bool,
    fp4: bool,
    scale_dtype: str,
    fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK,
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for hf, t in tensors.items():
        kind = kinds.get(hf)
        never = hf in _NEVER_QUANTISED or hf.endswith(".lm_head.weight")  # the MTP layers' heads too
        fmt = "fp8" if fp8 and kind == "linear" and not never else None
        if kind == "experts" and fp4:
            fmt = "fp4"
        if names == "native" and is_expert_stack(hf):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                parts = expert_native_names(hf, e)
                pieces = {"gate": t[e, :half], "up": t[e, half:]} if "gate" in parts else {"down": t[e]}
                for part, native in parts.items():
                    out.update(_quantised(native, pieces[part].clone(), fmt, names, scale_dtype, fp8_block))
            continue
        if names == "native":
            try:
                target = hf_to_native(hf)
            except KeyError:
                target = hf  # not a model parameter: written as given
        else:
            target = hf
        out.update(_quantised(target, t, fmt, names, scale_dtype, fp8_block))
    return out


def _untie(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy tensors sharing storage with an earlier one (safetensors refuses shared storage)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _quantization_config(
    fp8: bool, fp4: bool, scale_dtype: str, fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK
) -> dict[str, Any]:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0" if scale_dtype == "ue8m0" else "float",
        "weight_block_size": list(fp8_block),
        "linear_dtype": "fp8" if fp8 else "unquantized",
        "expert_dtype": "fp4" if fp4 else "unquantized",
        "expert_group_size": DEFAULT_FP4_GROUP,
    }


def save_checkpoint(
    tensors: dict[str, torch.Tensor],
    cfg_dict: dict[str, Any],
    out_dir: str | Path,
    *,
    names: Literal["hf", "native"] = "hf",
    fp8_linear: bool = False,
    fp4_experts: bool = False,
    scale_dtype: Literal["fp32", "ue8m0"] = "fp32",
    fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write ``tensors`` (HF names) and ``config.json`` to ``out_dir``; return the safetensors files.

    ``names="native"`` writes DeepSeek names with per-expert ``w1/w2/w3`` tensors.
    Multi-token-prediction tensors (``model.mtp.{i}.*``, see ``params.mtp_parameter_specs``) are
    written like the others (native: ``mtp.{i}.*``).
    ``fp8_linear`` stores ``linear``-kind weights (except the output heads) as FP8 e4m3 with 128x128
    block scales; ``fp4_experts`` stores routed experts as packed e2m1 with one scale per 32
    inputs; scales are float32 or ue8m0 (``scale_dtype``).  ``fp8_block`` changes the FP8 block
    (recorded as ``quantization_config.weight_block_size``; tests use small blocks to exercise
    the tiny model's tile edges and fusions).  Unquantised tensors keep their
    dtype.  With ``max_shard_bytes`` the tensors are split into
    ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``; tensors
    unknown to the config are written unchanged under their given name.
    """
    if names not in ("hf", "native"):
        raise ValueError(f"names must be 'hf' or 'native', got {names!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = DeepseekV4Config.from_dict(cfg_dict, source="save_checkpoint(cfg_dict)")
    kinds = {n: s.kind for n, s in {**parameter_specs(cfg), **mtp_parameter_specs(cfg)}.items()}
    block = (int(fp8_block[0]), int(fp8_block[1]))
    stored = _untie(_convert(tensors, kinds, names, fp8_linear, fp4_experts, scale_dtype, block))
    config = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
    if fp8_linear or fp4_experts:
        config["quantization_config"] = _quantization_config(fp8_linear, fp4_experts, scale_dtype, block)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if max_shard_bytes is None:
        _save_shard(stored, out / SINGLE_FILE)
        return [out / SINGLE_FILE]
    groups = _shards(stored, max_shard_bytes)
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        _save_shard(group, out / fname)
        files.append(out / fname)
        weight_map.update(dict.fromkeys(group, fname))
    total = sum(t.numel() * t.element_size() for t in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_safetensors(tensors, path)
