"""What a DeepSeek-V4 checkpoint provides, checked before a byte of tensor data is read: where each
parameter comes from (HF or native names, per-expert tensors, scales: :class:`CheckpointPlan`),
what is missing, unexpected or provided twice, and each tensor's shape from its shard's header
(:func:`check_checkpoint`, :func:`check_mtp_checkpoint`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_core.errors import ConfigError, WeightLoadError
from deepinfer_core.weights.safetensors_io import TensorInfo, discover_shards, read_headers

from .config import DSPARK_STAGES_UNSUPPORTED, DeepseekV4Config
from .names import (
    ExpertSlice,
    expert_native_names,
    hf_to_native,
    is_dspark_stage,
    is_expert_stack,
    is_ignorable,
    is_mtp,
    mtp_layer,
    native_to_hf,
    scale_owner,
)
from .params import (
    MTP_PREFIX,
    MTP_SHARED,
    ParamSpec,
    mtp_parameter_specs,
    parameter_specs,
)

logger = logging.getLogger(__name__)
_MAX_LISTED = 5


@dataclass
class CheckpointPlan:
    """Where each model parameter comes from in the checkpoint."""

    scheme: str
    direct: dict[str, str] = field(default_factory=dict)  # storage name -> HF name
    experts: dict[str, ExpertSlice] = field(default_factory=dict)  # storage name -> slice
    scales: dict[str, str] = field(default_factory=dict)  # weight storage name -> scale name


def _listing(names: list[str], shard_of: dict[str, Path]) -> str:
    shown = ", ".join(f"{n!r} (in {shard_of[n].name})" for n in names[:_MAX_LISTED])
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return shown + more


def _detect_scheme(names: list[str], specs: dict[str, ParamSpec], shard_of: dict[str, Path]) -> str:
    hf_only = [n for n in names if n in specs and native_to_hf(n) is None]
    native_only = [n for n in names if n not in specs and native_to_hf(n) is not None]
    if hf_only and native_only:
        raise WeightLoadError(
            "checkpoint mixes HF names ("
            + _listing(hf_only, shard_of)
            + ") with native DeepSeek names ("
            + _listing(native_only, shard_of)
            + "); a checkpoint must use one naming scheme. "
            "Re-export it with one scheme."
        )
    return "native" if native_only else "hf"


def _plan(
    shard_of: dict[str, Path], specs: dict[str, ParamSpec], mtp_layers: frozenset[int] = frozenset()
) -> CheckpointPlan:
    """Where each parameter of ``specs`` comes from.  Without ``mtp_layers`` the main model's
    tensors (MTP layers and rotary buffers skipped); with them, only the tensors of those
    multi-token-prediction layers (native ``mtp.{i}.*`` or HF-style ``model.mtp.{i}.*``)."""
    all_names = frozenset(shard_of)
    weights: list[str] = []
    scales: dict[str, str] = {}
    for name in shard_of:
        owner = scale_owner(name, all_names)
        if owner is not None:
            scales[owner] = name
        elif mtp_layers and is_mtp(name):
            if mtp_layer(name) in mtp_layers:
                weights.append(name)
        elif mtp_layers or is_ignorable(name):
            if not mtp_layers:
                logger.debug("skipping %s in %s (MTP layer or rotary buffer)", name, shard_of[name])
        else:
            weights.append(name)
    scheme = "mtp" if mtp_layers else _detect_scheme(weights, specs, shard_of)
    plan = CheckpointPlan(scheme, scales=scales)
    unexpected: list[str] = []
    source_of: dict[object, str] = {}
    for name in weights:
        if plan.scheme == "mtp":  # either spelling: HF-style names are ours, native ones DeepSeek's
            target = name if name in specs else native_to_hf(name)
        else:
            target = name if plan.scheme == "hf" else native_to_hf(name)
        if isinstance(target, ExpertSlice):
            spec = specs.get(target.hf_name)
            ok = spec is not None and spec.kind == "experts" and target.expert < spec.shape[0]
        else:
            ok = target in specs
        if not ok:
            unexpected.append(name)
            continue
        key = target if isinstance(target, str) else (target.hf_name, target.expert, target.part)
        if key in source_of:
            raise WeightLoadError(
                f"tensors {source_of[key]!r} ({shard_of[source_of[key]].name}) and {name!r} "
                f"({shard_of[name].name}) both provide {key!r}; remove one of them."
            )
        source_of[key] = name
        if isinstance(target, ExpertSlice):
            plan.experts[name] = target
        else:
            plan.direct[name] = target
    if unexpected:
        what = "MTP tensors" if plan.scheme == "mtp" else f"tensors in {plan.scheme}-named checkpoint"
        raise WeightLoadError(
            f"unexpected {what}: {_listing(unexpected, shard_of)}. "
            "They are not parameters of this model config (wrong config.json, or a different model)."
        )
    return plan


def _missing(plan: CheckpointPlan, specs: dict[str, ParamSpec], cfg: DeepseekV4Config) -> list[str]:
    present = set(plan.direct.values())
    slices = {(s.hf_name, s.expert, s.part) for s in plan.experts.values()}
    missing: list[str] = []
    for name, spec in specs.items():
        if name in present or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if plan.scheme != "hf" and spec.kind == "experts":
            parts = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
            absent = [
                f"expert {e} {p}" for e in range(spec.shape[0]) for p in parts if (name, e, p) not in slices
            ]
            if absent:
                missing.append(f"{name} ({', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''})")
        else:
            missing.append(name)
    return missing


def check_shape(found: torch.Size, expected: tuple[int, ...], what: str, path: Path) -> None:
    if tuple(found) != tuple(expected):
        raise WeightLoadError(
            f"{what} in {path} has shape {tuple(found)}, expected {tuple(expected)}; "
            "the checkpoint does not match config.json."
        )


def expert_slice_shape(spec: ParamSpec, part: str) -> tuple[int, int]:
    _, rows, cols = spec.shape
    return (rows // 2, cols) if part in ("gate", "up") else (rows, cols)


_BYTE_STORAGE = frozenset({"I8", "U8"})


def stored_logical_shape(info: TensorInfo, scaled: bool) -> tuple[int, ...]:
    """The shape a stored tensor has once read: packed FP4 in bytes (``I8`` / ``U8`` with a
    scale: two e2m1 values per byte) is twice as wide in its last dimension; every other tensor
    keeps its stored shape (a header gives ``F4`` shapes in e2m1 values already)."""
    if scaled and info.dtype in _BYTE_STORAGE and info.shape:
        return (*info.shape[:-1], 2 * info.shape[-1])
    return info.shape


def check_stored_shapes(
    direct: Mapping[str, str],
    experts: Mapping[str, ExpertSlice],
    scales: Mapping[str, str],
    specs: Mapping[str, ParamSpec],
    shard_of: Mapping[str, Path],
) -> None:
    """Every planned tensor's shape, from its shard's header alone (no data read), against the
    parameter it provides (``direct``: stored name -> parameter; ``experts``: stored name ->
    slice of a stack; ``scales``: stored name -> its scale): a :class:`WeightLoadError` naming
    the first mismatch and its file before anything is read."""
    headers = read_headers({n: shard_of[n] for n in (*direct, *experts)})
    for name, target in direct.items():
        found = stored_logical_shape(headers[name], name in scales)
        what = f"tensor {name!r} (model parameter {target})"
        check_shape(found, specs[target].shape, what, shard_of[name])
    for name, sl in experts.items():
        found = stored_logical_shape(headers[name], name in scales)
        want = expert_slice_shape(specs[sl.hf_name], sl.part)
        check_shape(found, want, f"expert tensor {name!r}", shard_of[name])


def check_checkpoint(model_dir: str | Path, cfg: DeepseekV4Config) -> None:
    """What :func:`load_checkpoint` checks before it reads a byte of tensor data: every tensor
    of the checkpoint in ``model_dir`` is a parameter of ``cfg`` (or one the model skips), none
    is missing or provided twice, and each one's shape in its shard's header is its
    parameter's.  Raises :class:`WeightLoadError` as :func:`load_checkpoint` does."""
    checked_plan(model_dir, cfg, parameter_specs(cfg))


def checked_plan(
    model_dir: str | Path, cfg: DeepseekV4Config, specs: dict[str, ParamSpec]
) -> tuple[CheckpointPlan, dict[str, Path]]:
    shard_of = discover_shards(model_dir)
    plan = _plan(shard_of, specs)
    missing = _missing(plan, specs, cfg)
    if missing:
        files = sorted({p.name for p in shard_of.values()})
        shown = ", ".join(missing[:_MAX_LISTED]) + (" ..." if len(missing) > _MAX_LISTED else "")
        raise WeightLoadError(
            f"checkpoint {model_dir} lacks {len(missing)} tensor(s) of this model: {shown} (searched "
            f"{len(files)} file(s): {', '.join(files[:_MAX_LISTED])}). Check that config.json matches the "
            "weights and that the download is complete."
        )
    check_stored_shapes(plan.direct, plan.experts, plan.scales, specs, shard_of)
    return plan, shard_of


def check_mtp_checkpoint(model_dir: str | Path, cfg: DeepseekV4Config) -> None:
    """What :func:`load_mtp_checkpoint` checks before it reads tensor data (names, missing
    tensors, header shapes), raising as it does."""
    checked_mtp_plan(model_dir, cfg)


def checked_mtp_plan(
    model_dir: str | Path, cfg: DeepseekV4Config
) -> tuple[CheckpointPlan, dict[str, Path], dict[str, ParamSpec]]:
    if cfg.num_nextn_predict_layers < 1:
        raise ConfigError(
            f"speculative.drafter='mtp' needs the checkpoint's multi-token-prediction layers, but "
            f"{model_dir}/config.json has num_nextn_predict_layers={cfg.num_nextn_predict_layers}; use "
            "another drafter (e.g. 'ngram')"
        )
    specs = mtp_parameter_specs(cfg, range(1))
    shard_of = discover_shards(model_dir)
    stages = sorted(n for n in shard_of if is_dspark_stage(n))
    if stages:
        raise ConfigError(
            f"speculative.drafter='mtp': {model_dir} has {stages[0]}: {DSPARK_STAGES_UNSUPPORTED}"
        )
    plan = _plan(shard_of, specs, frozenset({0}))
    shared = {MTP_PREFIX + "0." + n for n in MTP_SHARED}
    missing = [n for n in _missing(plan, specs, cfg) if n.split(" ")[0] not in shared]
    if missing:
        shown = [_native_spelling(n) for n in missing[:_MAX_LISTED]]
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise ConfigError(
            f"speculative.drafter='mtp': checkpoint {model_dir} lacks {len(missing)} tensor(s) of "
            f"multi-token-prediction layer 0 (config.json has num_nextn_predict_layers="
            f"{cfg.num_nextn_predict_layers}): {', '.join(shown)}{more}; use a checkpoint with its "
            "mtp.* tensors or another drafter"
        )
    check_stored_shapes(plan.direct, plan.experts, plan.scales, specs, shard_of)
    return plan, shard_of, specs


def _native_spelling(missing: str) -> str:
    """A :func:`_missing` entry (an HF-style name, or a stacked expert tensor with the absent
    experts after it) in native spelling, for error messages."""
    name, _, rest = missing.partition(" ")
    try:
        if is_expert_stack(name):
            native = next(iter(expert_native_names(name, 0).values())).replace(".experts.0.", ".experts.*.")
        else:
            native = hf_to_native(name)
    except KeyError:
        native = name
    return f"{native} {rest}".rstrip()
