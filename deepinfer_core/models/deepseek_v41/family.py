"""The ``deepseek_v41`` model family: DeepSeek-V4.1's text backbone behind the core's model interface.

Registered by the core's builtin plugin (:mod:`deepinfer_core.builtin_plugin`) through the
``deepinfer_register_models`` hook.  What is not served yet is refused with a one-line
:class:`~deepinfer_core.errors.ConfigError` saying ``not implemented yet: <what>``, never run
approximately.  The DSpark block drafter's layers (``mtp.*``) load with
``speculative.drafter="dspark"`` (:func:`load_mtp_weights`, :mod:`.dspark`).
``kv_cache_dtype="fp8"`` stores the caches in the release's packed FP8/FP4 formats
(:mod:`deepinfer_core.ops.kv_blockscaled`).  See ``docs/deepseek_v41.md``.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.registry import ModelFamily
from deepinfer_core.ops import OpTable

from . import ops as _ops  # noqa: F401  (registers the deepseek_v41.* ops before the op table is built)
from .config import MODEL_TYPE, DeepseekV41Config
from .engram import EngramLayout, compressed_token_map, token_map_for_vocab
from .model import DeepseekV41Model
from .weights import load_dspark_weights
from .weights import load_weights as load

DESCRIPTION = "DeepSeek-V4.1 (causal encoder-decoder: shared compressed KV, two-level top-k, single-pass mHC)"


def parse_config(data: dict[str, Any], source: str) -> DeepseekV41Config:
    """Validate ``config.json``'s dict (the wrapper or the text config); :class:`ConfigError`
    naming ``source`` and the field."""
    return DeepseekV41Config.from_dict(data, source=source)


def unsupported(cfg: DeepseekV41Config) -> str | None:
    """What of ``cfg`` the engine cannot run yet (``None``: nothing)."""
    if not cfg.norm_topk_prob or cfg.num_experts_per_tok < 2:
        return "routing without renormalised top-k weights (norm_topk_prob false or num_experts_per_tok 1)"
    return None


def _refuse(cfg: DeepseekV41Config) -> None:
    missing = unsupported(cfg)
    if missing is not None:
        raise ConfigError(f"model family {MODEL_TYPE!r}: not implemented yet: {missing}")


def _refuse_parallel(parallel: ParallelState | None) -> None:
    """One-line :class:`ConfigError` for what a distributed V4.1 cannot do yet: expert
    parallelism (its MoE block is its own) and context parallelism (its step plans are its
    own, so its mirrors would compute every row: the extra ranks would only cost)."""
    if parallel is not None and parallel.expert_parallel:
        raise ConfigError(
            f"model family {MODEL_TYPE!r}: enable_expert_parallel is not implemented yet for its MoE "
            "(data_parallel_size alone replicates the experts)"
        )
    if parallel is not None and parallel.cp_size > 1:
        raise ConfigError(
            f"model family {MODEL_TYPE!r}: context_parallel_size={parallel.cp_size} is not implemented yet "
            "(its step plans do not split prefills); use data_parallel_size alone"
        )


def load_weights(
    model_dir: Path,
    cfg: DeepseekV41Config,
    dtype: torch.dtype,
    device: torch.device,
    keep: Collection[str],
    parallel: ParallelState | None = None,
) -> dict[str, Any]:
    """The checkpoint's tensors by inventory name (:mod:`.weights`); with Engram layers also
    ``engram.token_map``, each token id's normalised id, from the checkpoint's ``tokenizer.json``
    (:func:`~.engram.compressed_token_map`), checked against ``engram_compressed_vocab_size``.
    ``parallel``: a distributed run's layout; expert and context parallelism are refused
    (one-line :class:`ConfigError`), data parallelism loads every weight on every rank."""
    _refuse_parallel(parallel)
    _refuse(cfg)
    token_map = _engram_token_map(Path(model_dir), cfg) if cfg.engram_layer_ids else None
    weights = load(model_dir, cfg, dtype, device, keep_quantized=keep)
    if token_map is not None:
        weights["engram.token_map"] = token_map.to(device)
    return weights


def _engram_token_map(model_dir: Path, cfg: DeepseekV41Config) -> torch.Tensor:
    EngramLayout.from_config(cfg).check(cfg, str(model_dir / "config.json"))
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"{model_dir}: the Engram layers hash normalised token ids, which come from the checkpoint's "
            "tokenizer.json; there is none"
        )
    token_map, size = compressed_token_map(path)
    if size != cfg.engram_compressed_vocab_size:
        raise ConfigError(
            f"{path}: the tokenizer's normalised vocabulary has {size} ids but "
            f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}; every Engram hash "
            "would address the wrong rows"
        )
    return token_map_for_vocab(token_map, cfg.vocab_size, cfg.engram_pad_id)


def load_mtp_weights(
    model_dir: Path, cfg: DeepseekV41Config, dtype: torch.dtype, device: torch.device, keep: Collection[str]
) -> dict[str, Any]:
    """The DSpark drafter's tensors (``mtp.*``, :func:`~.weights.load_dspark_weights`), for the
    ``dspark`` drafter; a one-line :class:`ConfigError` when the checkpoint lacks them."""
    return load_dspark_weights(model_dir, cfg, dtype, device, keep_quantized=keep)


def build_model(
    cfg: DeepseekV41Config, weights: dict[str, Any], ops: OpTable, parallel: ParallelState | None = None
) -> Any:
    """The :class:`~.model.DeepseekV41Model` over ``weights`` (which it takes over); refuses
    expert and context parallelism like :func:`load_weights`."""
    _refuse_parallel(parallel)
    _refuse(cfg)
    return DeepseekV41Model(cfg, weights, ops)


def cache_ratios(cfg: DeepseekV41Config) -> list[int]:
    """The compress ratios of the entry pools (1 and 2 in the release): a page holds whole
    entries of each."""
    return sorted(set(cfg.compress_ratios) - {0})


def replay_tail(cfg: DeepseekV41Config, page_size: int, extra_layers: int = 0) -> int:
    """Tokens recomputed before a prefix-cache hit to rebuild every layer's window exactly.

    Every V4.1 layer keeps a window, so the receptive field grows one window per layer as in
    V4: ``align(align(W, P) + (N - 1) * W, P)``.  (The release's bounded replay -- encoder
    side exact from the cached shared KV, decoder side on each request's last tokens only -- is
    not implemented yet; this bound is exact and longer.)
    """
    w, n = cfg.sliding_window, cfg.num_hidden_layers + extra_layers

    def align(x: int) -> int:
        return -(-x // page_size) * page_size

    return align(align(w) + (n - 1) * w)


FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    parse_config=parse_config,
    load_weights=load_weights,
    build_model=build_model,
    cache_ratios=cache_ratios,
    replay_tail=replay_tail,
    description=DESCRIPTION,
    load_mtp_weights=load_mtp_weights,
    mtp_kind="dspark",
)
