"""The engine configuration resolved against the model, the backend and the device: frozen.

The user's options (:class:`~deepinfer_core.config.EngineConfig`) leave values open (``auto``
dtype, a page size and ``max_model_len`` to default, a cache given in pages or in GiB); this
module closes them, once, and every subsystem (model runner, scheduler, engine, speculative
decoder) reads the result and none writes it:

1. :func:`resolve_load` — what is known before the weights load, from the options, the
   backend and the model's config: the device, the dtype, the weight formats kept quantised,
   the page size and the ``max_model_len`` asked for (defaulted from the model's positions and
   checked against them) (:class:`LoadPlan`; a bad value fails here, before any loading);
2. the model is loaded with it (its cache specs give the bytes one cache page takes);
3. :func:`resolve_config` — the rest, from the load plan, the model's cache specs and the
   process's place in a distributed run: the number of cache pages, ``max_model_len`` checked
   against them, the prefix-cache replay tail, the graph buckets and the parallel plan
   (:class:`ResolvedConfig`, which holds the load plan too).

The two steps exist because the cache's size in pages (``kv_cache_memory_gb``) and so the
longest sequence it can hold depend on the loaded model's caches, while loading needs the
dtype; no value is resolved in both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.graphs import batch_buckets
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.cache_spec import CacheSpec, spec_bytes

if TYPE_CHECKING:
    from deepinfer_core.backends.base import BackendSpec
    from deepinfer_core.contract.parallel import ParallelState
    from deepinfer_core.models.registry import ModelFamily

logger = logging.getLogger("deepinfer.engine")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_through(holder: str, name: str, doc: str) -> property:
    """A read-only property giving ``self.<holder>.<name>``: one value, one holder."""
    return property(lambda self: getattr(getattr(self, holder), name), doc=doc)


@dataclass(frozen=True)
class LoadPlan:
    """What is resolved before the weights load (:func:`resolve_load`).

    Attributes:
        device: the torch device string (``config.device``, else the backend's device type).
        dtype: the model dtype's name (``auto`` resolved on the backend's device type).
        quantized_formats: the weight formats kept quantised in device memory.
        formats_declared: whether those come from the backend's declaration
            (``keep_quantized`` not given).
        page_size: token positions per cache page (a multiple of every compress ratio).
        wanted_max_model_len: ``max_model_len`` as asked for or defaulted from the model,
            before the cache is sized (:attr:`ResolvedConfig.max_model_len` is the one used).
        kv_formats: the backend's packed KV format substitutes
            (:attr:`~deepinfer_core.backends.BackendSpec.kv_formats`), applied to the model's
            cache specs before the cache is sized.
    """

    device: str
    dtype: str
    quantized_formats: tuple[str, ...]
    formats_declared: bool
    page_size: int
    wanted_max_model_len: int
    kv_formats: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model dtype as a ``torch.dtype``."""
        return TORCH_DTYPES[self.dtype]


def resolve_load(
    options: EngineConfig, backend: BackendSpec | None, *, family: ModelFamily, model_config: Any
) -> LoadPlan:
    """The :class:`LoadPlan` of ``options`` for ``model_config`` on ``backend`` (``None``: no
    backend's declaration, the device ``options.device`` or ``cpu``; for a model runner built
    without an engine).

    Raises:
        ConfigError: a page size that is not a multiple of the model's compress ratios, a
            ``max_model_len`` beyond the model's positions.
    """
    device_type = backend.device_type if backend is not None else torch.device(options.device or "cpu").type
    declared = backend.quantized_weights if backend is not None else ()
    return LoadPlan(
        device=options.device or device_type,
        dtype=options.resolved_dtype(device_type),
        quantized_formats=options.resolved_quantized_formats(declared),
        formats_declared=options.keep_quantized is None,
        page_size=options.resolved_page_size(family.cache_ratios(model_config)),
        wanted_max_model_len=options.resolved_max_model_len(model_config.max_position_embeddings),
        kv_formats=dict(backend.kv_formats) if backend is not None else {},
    )


@dataclass(frozen=True)
class ResolvedConfig:
    """The frozen configuration every subsystem of one engine reads (:func:`resolve_config`).

    Its own attributes are the resolved values; every other option reads through to
    :attr:`options` as the user gave it (``config.max_num_seqs``), so it stands in for the
    options wherever they are read.  Assigning any attribute raises
    :class:`dataclasses.FrozenInstanceError`.

    Attributes:
        options: the user's options, as given.
        load: the :class:`LoadPlan` the weights were loaded with (``device``, ``dtype``,
            ``quantized_formats``, ``page_size`` read through to it).
        model: the model directory (``options.model`` resolved: local, Hub snapshot or the
            built-in model).
        model_type: the checkpoint's ``model_type``.
        max_model_len: the longest sequence (defaulted from the model's positions, checked
            against the cache: the one value the engine, runner and scheduler use).
        num_cache_pages: pages of the paged cache.
        page_bytes, slot_bytes: bytes one cache page and one sequence slot take.
        replay_tail: tokens recomputed before a prefix-cache hit (page-aligned).
        num_spec_tokens: the most draft tokens of a verify step (0 without speculation).
        mtp: whether the checkpoint's draft layers are loaded and run.
        graph_buckets: the batch sizes of the decode (and verify) graphs.
        mixed_graph_max_tokens: the largest mixed-step graph (0 = none; none in a
            distributed run).
        distributed: more than one process (the parallel plan: ``world_size > 1``).
        expert_parallel: the experts are spread over the ranks.
    """

    options: EngineConfig
    load: LoadPlan
    model: str
    model_type: str
    max_model_len: int
    num_cache_pages: int
    page_bytes: int
    slot_bytes: int
    replay_tail: int
    num_spec_tokens: int
    mtp: bool
    graph_buckets: tuple[int, ...]
    mixed_graph_max_tokens: int
    distributed: bool
    expert_parallel: bool

    def __getattr__(self, name: str) -> Any:  # only for names that are not resolved here
        if name == "options":  # not set yet (copying, unpickling)
            raise AttributeError(name)
        return getattr(self.options, name)

    device = read_through("load", "device", "The torch device string.")
    page_size = read_through("load", "page_size", "Token positions per cache page.")
    dtype = read_through("load", "dtype", "The model dtype's name.")
    torch_dtype = read_through("load", "torch_dtype", "The model dtype.")
    quantized_formats = read_through("load", "quantized_formats", "The weight formats kept quantised.")

    @property
    def keep_quantized(self) -> bool:
        """Whether any weight format is kept quantised."""
        return bool(self.load.quantized_formats)

    @property
    def capacity_tokens(self) -> int:
        """Token positions the paged cache holds."""
        return self.num_cache_pages * self.page_size


def cache_bytes(specs: Sequence[Sequence[CacheSpec]], page_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes ``(per page, per sequence slot)`` of a model's cache specs."""
    per_page = per_slot = 0
    for layer_specs in specs:
        for spec in layer_specs:
            p, s = spec_bytes(spec, page_size, dtype)
            per_page, per_slot = per_page + p, per_slot + s
    return per_page, per_slot


def resolve_config(
    options: EngineConfig,
    load: LoadPlan,
    *,
    model_dir: str | Path,
    family: ModelFamily,
    model_config: Any,
    cache_specs: Sequence[Sequence[CacheSpec]],
    parallel: ParallelState | None = None,
    mtp: bool = False,
) -> ResolvedConfig:
    """Resolve the rest of ``options`` against the loaded model's caches and the process's
    place in a run.

    Args:
        options: the user's options.
        load: the plan the weights were loaded with (:func:`resolve_load`).
        model_dir: the model directory.
        family, model_config: the model family and its parsed config.
        cache_specs: the loaded model's cache specs (``Model.cache_specs``).
        parallel: this process's place in a distributed run (``None``: a single process).
        mtp: whether the draft layers are loaded (their window needs a longer replay tail).

    Raises:
        ConfigError: an explicit ``max_model_len`` longer than an explicitly sized cache holds.
    """
    page_size, wanted = load.page_size, load.wanted_max_model_len
    page_bytes, slot_bytes = cache_bytes(cache_specs, page_size, load.torch_dtype)
    if options.num_cache_pages is not None:
        num_pages = options.num_cache_pages
    elif options.kv_cache_memory_gb is not None:
        num_pages = max(1, int(options.kv_cache_memory_gb * 2**30 // max(page_bytes, 1)))
    else:
        num_pages = options.max_num_seqs * -(-wanted // page_size)
    distributed = parallel is not None and parallel.world_size > 1
    return ResolvedConfig(
        options=options,
        load=load,
        model=str(model_dir),
        model_type=family.model_type,
        max_model_len=_fit_max_model_len(wanted, options.max_model_len is not None, page_size, num_pages),
        num_cache_pages=num_pages,
        page_bytes=page_bytes,
        slot_bytes=slot_bytes,
        replay_tail=_replay_tail(options, family, model_config, page_size, mtp),
        num_spec_tokens=options.num_spec_tokens,
        mtp=mtp,
        graph_buckets=tuple(batch_buckets(options.max_num_seqs)),
        mixed_graph_max_tokens=0 if distributed else options.mixed_graph_max_tokens,
        distributed=distributed,
        expert_parallel=parallel is not None and parallel.expert_parallel,
    )


def _fit_max_model_len(wanted: int, explicit: bool, page: int, pages: int) -> int:
    """``max_model_len`` checked against the cache: a sequence of that length must fit in the
    whole cache, or the configuration could never serve it.  An explicit value that does not
    fit is an error; a defaulted one is lowered to the cache's capacity (with a warning)."""
    capacity = pages * page
    if wanted <= capacity:
        return wanted
    needed = -(-wanted // page)
    fix = f"raise num_cache_pages to at least {needed} (or kv_cache_memory_gb)"
    if explicit:
        raise ConfigError(
            f"max_model_len={wanted} needs {needed} cache pages of {page} tokens, but the cache has "
            f"{pages} ({capacity} tokens); {fix} or lower max_model_len to {capacity}"
        )
    logger.warning(
        "max_model_len lowered from %d to %d: the cache has %d pages of %d tokens; %s for longer sequences",
        wanted,
        capacity,
        pages,
        page,
        fix,
    )
    return capacity


def _replay_tail(options: EngineConfig, family: ModelFamily, model_config: Any, page: int, mtp: bool) -> int:
    """Tokens recomputed before a prefix-cache hit to rebuild every layer's window: the
    family's exact bound (``ModelFamily.replay_tail``; for V4 one window per windowed layer,
    page-aligned).  ``options.replay_tail`` overrides it (rounded up to a page; a shorter tail
    gives an approximate window, as V4.1's decoder-side tail does)."""
    if options.replay_tail is not None:
        return -(-options.replay_tail // page) * page
    if mtp:  # the MTP layer's window reads the last layer's output: one more window
        return family.replay_tail(model_config, page, extra_layers=1)
    return family.replay_tail(model_config, page)
