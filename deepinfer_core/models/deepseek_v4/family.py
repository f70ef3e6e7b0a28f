"""The ``deepseek_v4`` model family: DeepSeek-V4 behind the core's model interface.

Registered by the core's builtin plugin (:mod:`deepinfer_core.builtin_plugin`) through the
``deepinfer_register_models`` hook, like any third-party architecture; the engine reaches
the model only through :data:`FAMILY` (see :mod:`deepinfer_core.models.registry`).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.contract.placement import EXPERT_PLACEMENT_KEY, ExpertPlacement
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.registry import ModelFamily
from deepinfer_core.ops import OpTable

from .config import DSPARK_STAGES_UNSUPPORTED, DeepseekV4Config
from .loader import load_checkpoint, load_mtp_checkpoint
from .model import DeepseekV4Model
from .trained import builtin_trained_model_dir


def parse_config(data: dict[str, Any], source: str) -> DeepseekV4Config:
    """Validate ``config.json``'s dict; :class:`ConfigError` naming ``source`` and the field."""
    return DeepseekV4Config.from_dict(data, source=source)


def load_weights(
    model_dir: Path,
    cfg: DeepseekV4Config,
    dtype: torch.dtype,
    device: torch.device,
    keep: Collection[str],
    parallel: ParallelState | None = None,
    placement: ExpertPlacement | None = None,
) -> dict[str, Any]:
    """HF-named tensors of the checkpoint, validated against the parameter inventory.

    With expert parallelism (``parallel.expert_parallel``) only this rank's routed experts are
    read: the physical slots ``placement`` gives the rank (default
    :meth:`ExpertPlacement.default`: experts in order over the ranks, no replicas), stacked per
    layer; the placement is returned under :data:`EXPERT_PLACEMENT_KEY` for the MoE blocks
    (shared, so EPLB can swap it).  Dense weights are replicated.
    """
    if parallel is None or not parallel.expert_parallel:
        return load_checkpoint(model_dir, cfg, dtype, device, keep_quantized=keep)
    layers, experts = cfg.num_hidden_layers, cfg.n_routed_experts
    if placement is None:
        placement = ExpertPlacement.default(layers, experts, parallel.ep_size)
    shape = (placement.num_layers, placement.num_experts, placement.ep_size)
    if shape != (layers, experts, parallel.ep_size):
        raise ConfigError(
            f"expert placement {placement!r} does not fit the model ({layers} MoE layers, {experts} experts) "
            f"on {parallel.ep_size} EP ranks"
        )
    local = {layer: placement.local_logical(layer, parallel.ep_rank) for layer in range(layers)}
    weights: dict[str, Any] = load_checkpoint(
        model_dir, cfg, dtype, device, keep_quantized=keep, local_experts=local
    )
    weights[EXPERT_PLACEMENT_KEY] = placement
    return weights


def load_mtp_weights(
    model_dir: Path, cfg: DeepseekV4Config, dtype: torch.dtype, device: torch.device, keep: Collection[str]
) -> dict[str, Any]:
    """The first multi-token-prediction layer's tensors (``model.mtp.0.*``), for the ``mtp``
    drafter; a one-line :class:`ConfigError` when the checkpoint has none."""
    return load_mtp_checkpoint(model_dir, cfg, dtype, device, keep_quantized=keep)


def unsupported_draft_layers(cfg: DeepseekV4Config) -> str | None:
    """Why no drafter runs this checkpoint's ``mtp.*`` (``None``: the ``mtp`` drafter does):
    DSpark block-drafter stages (``dspark_*`` in ``config.json``, DeepSeek-V4-Flash-0731) are
    not supported; the main model serves without them."""
    return DSPARK_STAGES_UNSUPPORTED if cfg.has_dspark_stages else None


def build_model(
    cfg: DeepseekV4Config, weights: dict[str, Any], ops: OpTable, parallel: ParallelState | None = None
) -> Any:
    """The :class:`~.model.DeepseekV4Model` over ``weights`` (which it takes over)."""
    return DeepseekV4Model(cfg, weights, ops, parallel=parallel)


def cache_ratios(cfg: DeepseekV4Config) -> list[int]:
    """The compress ratios of the CSA / HCA layers, MTP layers included (a page holds whole
    entries of each)."""
    layers = range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    return sorted({cfg.compress_ratio(i) for i in layers} - {0})


def replay_tail(cfg: DeepseekV4Config, page_size: int, extra_layers: int = 0) -> int:
    """Tokens recomputed before a prefix-cache hit to rebuild every layer's window exactly.

    A layer's window KV at position ``p`` is exact once the layer below is exact over
    ``[p - W + 1, p]``, so the receptive field grows by one window per windowed layer (every
    V4 layer has one): ``align(align(W, P) + (N - 1) * W, P)`` with ``N`` layers, page ``P``.
    ``extra_layers``: windowed layers stacked on the last one (the MTP layer, which reads the
    last layer's output, when the ``mtp`` drafter runs) count too.
    """
    w, n = cfg.sliding_window, cfg.num_hidden_layers + extra_layers

    def align(x: int) -> int:
        return -(-x // page_size) * page_size

    return align(align(w) + (n - 1) * w)


FAMILY = ModelFamily(
    model_type="deepseek_v4",
    parse_config=parse_config,
    load_weights=load_weights,
    build_model=build_model,
    cache_ratios=cache_ratios,
    replay_tail=replay_tail,
    load_mtp_weights=load_mtp_weights,
    unsupported_draft_layers=unsupported_draft_layers,
    description="DeepSeek-V4 (hybrid sliding-window/compressed attention, MoE)",
    builtin_model_dir=builtin_trained_model_dir,
)
