"""Load a DeepSeek-V4 checkpoint directory into HF-named tensors checked against the model spec.

``load_checkpoint`` reads HF-named or native-named safetensors (detected automatically),
dequantises FP8 / FP4 weights (or, with ``keep_quantized``, keeps FP8 block-scaled dense weights
and FP4 experts as :class:`~deepinfer_core.weights.quant.QuantizedTensor`), stacks native
per-expert tensors into HF's ``[E, out, in]`` stacks, converts to each parameter's target dtype
and validates names, shapes and dtypes against :func:`parameter_specs`.  Tensors are read one
at a time; expert stacks are filled in place, so peak memory is the result plus one tensor.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.errors import WeightLoadError
from deepinfer_core.weights.quant import (
    _FP4_X2,
    DEFAULT_FP8_BLOCK,
    FP4_EXPERTS,
    FP4_STORAGE_DTYPES,
    FP8_BLOCK,
    FP8_DTYPE,
    QUANTIZED_FORMATS,
    UE8M0_DTYPE,
    QuantizedTensor,
    Weight,
    dequant_fp4,
    dequant_fp8,
)
from deepinfer_core.weights.safetensors_io import TensorSource

from .checkpoint_plan import (
    CheckpointPlan,
    check_shape,
    checked_mtp_plan,
    checked_plan,
    expert_slice_shape,
)
from .config import DeepseekV4Config
from .names import (
    ExpertSlice,
    scale_candidates,
)
from .params import (
    ParamSpec,
    parameter_specs,
    target_dtype,
)

logger = logging.getLogger(__name__)
# parameter kinds (ParamSpec.kind) whose FP8 weights ``keep_quantized`` keeps: the dense matmul
# weights the ``linear`` / ``grouped_linear`` ops take
_DENSE_KINDS = frozenset({"linear", "linear_bf16"})
_LAYER_STACK_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.")
LocalExperts = Mapping[int, Sequence[int]]
"""Expert parallelism: ``{layer: the logical expert of each local slot}`` (an
:class:`~deepinfer_core.contract.placement.ExpertPlacement`'s ``local_logical``)."""


def read_param(
    src: TensorSource,
    name: str,
    scale_name: str | None,
    spec: ParamSpec,
    block: tuple[int, int],
    keep: frozenset[str] = frozenset(),
    rows: list[int] | None = None,
    device: torch.device | str | None = None,
) -> Weight:
    """Read one stored tensor, dequantised to float32 if quantised (unless its format is in
    ``keep`` and the parameter is of the kind that format serves: then a :class:`QuantizedTensor`);
    check its dtype class.  ``rows``: read only these indices of dim 0 (of the tensor and its
    scale: an HF expert stack's local experts).  ``device``: where to dequantise (the weights'
    device: on a GPU far faster than on the host; the values are the same)."""

    def get(n: str) -> torch.Tensor:
        return src.get(n) if rows is None else src.get_rows(n, rows)

    t = get(name)
    where = f"tensor {name!r} in {src.shard_of[name]}"
    quantised = (
        t.dtype == FP8_DTYPE or t.dtype in FP4_STORAGE_DTYPES or (_FP4_X2 is not None and t.dtype == _FP4_X2)
    )
    if spec.dtype_class == "int":
        if t.dtype.is_floating_point or t.dtype == torch.bool or scale_name is not None:
            raise WeightLoadError(f"{where} has dtype {t.dtype}, but this parameter is an integer table.")
        return t
    if scale_name is None:
        if quantised:
            raise WeightLoadError(
                f"{where} has dtype {t.dtype} (quantised or integer) but no scale tensor "
                f"(looked for {', '.join(scale_candidates(name))}); this parameter needs a float tensor."
            )
        if not t.dtype.is_floating_point:
            raise WeightLoadError(
                f"{where} has integer dtype {t.dtype}, but this parameter is floating point."
            )
        return t
    scale = get(scale_name)
    if scale.is_floating_point() and scale.dtype not in (torch.float32, UE8M0_DTYPE):
        scale = scale.float()  # bf16 / fp16 scales: exact in float32, as dequantising reads them
    try:
        if t.dtype == FP8_DTYPE:
            if FP8_BLOCK in keep and spec.kind in _DENSE_KINDS:
                return QuantizedTensor(t, scale, "fp8", block)
            return _dequant_on(device, dequant_fp8, t, scale, block)
        if quantised:
            packed = t.view(torch.uint8)
            group = max(1, (2 * packed.shape[-1]) // max(1, scale.shape[-1]))
            if FP4_EXPERTS in keep and spec.kind == "experts":
                return QuantizedTensor(packed, scale, "fp4", (1, group))
            return _dequant_on(device, dequant_fp4, packed, scale, group)
    except WeightLoadError as e:
        raise WeightLoadError(f"{where} with scale {scale_name!r}: {e}") from None
    raise WeightLoadError(
        f"{where} has dtype {t.dtype} yet a scale tensor {scale_name!r}; only FP8 e4m3 and packed FP4 "
        "weights carry scales."
    )


_HOST_DEQUANT: set[str] = set()  # device types whose dequantisation failed once (then the host's)


def _dequant_on(
    device: torch.device | str | None,
    fn: Callable[..., torch.Tensor],
    t: torch.Tensor,
    scale: torch.Tensor,
    arg: Any,
) -> torch.Tensor:
    """``fn(t, scale, arg)`` run on ``device`` (the tensors moved there first), or on the host
    when ``device`` is ``None`` or the host's; a device whose kernels cannot run it falls back to
    the host, logged once per device type."""
    dev = torch.device(device) if device is not None else t.device
    if dev.type == t.device.type or dev.type in _HOST_DEQUANT:
        return fn(t, scale, arg)
    try:
        return fn(t.to(dev), scale.to(dev), arg)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        _HOST_DEQUANT.add(dev.type)
        logger.warning("dequantising on %s failed (%s): dequantising on the host instead (slower)", dev, e)
        return fn(t, scale, arg)


def load_checkpoint(
    model_dir: str | Path,
    cfg: DeepseekV4Config,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    *,
    keep_quantized: bool | Collection[str] = False,
    local_experts: LocalExperts | None = None,
) -> dict[str, Weight]:
    """Load the checkpoint in ``model_dir`` as ``{HF name: tensor}`` matching ``parameter_specs(cfg)``.

    Each tensor is converted to ``target_dtype(spec, dtype)`` and moved to ``device``; FP8 and
    FP4 weights are dequantised.  ``mtp.*`` tensors and rotary ``inv_freq`` buffers are skipped.
    A missing ``lm_head.weight`` is allowed only when ``cfg.tie_word_embeddings`` (the result then
    holds the embedding under both names).

    ``keep_quantized`` keeps weights in their checkpoint format instead, as
    :class:`~deepinfer_core.weights.quant.QuantizedTensor` (data and scales moved to ``device``,
    scales in their stored dtype): ``True`` = every format of
    :data:`~deepinfer_core.weights.quant.QUANTIZED_FORMATS`, or a collection of their names.
    ``"fp8_block"`` keeps FP8 e4m3 dense weights (``linear`` kinds) with their block scales
    (``block`` from ``quantization_config.weight_block_size``, default 128x128);
    ``"fp4_experts"`` keeps FP4 e2m1 routed-expert stacks with their per-group scales (native
    per-expert tensors are stacked into ``[E, 2I, D/2]`` / ``[E, D, I/2]`` bytes).  Every other
    stored format is dequantised as usual, and a checkpoint without quantised tensors loads
    exactly as without the option.  ``QuantizedTensor.dequantize(dtype)`` gives bitwise the
    tensor this function returns without the option.

    ``local_experts`` (expert parallelism: ``{layer: logical expert of each local slot}``, every
    MoE layer) loads only those routed experts: each layer's stacks are ``[S, 2I, D]`` /
    ``[S, D, I]`` with slot ``s`` holding expert ``local_experts[layer][s]``, and the other
    experts' tensors are never read (native per-expert tensors are skipped, HF stacks read
    row by row); dense weights load whole.

    Raises :class:`WeightLoadError` naming the tensor and file for missing, unexpected,
    mis-shaped or wrongly-typed tensors and for unreadable or unsafe shards; names and shapes
    (from the shards' headers) are checked before any tensor data is read
    (:func:`check_checkpoint`).
    """
    keep = keep_formats(keep_quantized)
    specs = parameter_specs(cfg)
    local = _check_local_experts(local_experts, specs) if local_experts is not None else None
    plan, shard_of = checked_plan(model_dir, cfg, specs)
    result = _read_plan(plan, shard_of, specs, cfg, dtype, device, keep, local)
    if "lm_head.weight" not in result and cfg.tie_word_embeddings:
        result["lm_head.weight"] = result["model.embed_tokens.weight"]
    return {name: result[name] for name in specs}


def load_mtp_checkpoint(
    model_dir: str | Path,
    cfg: DeepseekV4Config,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    *,
    keep_quantized: bool | Collection[str] = False,
) -> dict[str, Weight]:
    """The checkpoint's first multi-token-prediction layer, for the ``mtp`` drafter:
    ``{HF-style name: tensor}`` matching ``mtp_parameter_specs(cfg, range(1))``
    (``model.mtp.0.*``), read from native ``mtp.0.*`` (or HF-style) tensors as
    :func:`load_checkpoint` reads the main ones (same dtypes, quantised formats and
    ``keep_quantized``).  Its own embedding and output head may be absent
    (:data:`~deepinfer_core.models.deepseek_v4.params.MTP_SHARED`): the layer then shares the main
    model's.  Tensors of further MTP layers are not read (the drafter recurses through layer 0).

    Raises :class:`ConfigError` (one line) when ``config.json`` declares no MTP layer
    (``num_nextn_predict_layers`` 0), when the ``mtp.*`` tensors are DSpark drafter stages
    (:func:`~.names.is_dspark_stage`; not supported for DeepSeek-V4) or the checkpoint lacks
    tensors of layer 0, naming them (native spelling); :class:`WeightLoadError` for unexpected,
    mis-shaped or mistyped ones.
    """
    keep = keep_formats(keep_quantized)
    plan, shard_of, specs = checked_mtp_plan(model_dir, cfg)
    result = _read_plan(plan, shard_of, specs, cfg, dtype, device, keep)
    return {name: result[name] for name in specs if name in result}


def _check_local_experts(local: LocalExperts, specs: dict[str, ParamSpec]) -> dict[str, list[int]]:
    """``{expert stack HF name: logical expert of each local slot}`` from ``{layer: slots}``;
    a one-line ``ValueError`` naming the layer for a missing layer or an expert out of range."""
    out: dict[str, list[int]] = {}
    for name, spec in specs.items():
        m = _LAYER_STACK_RE.match(name)
        if m is None or spec.kind != "experts":
            continue
        layer = int(m.group(1))
        if layer not in local:
            raise ValueError(f"local_experts: no entry for MoE layer {layer}")
        experts = [int(e) for e in local[layer]]
        bad = [e for e in experts if not 0 <= e < spec.shape[0]]
        if bad or not experts:
            raise ValueError(
                f"local_experts[{layer}] = {experts}: needs at least one expert, each in [0, {spec.shape[0]})"
            )
        out[name] = experts
    return out


def _local_spec(spec: ParamSpec, slots: int) -> ParamSpec:
    return ParamSpec((slots, *spec.shape[1:]), spec.kind)


def _read_plan(
    plan: CheckpointPlan,
    shard_of: dict[str, Path],
    specs: dict[str, ParamSpec],
    cfg: DeepseekV4Config,
    dtype: torch.dtype,
    device: str | torch.device,
    keep: frozenset[str],
    local: dict[str, list[int]] | None = None,
) -> dict[str, Weight]:
    """Read every tensor of ``plan``, shard by shard, into ``{HF name: weight}``; with
    ``local`` (:func:`_check_local_experts`) only the listed experts of each stack."""
    local = local or {}
    qcfg = cfg.quantization_config or {}
    block = tuple(qcfg.get("weight_block_size") or DEFAULT_FP8_BLOCK)
    result: dict[str, Weight] = {}
    with TensorSource(shard_of) as src:
        for path, names in src.names_by_shard():
            for name in names:
                if name in plan.direct:
                    hf = plan.direct[name]
                    spec, rows = specs[hf], local.get(plan.direct[name])
                    if rows is not None:  # an HF expert stack: this rank's experts only
                        spec = _local_spec(spec, len(rows))
                    t = read_param(src, name, plan.scales.get(name), spec, block, keep, rows, device)
                    check_shape(t.shape, spec.shape, f"tensor {name!r} (model parameter {hf})", path)
                    if isinstance(t, QuantizedTensor):
                        result[hf] = t.to(device)
                    else:
                        result[hf] = t.to(device=device, dtype=target_dtype(spec, dtype))
                elif name in plan.experts:
                    sl = plan.experts[name]
                    spec, slots = specs[sl.hf_name], [sl.expert]
                    if sl.hf_name in local:  # expert parallelism: only this rank's experts
                        slots = [s for s, e in enumerate(local[sl.hf_name]) if e == sl.expert]
                        if not slots:
                            continue  # another rank's expert: not read
                        spec = _local_spec(spec, len(local[sl.hf_name]))
                    t = read_param(src, name, plan.scales.get(name), spec, block, keep, device=device)
                    check_shape(t.shape, expert_slice_shape(spec, sl.part), f"expert tensor {name!r}", path)
                    if sl.hf_name not in result:
                        result[sl.hf_name] = empty_stack(t, spec, dtype, device)
                    for slot in slots:
                        put_expert(result[sl.hf_name], sl, t, name, path, slot)
    return result


def keep_formats(keep_quantized: bool | Collection[str]) -> frozenset[str]:
    """The weight formats a load keeps quantised: all of them (``True``), none (``False``) or the
    ones named; an unknown name is a :class:`ValueError`."""
    if isinstance(keep_quantized, bool):
        return frozenset(QUANTIZED_FORMATS if keep_quantized else ())
    formats = frozenset(keep_quantized)
    unknown = sorted(formats - set(QUANTIZED_FORMATS))
    if unknown:
        raise ValueError(f"keep_quantized: unknown formats {unknown}; known: {list(QUANTIZED_FORMATS)}")
    return formats


def empty_stack(first: Weight, spec: ParamSpec, dtype: torch.dtype, device: str | torch.device) -> Weight:
    """The ``[E, out, in]`` stack an expert tensor goes into: plain in the target dtype, or (for a
    kept FP4 slice) packed bytes and scales of the slice's format."""
    if not isinstance(first, QuantizedTensor):
        return torch.empty(spec.shape, dtype=target_dtype(spec, dtype), device=device)
    e, rows, cols = spec.shape
    group = first.block[1]
    data = torch.empty((e, rows, cols // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((e, rows, cols // group), dtype=first.scale.dtype, device=device)
    return QuantizedTensor(data, scale, first.fmt, first.block)


def put_expert(
    stack: Weight, sl: ExpertSlice, t: Weight, name: str, path: Path, slot: int | None = None
) -> None:
    """Copy expert slice ``t`` into its rows of ``stack``'s slot ``slot`` (default: its expert's)."""
    slot = sl.expert if slot is None else slot
    rows = t.shape[0]
    start = rows if sl.part == "up" else 0
    if isinstance(stack, QuantizedTensor) != isinstance(t, QuantizedTensor) or (
        isinstance(stack, QuantizedTensor)
        and isinstance(t, QuantizedTensor)
        and (t.block, t.scale.dtype) != (stack.block, stack.scale.dtype)
    ):
        raise WeightLoadError(
            f"expert tensor {name!r} in {path} is stored in another format than the other experts of "
            f"{sl.hf_name}; keep_quantized needs one format per expert stack (load with "
            "keep_quantized=False to dequantise them all)"
        )
    if isinstance(stack, QuantizedTensor) and isinstance(t, QuantizedTensor):
        stack.data[slot, start : start + rows].copy_(t.data)
        stack.scale[slot, start : start + rows].copy_(t.scale)
    else:
        stack[slot, start : start + rows].copy_(t)
