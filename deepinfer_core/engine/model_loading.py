"""Loading a checkpoint's weights into the family's model (:func:`load_model`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.distributed.eplb import initial_placement
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.registry import ModelFamily
from deepinfer_core.ops import OpTable

from .resolved import LoadPlan

if TYPE_CHECKING:
    from deepinfer_core.config import EPLBConfig
    from deepinfer_core.contract.parallel import ParallelState

logger = logging.getLogger("deepinfer.engine")


def load_model(
    model_dir: str | Path,
    family: ModelFamily,
    model_config: Any,
    ops: OpTable,
    load: LoadPlan,
    *,
    mtp: bool = False,
    parallel: ParallelState | None = None,
    eplb: EPLBConfig | None = None,
) -> Any:
    """Load ``model_dir``'s weights as ``load`` says and build the family's model.

    Args:
        mtp: also load the checkpoint's draft layers (``ModelFamily.load_mtp_weights``); a
            one-line :class:`ConfigError` when the family has none.
        parallel: this process's place in a distributed run (``None`` = a single process);
            with more than one rank it is passed to the family's ``load_weights`` (each rank
            loads only its experts) and ``build_model``.
        eplb: expert-parallel load balancing (its redundant expert slots are loaded too).
    """
    dtype, device = load.torch_dtype, torch.device(load.device)
    formats = load.quantized_formats
    # the parallel keyword only in a distributed run: single-process families need not take it
    distributed = parallel is not None and parallel.world_size > 1
    dist_kw: dict[str, Any] = {"parallel": parallel} if distributed else {}
    load_kw = dict(dist_kw)
    if distributed and parallel.expert_parallel and eplb is not None:  # EPLB's redundant slots
        load_kw["placement"] = initial_placement(model_config, parallel.ep_size, eplb.num_redundant_experts)
    weights = family.load_weights(Path(model_dir), model_config, dtype, device, formats, **load_kw)
    if mtp:
        if family.load_mtp_weights is None:
            raise ConfigError(
                f"speculative drafter with model layers ('mtp', 'dspark'): model family "
                f"{family.model_type!r} has no draft layers (ModelFamily.load_mtp_weights); "
                "use another drafter"
            )
        weights.update(family.load_mtp_weights(Path(model_dir), model_config, dtype, device, formats))
    model = family.build_model(model_config, weights, ops, **dist_kw)
    del weights
    total, quantized = model.weight_bytes(), model.quantized_weight_bytes()
    logger.info(
        "weights: %s on %s, %s of it quantised (%s)",
        _size(total),
        device,
        _size(quantized),
        f"kept: {', '.join(formats)}" if formats else "keep_quantized off",
    )
    return model


def _size(nbytes: int) -> str:
    """A byte count for the log: GiB from 1 GiB up, MiB below."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
