"""Load a DeepSeek-V4.1 checkpoint (native names) into the tensors of :func:`~.params.parameter_specs`.

The released checkpoint uses DeepSeek's native names (:mod:`.params`) with block scales as
sibling tensors ``X.scale``: dense linears MXFP8 (e4m3 with one ue8m0 scale per
``quantization_config.weight_block_size`` tile, 32x32), routed experts MXFP4 (packed e2m1 with
one scale per 32 inputs), Engram tables e4m3 rows with a scale per 32 channels (always kept
quantised and, on a CPU device, memory-mapped from the file rather than copied: a step
dequantises only the rows it looks up).  Other quantised tensors are
dequantised to the model dtype, or, with ``keep_quantized``, kept as
:class:`~deepinfer_core.weights.quant.QuantizedTensor` exactly as the V4 loader keeps them (the
same per-tensor reader is used); per-expert tensors are stacked into ``[E, 2I, D]`` /
``[E, D, I]``.  An optional ``model.`` prefix is accepted.  Tensors of the parts the text model
does not serve (DSpark ``mtp.*``, vision, image embeddings, the image router bias ``bias_vl``)
are skipped (:func:`~.params.is_ignored`).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

from deepinfer_core.errors import WeightLoadError
from deepinfer_core.weights.loader import _check_shape, _empty_stack, _keep_formats, _put_expert, _read
from deepinfer_core.weights.names import ExpertSlice, scale_owner
from deepinfer_core.weights.quant import DEFAULT_FP8_BLOCK, FP8_DTYPE, UE8M0_DTYPE, QuantizedTensor, Weight
from deepinfer_core.weights.safetensors_io import TensorSource, discover_shards

from .config import DeepseekV41Config
from .params import EXPERT_STACKS, ParamSpec, is_ignored, parameter_specs, target_dtype

_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_MAX_LISTED = 5


def _target(name: str, specs: dict[str, ParamSpec]) -> str | ExpertSlice | None:
    bare = name.removeprefix("model.")
    if bare in specs:
        return bare
    m = _EXPERT_RE.match(bare)
    if m is None:
        return None
    stack, part = EXPERT_STACKS[m.group(3)]
    target = f"layers.{m.group(1)}.ffn.experts.{stack}"
    spec = specs.get(target)
    if spec is None or int(m.group(2)) >= spec.shape[0]:
        return None
    return ExpertSlice(target, int(m.group(2)), part)


def _listing(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


_ST_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}


def mmap_tensor(path: Path, name: str) -> torch.Tensor | None:
    """Tensor ``name`` of safetensors file ``path`` as a read-only view of the file mapped into
    memory (no copy: pages are read when rows are touched), or ``None`` for a dtype not mapped."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(size))[name]
    dtype = _ST_DTYPES.get(meta["dtype"])
    if dtype is None:
        return None
    begin, end = meta["data_offsets"]
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size + begin, shape=(end - begin,))
    with warnings.catch_warnings():  # read-only by design: the model never writes its weights
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(data)
    return flat.view(dtype).view(meta["shape"])


def _engram_table(
    src: TensorSource,
    name: str,
    scale_name: str | None,
    spec: ParamSpec,
    path: Path,
    dtype: torch.dtype,
    device: str | torch.device,
) -> Weight:
    """An Engram table, memory-mapped from its file on a CPU device (the release's are ~98 GB):
    e4m3 rows with one scale per ``g`` channels are kept quantised (only the rows a step looks up
    are dequantised, ``deepseek_v41.engram_rows``); a float table is mapped when stored in the
    model dtype.  On other devices the table is copied there."""
    on_cpu = torch.device(device).type == "cpu"
    mapped = mmap_tensor(path, name) if on_cpu else None
    if scale_name is None:
        t = (
            mapped
            if mapped is not None and mapped.dtype == dtype
            else src.get(name).to(device=device, dtype=dtype)
        )
        _check_shape(t.shape, spec.shape, f"tensor {name!r}", path)
        return t
    data = mapped if mapped is not None else src.get(name)
    scale = src.get(scale_name)
    _check_shape(data.shape, spec.shape, f"tensor {name!r}", path)
    if data.dtype != FP8_DTYPE or scale.dim() != 2 or spec.shape[1] % max(scale.shape[1], 1):
        raise WeightLoadError(
            f"Engram table {name!r} in {path}: expected float8_e4m3fn rows with [rows, channels/g] "
            f"scales, got {data.dtype} {tuple(data.shape)} with scale {tuple(scale.shape)}"
        )
    if scale.is_floating_point() and scale.dtype not in (torch.float32, UE8M0_DTYPE):
        scale = scale.float()
    table = QuantizedTensor(data, scale, "fp8", (1, spec.shape[1] // scale.shape[1]))
    return table if on_cpu else table.to(device)


def load_weights(
    model_dir: str | Path,
    cfg: DeepseekV41Config,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    keep_quantized: bool | Collection[str] = False,
) -> dict[str, Weight]:
    """``{inventory name: weight}`` for every entry of ``parameter_specs(cfg)``.

    Raises :class:`WeightLoadError` naming the tensor (and file) for missing, unexpected,
    duplicated, mis-shaped or mistyped tensors.
    """
    keep = _keep_formats(keep_quantized)
    shard_of = discover_shards(model_dir)
    specs = parameter_specs(cfg)
    all_names = frozenset(shard_of)
    direct: dict[str, str] = {}
    experts: dict[str, ExpertSlice] = {}
    scales: dict[str, str] = {}
    unexpected: list[str] = []
    seen: dict[object, str] = {}
    for name in shard_of:
        owner = scale_owner(name, all_names)
        if owner is not None:
            scales[owner] = name
            continue
        if is_ignored(name):
            continue
        target = _target(name, specs)
        if target is None:
            unexpected.append(name)
            continue
        key = target if isinstance(target, str) else (target.hf_name, target.expert, target.part)
        if key in seen:
            raise WeightLoadError(
                f"tensors {seen[key]!r} and {name!r} both provide {key!r}; remove one of them."
            )
        seen[key] = name
        if isinstance(target, ExpertSlice):
            experts[name] = target
        else:
            direct[name] = target
    if unexpected:
        raise WeightLoadError(
            f"unexpected tensors in {model_dir}: {_listing(sorted(unexpected))}. They are not parameters of "
            "this DeepSeek-V4.1 config (wrong config.json, or a different model)."
        )
    missing = []
    for name, spec in specs.items():
        if name in seen or (name == "head.weight" and cfg.tie_word_embeddings):
            continue
        if spec.kind == "experts":
            parts = ("gate", "up") if name.endswith("gate_up") else ("down",)
            absent = [f"{e}.{p}" for e in range(spec.shape[0]) for p in parts if (name, e, p) not in seen]
            if absent:
                missing.append(f"{name} (experts {', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''})")
        else:
            missing.append(name)
    if missing:
        raise WeightLoadError(
            f"checkpoint {model_dir} lacks {len(missing)} tensor(s) of this model: {_listing(missing)}. "
            "Check that config.json matches the weights and that the download is complete."
        )
    quant = cfg.quant
    block = tuple(quant.weight_block_size) if quant is not None else DEFAULT_FP8_BLOCK
    result: dict[str, Weight] = {}
    with TensorSource(shard_of) as src:
        for path, names in src.names_by_shard():
            for name in names:
                if name in direct:
                    target = direct[name]
                    spec = specs[target]
                    if spec.kind == "engram_table":
                        result[target] = _engram_table(src, name, scales.get(name), spec, path, dtype, device)
                        continue
                    t = _read(src, name, scales.get(name), spec, block, keep, device=device)
                    _check_shape(t.shape, spec.shape, f"tensor {name!r}", path)
                    if isinstance(t, QuantizedTensor):
                        result[target] = t.to(device)
                    else:
                        result[target] = t.to(device=device, dtype=target_dtype(spec, dtype))
                elif name in experts:
                    sl = experts[name]
                    spec = specs[sl.hf_name]
                    t = _read(src, name, scales.get(name), spec, block, keep, device=device)
                    _, rows, cols = spec.shape
                    want = (rows // 2, cols) if sl.part in ("gate", "up") else (rows, cols)
                    _check_shape(t.shape, want, f"expert tensor {name!r}", path)
                    if sl.hf_name not in result:
                        result[sl.hf_name] = _empty_stack(t, spec, dtype, device)
                    _put_expert(result[sl.hf_name], sl, t, name, path)
    if "head.weight" not in result and cfg.tie_word_embeddings:
        result["head.weight"] = result["embed.weight"]
    return {name: result[name] for name in specs}
