"""Load a DeepSeek-V4.1 checkpoint (native names) into the tensors of :func:`~.params.parameter_specs`.

The released checkpoint uses DeepSeek's native names (:mod:`.params`) with block scales as
sibling tensors ``X.scale``: dense linears MXFP8 (e4m3 with one ue8m0 scale per
``quantization_config.weight_block_size`` tile, 32x32), routed experts MXFP4 (packed e2m1 with
one scale per 32 inputs), Engram tables e4m3 rows with a scale per 32 channels (always kept
quantised and, on a CPU device, memory-mapped from the file rather than copied: a step
dequantises only the rows it looks up; a float table's scale, which transformers writes and
applies to e4m3 rows only, is not applied either).  Other quantised tensors are
dequantised to the model dtype, or, with ``keep_quantized``, kept as
:class:`~deepinfer_core.weights.quant.QuantizedTensor` exactly as the V4 loader keeps them (the
same per-tensor reader is used); per-expert tensors are stacked into ``[E, 2I, D]`` /
``[E, D, I]``.  An optional ``model.`` prefix is accepted, and transformers' ``lm_head.weight``
for ``head.weight`` (:data:`~.params.HF_ALIASES`): a checkpoint written by
``save_pretrained`` loads as it is.  Tensors of the parts the text model
does not serve (DSpark ``mtp.*``, vision, image embeddings, the image router bias ``bias_vl``)
are skipped (:func:`~.params.is_ignored`); the DSpark drafter's ``mtp.*`` load apart
(:func:`load_dspark_weights`, for ``speculative.drafter="dspark"``).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from deepinfer_core.errors import ConfigError, WeightLoadError
from deepinfer_core.models.deepseek_v4.checkpoint_plan import check_shape, check_stored_shapes
from deepinfer_core.models.deepseek_v4.loader import empty_stack, keep_formats, put_expert, read_param
from deepinfer_core.models.deepseek_v4.names import ExpertSlice, scale_owner
from deepinfer_core.weights.host_mapped import device_view_of_host
from deepinfer_core.weights.quant import DEFAULT_FP8_BLOCK, FP8_DTYPE, UE8M0_DTYPE, QuantizedTensor, Weight
from deepinfer_core.weights.safetensors_io import TensorSource, discover_shards, shard_header

from .config import DeepseekV41Config
from .params import (
    DSPARK_ALIASES,
    DSPARK_COMBINER,
    DSPARK_HEADS,
    EXPERT_STACKS,
    HF_ALIASES,
    ParamSpec,
    dspark_optional,
    dspark_parameter_specs,
    is_ignored,
    is_image_router_bias,
    parameter_specs,
    target_dtype,
)

_EXPERT_RE = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_MAX_LISTED = 5
logger = logging.getLogger("deepinfer.model")


def _target(name: str, specs: dict[str, ParamSpec]) -> str | ExpertSlice | None:
    bare = name.removeprefix("model.")
    bare = HF_ALIASES.get(bare, bare)
    if bare in specs:
        return bare
    m = _EXPERT_RE.match(bare)
    if m is None:
        return None
    stack, part = EXPERT_STACKS[m.group(4)]
    target = f"{m.group(1)}.{m.group(2)}.ffn.experts.{stack}"
    spec = specs.get(target)
    if spec is None or int(m.group(3)) >= spec.shape[0]:
        return None
    return ExpertSlice(target, int(m.group(3)), part)


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
    meta = shard_header(path)[name]
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
    """An Engram table, memory-mapped from its file (the release's are ~98 GB): e4m3 rows with
    one scale per ``g`` channels are kept quantised (only the rows a step looks up are
    dequantised, ``deepseek_v41.engram_rows``); a float table is mapped when stored in the model
    dtype, and its scale, if any, is not applied (transformers writes a float32 ``embed.scale``
    with every table and applies it to e4m3 rows only; logged).  On a CUDA device the mapped
    rows stay in host memory and the device reads them in place
    (:func:`~deepinfer_core.weights.host_mapped.device_view_of_host`; the scales, 1/g of the
    bytes, are copied); where that is not possible the table is copied to the device (logged
    with the reason)."""
    on_cpu = torch.device(device).type == "cpu"
    mapped = mmap_tensor(path, name)
    data = mapped if mapped is not None else src.get(name)
    check_shape(data.shape, spec.shape, f"tensor {name!r}", path)
    if scale_name is not None and data.is_floating_point() and data.dtype != FP8_DTYPE:
        logger.info(
            "Engram table %s is stored as %s: its scale %s is not applied (a scale applies to "
            "float8_e4m3fn rows only, as in transformers)",
            name,
            data.dtype,
            scale_name,
        )
        scale_name = None
    if scale_name is None:
        if mapped is not None and mapped.dtype == dtype:
            return mapped if on_cpu else _in_place_or_copied(mapped, name, device)
        return data.to(device=device, dtype=dtype)
    scale = src.get(scale_name)
    if data.dtype != FP8_DTYPE or scale.dim() != 2 or spec.shape[1] % max(scale.shape[1], 1):
        raise WeightLoadError(
            f"Engram table {name!r} in {path}: expected float8_e4m3fn rows with [rows, channels/g] "
            f"scales, got {data.dtype} {tuple(data.shape)} with scale {tuple(scale.shape)}"
        )
    if scale.is_floating_point() and scale.dtype not in (torch.float32, UE8M0_DTYPE):
        scale = scale.float()
    block = (1, spec.shape[1] // scale.shape[1])
    if on_cpu:
        return QuantizedTensor(data, scale, "fp8", block)
    return QuantizedTensor(_in_place_or_copied(data, name, device), scale.to(device), "fp8", block)


def _in_place_or_copied(host: torch.Tensor, name: str, device: str | torch.device) -> torch.Tensor:
    """``host`` (a memory-mapped table) read in place by ``device`` when it can map host
    memory, else copied there; either way said in the log, with the size."""
    view, why = device_view_of_host(host, device, read_only=not host.is_shared())
    size = host.numel() * host.element_size() / 2**20
    if view is not None:
        logger.info(
            "Engram table %s (%.1f MiB) stays in host memory, read in place by %s", name, size, device
        )
        return view
    logger.info("Engram table %s (%.1f MiB) copied to %s: %s", name, size, device, why)
    return host.to(device)


_SKIP = ""
"""What a name resolver returns for a tensor the loader skips (another part's)."""


def load_weights(
    model_dir: str | Path,
    cfg: DeepseekV41Config,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    keep_quantized: bool | Collection[str] = False,
) -> dict[str, Weight]:
    """``{inventory name: weight}`` for every entry of ``parameter_specs(cfg)``.

    Raises :class:`WeightLoadError` naming the tensor (and file) for missing, unexpected,
    duplicated, mis-shaped or mistyped tensors; all but the dtypes are checked before any tensor
    data is read (:func:`check_weights`).
    """
    specs = parameter_specs(cfg)
    plan = _checked(model_dir, cfg, specs)
    result = _read_plan(plan, specs, cfg, dtype, device, keep_formats(keep_quantized))
    if "head.weight" not in result and cfg.tie_word_embeddings:
        result["head.weight"] = result["embed.weight"]
    return {name: result[name] for name in specs}


def check_weights(model_dir: str | Path, cfg: DeepseekV41Config) -> None:
    """What :func:`load_weights` checks before it reads tensor data: every tensor of the
    checkpoint is a parameter of ``cfg`` or one the text model skips, none is missing or given
    twice, and each one's shape in its shard's header is its parameter's."""
    _checked(model_dir, cfg, parameter_specs(cfg))


def _checked(model_dir: str | Path, cfg: DeepseekV41Config, specs: dict[str, ParamSpec]) -> _Plan:
    def resolve(name: str) -> str | ExpertSlice | None:
        return _SKIP if is_ignored(name) else _target(name, specs)

    plan = _plan(model_dir, specs, resolve)
    unexpected = plan.unexpected
    if unexpected:
        raise WeightLoadError(
            f"unexpected tensors in {model_dir}: {_listing(sorted(unexpected))}. They are not parameters of "
            "this DeepSeek-V4.1 config (wrong config.json, or a different model)."
        )
    missing = _missing(specs, plan.seen, skip={"head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise WeightLoadError(
            f"checkpoint {model_dir} lacks {len(missing)} tensor(s) of this model: {_listing(missing)}. "
            "Check that config.json matches the weights and that the download is complete."
        )
    check_stored_shapes(plan.direct, plan.experts, plan.scales, specs, plan.shard_of)
    return plan


def load_dspark_weights(
    model_dir: str | Path,
    cfg: DeepseekV41Config,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    keep_quantized: bool | Collection[str] = False,
) -> dict[str, Weight]:
    """The DSpark drafter's tensors (``mtp.*``, :func:`~.params.dspark_parameter_specs`) by
    inventory name, read as :func:`load_weights` reads the text model's (quantised formats kept
    alike, experts stacked).  ``confidence_head.proj.weight`` is read as
    ``confidence_head.weight``; the combiner (``main_proj``, ``main_norm``) and the head stack
    (``norm``, ``markov_head.*``, ``confidence_head``) are accepted under any stage prefix but
    exactly once (held under stage 0 and the last stage).  The stages' image-token router biases
    (``mtp.{j}.ffn.gate.bias_vl``) are skipped as the main layers' are.  A checkpoint without the
    confidence head loads without it (logged).  A one-line :class:`ConfigError` says when there
    is no ``mtp.*`` tensor at all, or names the bad ``dspark_*`` field or the first missing
    ``mtp.*`` tensor; other problems are :class:`WeightLoadError` as in :func:`load_weights`.
    """
    specs = dspark_parameter_specs(cfg)
    plan = _checked_dspark(model_dir, cfg, specs)
    optional = dspark_optional(cfg)
    for name in sorted(optional - set(plan.seen)):
        logger.info("%s: no %s: the DSpark drafter runs without its confidence head", model_dir, name)
    result = _read_plan(plan, specs, cfg, dtype, device, keep_formats(keep_quantized))
    return {name: result[name] for name in specs if name in result}


def check_dspark_weights(model_dir: str | Path, cfg: DeepseekV41Config) -> None:
    """What :func:`load_dspark_weights` checks before it reads tensor data (the ``dspark_*``
    fields, names, missing tensors, header shapes), raising as it does."""
    _checked_dspark(model_dir, cfg, dspark_parameter_specs(cfg))


def _checked_dspark(model_dir: str | Path, cfg: DeepseekV41Config, specs: dict[str, ParamSpec]) -> _Plan:
    m = cfg.num_nextn_predict_layers
    if not any(name.removeprefix("model.").startswith("mtp.") for name in discover_shards(model_dir)):
        raise ConfigError(
            f"{model_dir}: speculative.drafter='dspark' needs the DSpark draft layers, but the checkpoint "
            f"has no mtp.* tensor (num_nextn_predict_layers={m})"
        )
    cfg.check_dspark(str(Path(model_dir) / "config.json"))

    def resolve(name: str) -> str | ExpertSlice | None:
        bare = name.removeprefix("model.")
        if not bare.startswith("mtp.") or is_image_router_bias(bare):
            return _SKIP
        stage, _, leaf = bare.removeprefix("mtp.").partition(".")
        leaf = DSPARK_ALIASES.get(leaf, leaf)
        if stage.isdigit() and int(stage) < m:
            if leaf in DSPARK_COMBINER:
                return f"mtp.0.{leaf}"
            if leaf in DSPARK_HEADS:
                return f"mtp.{m - 1}.{leaf}"
            bare = f"mtp.{stage}.{leaf}"
        return _target(bare, specs)

    plan = _plan(model_dir, specs, resolve)
    if plan.unexpected:
        raise WeightLoadError(
            f"unexpected DSpark tensors in {model_dir}: {_listing(sorted(plan.unexpected))}. They are not "
            f"parameters of this config's drafter (num_nextn_predict_layers={m}; DeepSeek-V4.1's DSpark "
            "stages have no hc_head_*, those of DeepSeek-V4's are not supported)."
        )
    missing = _missing(specs, plan.seen, skip=dspark_optional(cfg))
    if missing:
        raise ConfigError(
            f"{model_dir}: speculative.drafter='dspark' needs the DSpark draft layers "
            f"(num_nextn_predict_layers={m}), but the checkpoint lacks {missing[0]}"
            + (f" and {len(missing) - 1} more mtp.* tensor(s)" if len(missing) > 1 else "")
        )
    check_stored_shapes(plan.direct, plan.experts, plan.scales, specs, plan.shard_of)
    return plan


@dataclass
class _Plan:
    """Which checkpoint tensor goes where: ``direct`` (name -> inventory name), ``experts``
    (name -> slice of a stack), ``scales`` (owner -> its scale tensor), ``seen`` (inventory key
    -> the name providing it), ``unexpected`` names; ``shard_of`` every tensor's file."""

    shard_of: dict[str, Path]
    direct: dict[str, str] = field(default_factory=dict)
    experts: dict[str, ExpertSlice] = field(default_factory=dict)
    scales: dict[str, str] = field(default_factory=dict)
    seen: dict[object, str] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)


def _plan(
    model_dir: str | Path, specs: dict[str, ParamSpec], resolve: Callable[[str], str | ExpertSlice | None]
) -> _Plan:
    """Map every tensor of the checkpoint through ``resolve`` (an inventory name, an expert
    slice, ``None`` = unexpected, :data:`_SKIP` = not this part's); two tensors providing the
    same parameter are a :class:`WeightLoadError`."""
    plan = _Plan(discover_shards(model_dir))
    all_names = frozenset(plan.shard_of)
    for name in plan.shard_of:
        owner = scale_owner(name, all_names)
        if owner is not None:
            plan.scales[owner] = name
            continue
        target = resolve(name)
        if target == _SKIP:
            continue
        if target is None:
            plan.unexpected.append(name)
            continue
        key = target if isinstance(target, str) else (target.hf_name, target.expert, target.part)
        if key in plan.seen:
            raise WeightLoadError(
                f"tensors {plan.seen[key]!r} and {name!r} both provide {key!r}; remove one of them."
            )
        plan.seen[key] = name
        if isinstance(target, ExpertSlice):
            plan.experts[name] = target
        else:
            plan.direct[name] = target
    return plan


def _missing(specs: dict[str, ParamSpec], seen: dict[object, str], skip: Collection[str]) -> list[str]:
    """The parameters of ``specs`` no tensor provides (expert stacks: which experts), but ``skip``."""
    missing = []
    for name, spec in specs.items():
        if name in seen or name in skip:
            continue
        if spec.kind == "experts":
            parts = ("gate", "up") if name.endswith("gate_up") else ("down",)
            absent = [f"{e}.{p}" for e in range(spec.shape[0]) for p in parts if (name, e, p) not in seen]
            if absent:
                missing.append(f"{name} (experts {', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''})")
        else:
            missing.append(name)
    return missing


def _read_plan(
    plan: _Plan,
    specs: dict[str, ParamSpec],
    cfg: DeepseekV41Config,
    dtype: torch.dtype,
    device: str | torch.device,
    keep: frozenset[str],
) -> dict[str, Weight]:
    """Read every tensor of ``plan``, shard by shard (quantised ones dequantised or kept per
    ``keep``, per-expert tensors stacked)."""
    quant = cfg.quant
    block = tuple(quant.weight_block_size) if quant is not None else DEFAULT_FP8_BLOCK
    scales = plan.scales
    result: dict[str, Weight] = {}
    with TensorSource(plan.shard_of) as src:
        for path, names in src.names_by_shard():
            for name in names:
                if name in plan.direct:
                    target = plan.direct[name]
                    spec = specs[target]
                    if spec.kind == "engram_table":
                        result[target] = _engram_table(src, name, scales.get(name), spec, path, dtype, device)
                        continue
                    t = read_param(src, name, scales.get(name), spec, block, keep, device=device)
                    check_shape(t.shape, spec.shape, f"tensor {name!r}", path)
                    if isinstance(t, QuantizedTensor):
                        result[target] = t.to(device)
                    else:
                        result[target] = t.to(device=device, dtype=target_dtype(spec, dtype))
                elif name in plan.experts:
                    sl = plan.experts[name]
                    spec = specs[sl.hf_name]
                    t = read_param(src, name, scales.get(name), spec, block, keep, device=device)
                    _, rows, cols = spec.shape
                    want = (rows // 2, cols) if sl.part in ("gate", "up") else (rows, cols)
                    check_shape(t.shape, want, f"expert tensor {name!r}", path)
                    if sl.hf_name not in result:
                        result[sl.hf_name] = empty_stack(t, spec, dtype, device)
                    put_expert(result[sl.hf_name], sl, t, name, path)
    return result
