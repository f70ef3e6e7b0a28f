"""Wiring an engine: resolve its configuration once, then build its components from it.

:func:`build_engine_parts` is the one place that turns the user's options into an engine's
parts: the model directory, family, backend and op table; the resolved configuration
(:mod:`deepinfer_core.engine.resolved`); the model runner (weights, caches, device graphs); the
tokenizer; the scheduler, the grammar backends and the logits processors.  The
:class:`~deepinfer_core.engine.llm_engine.LLMEngine` adds the step loop's state and the
speculative decoder, which drive these parts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.backends.base import BackendSpec
from deepinfer_core.backends.resolve import resolve_backend
from deepinfer_core.config import EngineConfig
from deepinfer_core.devices import check_device
from deepinfer_core.distributed.eplb import EplbController
from deepinfer_core.distributed.init import check_parallel_config
from deepinfer_core.engine.logits_processing import LogitsProcessors
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.engine.resolved import LoadPlan, ResolvedConfig, resolve_load
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.engine.speculative import check_draft_layers, drafter_class, verify_policy
from deepinfer_core.engine.structured import StructuredOutputs
from deepinfer_core.errors import ConfigError
from deepinfer_core.hub import TOKENIZER_PATTERNS, parse_repo_id, snapshot_dir
from deepinfer_core.models.context_parallel import cp_min_tokens
from deepinfer_core.models.registry import ModelFamily, default_model_dir, resolve_family
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.overlap import max_overlap_rows
from deepinfer_core.plugins.lookup import ComponentLookup, subclass_of
from deepinfer_core.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from deepinfer_core.contract.parallel import ParallelState
    from deepinfer_core.speculative.draft_model import DraftModel

logger = logging.getLogger("deepinfer.engine")


def resolve_model_dir(
    model: str | None, revision: str | None = None, download_dir: str | None = None, plugins: Any = None
) -> Path:
    """The model directory that ``model`` names.

    * ``None``: the default model family's built-in tiny model, made locally on first use
      (never a download; :func:`~deepinfer_core.models.registry.default_model_dir`, through
      ``plugins``, default the process-wide plugin manager).
    * an existing local directory: that directory (``revision`` does not apply: a warning).
    * otherwise, a Hugging Face Hub repo id ``org/name`` or ``org/name@revision`` (e.g.
      ``deepseek-ai/DeepSeek-V4.1-Flash-1017``): its snapshot directory, fetched by
      ``huggingface_hub.snapshot_download`` (configs, safetensors and tokenizer files, never
      pickles) into ``download_dir`` or the HF cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``);
      with ``HF_HUB_OFFLINE=1`` the cache alone is read.  The only case that uses the network.
      See :mod:`deepinfer_core.hub`.

    Raises:
        ConfigError: a missing local path that is not a Hub id; a Hub id that cannot be had
            (uncached offline, no network, unknown repo or revision, ``huggingface_hub`` not
            installed) — one line naming the id and how to point at a local copy.
    """
    if model is None:
        return default_model_dir(plugins)
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            logger.warning("revision=%r ignored: model %s is a local directory", revision, path)
        return path
    if not path.exists() and parse_repo_id(model) is not None:
        return snapshot_dir(model, revision=revision, download_dir=download_dir)
    raise ConfigError(
        f"model={model!r}: no such directory; pass a directory holding config.json and safetensors, "
        "a Hugging Face Hub repo id (org/name), or omit model to use the built-in tiny model"
    )


def resolve_tokenizer_dir(tokenizer: str | None, model_dir: Path, download_dir: str | None = None) -> Path:
    """The tokenizer directory: ``model_dir`` when ``tokenizer`` is ``None``, a local path as
    given, or the snapshot of a Hub repo id (``org/name[@revision]``; tokenizer files only)."""
    if tokenizer is None:
        return model_dir
    path = Path(tokenizer).expanduser()
    if not path.exists() and parse_repo_id(tokenizer) is not None:
        return snapshot_dir(
            tokenizer, download_dir=download_dir, what="tokenizer", patterns=TOKENIZER_PATTERNS
        )
    return path


@dataclass
class EngineParts:
    """What :func:`build_engine_parts` builds for one engine (see
    :class:`~deepinfer_core.engine.llm_engine.LLMEngine` for each)."""

    config: ResolvedConfig
    plugins: Any
    parallel: ParallelState | None
    family: ModelFamily
    backend: BackendSpec
    ops: OpTable
    runner: ModelRunner
    eplb: EplbController | None
    tokenizer: Any
    tokenizer_error: str | None
    eos_token_ids: list[int]
    scheduler: Scheduler
    structured: StructuredOutputs
    processors: LogitsProcessors
    drafter_cls: type | None


def build_engine_parts(options: EngineConfig, plugins: Any, parallel: ParallelState | None) -> EngineParts:
    """Resolve ``options`` once and build an engine's components from the result.

    Raises:
        ConfigError: what cannot be served as configured (one line naming the option).
    """
    plugins.configure(options)
    _check_environment()
    model_dir = resolve_model_dir(options.model, options.revision, options.download_dir, plugins)
    tokenizer_dir = resolve_tokenizer_dir(options.tokenizer, model_dir, options.download_dir)
    family, model_config = resolve_family(model_dir, plugins)
    backend, ops = resolve_backend(options.backend, options.strict_ops, plugins=plugins)
    load = resolve_load(options, backend, family=family, model_config=model_config)
    check_device(load.device)
    if options.batch_invariant:
        _check_batch_invariance(backend, ops, plugins, torch.device(load.device).type)
    drafter_cls = None
    if options.speculative is not None:  # before the runner: the mtp drafter's layer loads with it
        drafter_cls = drafter_class(options.speculative, plugins)
        verify_policy(options.speculative, plugins)  # an unknown name fails before any weight loads
    mtp = drafter_cls is not None and drafter_cls.uses_mtp_layers
    if parallel is not None and parallel.world_size > 1:
        _check_parallel(options, parallel, mtp)
    if mtp:
        check_draft_layers(family, options.speculative.drafter, drafter_cls.mtp_kind, model_config)  # type: ignore[union-attr]
    draft_model = drafter_cls.draft_model if drafter_cls is not None else None
    runner = _load_runner(model_dir, options, ops, load, family, model_config, mtp, parallel, draft_model)
    config = runner.config
    _log_config(config, backend)
    eplb = None  # expert-parallel load balancing, stepped after every step (before graph capture)
    if config.eplb is not None and config.expert_parallel:
        steps = config.eplb.layers_per_step
        eplb = EplbController(config.eplb, None, runner.model, parallel, layers_per_step=steps)
    _capture_graphs(runner, config, backend)
    if backend.compiles_kernels:
        _warm_up(runner, backend)
    if eplb is not None:  # the captures' and warm-ups' forwards routed padding rows: not load
        eplb.counts.zero_()
    tokenizer, tokenizer_error = _load_tokenizer(tokenizer_dir)
    eos = list(model_config.eos_token_ids)
    if tokenizer is not None:
        eos += [t for t in tokenizer.eos_token_ids if t not in eos]
    scheduler_cls = ComponentLookup(plugins, "schedulers", "scheduler {}", check=subclass_of(Scheduler))
    scheduler = scheduler_cls.get(config.scheduler)(
        runner.kv_cache,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.enable_chunked_prefill,
        replay_tail=config.replay_tail,
        max_model_len=config.max_model_len,
    )
    structured = StructuredOutputs(
        plugins,
        tokenizer,
        tokenizer_error,
        model_config.vocab_size,
        eos,
        overlap=runner.device.type == "cpu",  # the forward runs on this thread
    )
    return EngineParts(
        config=config,
        plugins=plugins,
        parallel=parallel,
        family=family,
        backend=backend,
        ops=ops,
        runner=runner,
        eplb=eplb,
        tokenizer=tokenizer,
        tokenizer_error=tokenizer_error,
        eos_token_ids=eos,
        scheduler=scheduler,
        structured=structured,
        processors=LogitsProcessors(plugins, model_config.vocab_size, runner.device),
        drafter_cls=drafter_cls,
    )


def _load_runner(
    model_dir: Path,
    options: EngineConfig,
    ops: OpTable,
    load: LoadPlan,
    family: ModelFamily,
    model_config: Any,
    mtp: bool,
    parallel: ParallelState | None,
    draft_model: type[DraftModel] | None = None,
) -> ModelRunner:
    """:meth:`ModelRunner.load`, running out of memory turned into a one-line :class:`ConfigError`."""
    try:
        kw = {
            "family": family,
            "model_config": model_config,
            "mtp": mtp,
            "parallel": parallel,
            "draft_model": draft_model,
        }
        return ModelRunner.load(model_dir, options, ops, load, **kw)
    except (MemoryError, RuntimeError) as e:  # torch's CPU allocator raises a RuntimeError
        if not isinstance(e, MemoryError | torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        raise ConfigError(
            f"not enough memory on {load.device} for the model, its KV cache and step buffers "
            f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); lower max_num_seqs, "
            "max_num_batched_tokens, max_model_len or num_cache_pages / kv_cache_memory_gb"
        ) from None


def _log_config(config: ResolvedConfig, backend: BackendSpec) -> None:
    logger.info(
        "engine: model %s (%s), backend %r (device %s, dtype %s), max_model_len %d, page_size %d, "
        "quantised weights kept: %s%s",
        config.model,
        config.model_type,
        backend.name,
        config.device,
        config.dtype,
        config.max_model_len,
        config.page_size,
        ", ".join(config.quantized_formats) or "none",
        " (the backend's declaration)" if config.load.formats_declared else "",
    )


def _check_environment() -> None:
    """Refuse a malformed value of an environment variable that the model reads while it runs
    (one-line :class:`ConfigError` naming it), before anything is loaded."""
    for read in (cp_min_tokens, max_overlap_rows):
        try:
            read()
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_parallel(options: EngineConfig, parallel: ParallelState, mtp: bool) -> None:
    """Refuse what a distributed run cannot do (one-line :class:`ConfigError` saying why)."""
    check_parallel_config(options)
    if mtp and parallel.expert_parallel:
        raise ConfigError(
            f"speculative.drafter={options.speculative.drafter!r} runs the MTP layer, whose extra "  # type: ignore[union-attr]
            "forwards would not line up with the other ranks' expert-parallel collectives; use a "
            "drafter without model layers ('ngram') or turn enable_expert_parallel off"
        )


def _check_batch_invariance(backend: BackendSpec, ops: OpTable, plugins: Any, device_type: str) -> None:
    """Refuse ``batch_invariant=True`` where the op table does not honour it on this device.

    The backend's declaration covers its whole table as the engine runs it: its kernels,
    and the reference ops it leaves to fall back, whose fixed-tile GEMMs run on the table's
    ``tile_matmul``.  So a backend declaring a device the reference does not hold on must
    provide ``tile_matmul`` itself.
    """
    if device_type not in backend.batch_invariant_devices:
        honoured = ", ".join(backend.batch_invariant_devices) or "no device"
        raise ConfigError(
            f"batch_invariant=True: backend {backend.name!r} does not guarantee batch invariance on "
            f"{device_type} (it does on: {honoured}); run on such a device, pick another backend, or "
            "turn batch_invariant off"
        )
    reference = plugins.get_backend("reference")
    if ops.sources.get("tile_matmul") == "reference" and device_type not in reference.batch_invariant_devices:
        raise ConfigError(
            f"batch_invariant=True: backend {backend.name!r} declares batch invariance on {device_type} "
            "but leaves op 'tile_matmul' (the GEMM every batch-invariant product runs on) to the "
            f"reference, which does not hold on {device_type}; provide 'tile_matmul' in the backend "
            "or turn batch_invariant off"
        )


def _capture_graphs(runner: ModelRunner, config: ResolvedConfig, backend: BackendSpec) -> None:
    """Capture the decode graphs when the backend supports it (``enforce_eager`` off), and
    log what was decided."""
    if config.enforce_eager:
        logger.info("device graphs off: enforce_eager=True")
        return
    if not backend.supports_graph_capture:
        logger.info("device graphs off: backend %r does not support graph capture", backend.name)
        return
    t0 = time.perf_counter()
    if backend.graph_runtime is None:
        reason = runner.capture_graphs()
    else:  # the backend's own graph runtime for its device type
        factory, pool, why = backend.graph_runtime(runner.device)
        reason = runner.capture_graphs(factory, pool) if factory is not None else why or "no graph runtime"
    if reason is None:
        families = "; ".join(f"{name} {buckets}" for name, buckets in runner.graph_manager.summary().items())
        logger.info(
            "captured device graphs (family [buckets]; verify: %d tokens per request): %s in %.1f s",
            1 + runner.num_spec_tokens,
            families or "none",
            time.perf_counter() - t0,
        )
    elif runner.device.type == "cpu":
        logger.debug("device graphs off: %s", reason)
    else:
        logger.warning("device graphs off, decode runs eagerly: %s", reason)


def _warm_up(runner: ModelRunner, backend: BackendSpec) -> None:
    """Compile the kernels of a backend that compiles them at their first call (see
    :attr:`BackendSpec.compiles_kernels`) before any request arrives: the model's forwards and
    the greedy pick of the engine's sampler (``argmax_rows`` over fp32 logits of one row and of
    a full decode batch)."""
    t0 = time.perf_counter()
    counts = runner.warm_up()
    for rows in sorted({1, runner.config.max_num_seqs}):
        runner.ops.argmax_rows(torch.zeros(rows, runner.model_config.vocab_size, device=runner.device))
    logger.info(
        "backend %r: kernels warmed up (steps of %s tokens) in %.1f s",
        backend.name,
        ", ".join(map(str, counts)),
        time.perf_counter() - t0,
    )


def _load_tokenizer(path: Path) -> tuple[Any, str | None]:
    try:
        return load_tokenizer(path), None
    except ConfigError as e:
        logger.warning("no tokenizer (%s): only token-id prompts can be served", e)
        return None, str(e)
