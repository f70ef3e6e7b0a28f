"""The model runner: loads a checkpoint, owns the model and its cache, runs steps.

The architecture is the :class:`~deepinfer_core.models.registry.ModelFamily` of the
checkpoint's ``model_type``, registered by a plugin; the runner uses only that interface.
``execute(chunks)`` sends the scheduler's chunks to the device as O(batch) scalars and
block-table deltas (:mod:`~deepinfer_core.contract.step_inputs`), lets the model derive its
per-token plans there (``Model.step_metadata``), runs the model and returns the logits of the
rows that sample.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.contract.step_inputs import StepInputBuffers, StepInputs
from deepinfer_core.devices import synchronize
from deepinfer_core.distributed.eplb import initial_placement
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.cache_spec import CacheSpec, HybridCache, PagedSpec, PageStateSpec
from deepinfer_core.models.registry import ModelFamily, resolve_family
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.expert_parallel import fixed_dispatch_rows
from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.sampling.sampler import tensor_to_device

from .graphs import DeviceGraph, GraphFactory, device_graph_factory
from .kv_cache import KVCacheManager
from .resolved import LoadPlan, ResolvedConfig, read_through, resolve_config, resolve_load

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig, EPLBConfig
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


class ModelRunner:
    """Runs forward steps of a loaded model over a paged hybrid KV cache.

    Built by :meth:`load` (the engine's builder, tests): the weights loaded, the configuration
    resolved against the model (:func:`~deepinfer_core.engine.resolved.resolve_config`), then
    this constructor allocates the cache and the step buffers.

    Args:
        model: the family's built model.
        config: the resolved configuration (dtype, device, page size, ``max_model_len``, cache
            pages, replay tail, graph buckets...): read, never written.
        ops: the resolved op table.
        family, model_config: the model family and its parsed config.
        cache_specs: the model's cache specs (``Model.cache_specs``), as resolved against.
        parallel: this process's place in a distributed run (``None`` = a single process).

    With the draft layers loaded (``config.mtp``: the ``mtp`` drafter) every step's hidden
    states are kept in :attr:`hidden` for it (:meth:`execute_mtp`).  For a family whose draft
    layers are DSpark's (``mtp_kind == "dspark"``) the model writes the drafter's context itself
    (no hidden states kept) and :meth:`execute_dspark` runs its block.
    """

    def __init__(
        self,
        model: Any,
        config: ResolvedConfig,
        ops: OpTable,
        *,
        family: ModelFamily,
        model_config: Any,
        cache_specs: list[list[CacheSpec]],
        parallel: ParallelState | None = None,
    ):
        self.config = config
        self.family: ModelFamily = family
        self.model_config = model_config
        self.model = model
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.ops = ops
        self.batch_invariant = config.batch_invariant
        self._tile_matmul = ops["tile_matmul"]  # the GEMM of batch-invariant mode (ops/modes.py)
        self.parallel = parallel
        if config.context_parallel_min_tokens is not None:  # else the model's default (environment)
            self.model.cp_min_tokens = config.context_parallel_min_tokens
        specs = cache_specs
        num_pages, page_size = config.num_cache_pages, config.page_size
        self.kv_cache = KVCacheManager(
            num_pages, page_size, config.max_num_seqs, enable_prefix_caching=config.enable_prefix_caching
        )
        self.cache = HybridCache(specs, num_pages, page_size, config.max_num_seqs, self.dtype, self.device)
        self.inputs = StepInputBuffers(
            max_tokens=config.max_num_batched_tokens + config.max_num_seqs,
            max_reqs=config.max_num_seqs + 1,
            num_slots=config.max_num_seqs,
            max_pages=max(-(-config.max_model_len // page_size), 1) + 1,
            trash_page=self.cache.trash_page,
            device=self.device,
        )
        # previous step's sampled tokens, copied here for graph replays (a fixed address)
        self.prev_buf = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        # with the MTP layer: every row's hidden state of the latest step (a fixed address, so
        # the graphs write it too), in the step's row order (chunks in order, padding last)
        self.hidden: torch.Tensor | None = None
        # whether the MTP layer writes paged state (a compressed MTP layer): its draft rows must
        # then stay within a request's allocated pages
        self.mtp_paged = self.mtp and any(isinstance(s, PagedSpec | PageStateSpec) for s in specs[-1])
        self._mtp_in: torch.Tensor | None = None  # MTP graphs' input hidden states (fixed address)
        # the hidden rows of the latest steps, copied out of :attr:`hidden` after each (two turns:
        # with async scheduling a step's rows are read after the next step has overwritten it)
        self._hidden_kept: list[torch.Tensor] = []
        self.last_hidden: torch.Tensor | None = None
        """The latest step's hidden rows (a view valid until the step after the next one)."""
        if self.mtp and getattr(self.model, "keeps_hidden", True):
            shape = (self.inputs.max_tokens, *self.model.hidden_shape)
            self.hidden = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._hidden_kept = [torch.zeros_like(self.hidden) for _ in range(2)]
            self._mtp_in = torch.zeros(
                (config.max_num_seqs, *self.model.hidden_shape), dtype=self.dtype, device=self.device
            )
        self.graphs: dict[int, DeviceGraph] = {}  # decode graphs by batch bucket
        self.verify_graphs: dict[int, DeviceGraph] = {}  # (1 + num_spec_tokens)-token verify steps
        self.mtp_graphs: dict[int, DeviceGraph] = {}  # MTP-layer steps of one row per request
        self.dspark_graphs: dict[int, DeviceGraph] = {}  # DSpark block steps by batch bucket
        # mixed steps (prefill chunks beside decodes) by token bucket (config.mixed_graph_max_tokens)
        self.mixed_graphs: dict[int, DeviceGraph] = {}
        # expert parallelism: decode graphs run the fixed-shape dispatch, their bucket agreed per step
        self._ep_graphs = config.expert_parallel
        self.ep_graph_stats = {"replayed": 0, "padded_to_peer": 0, "dummy": 0, "eager": 0}
        """Expert parallelism with graphs: steps whose agreed bucket was replayed (``replayed``;
        ``padded_to_peer`` of them to a larger bucket than this rank needed, ``dummy`` of them
        on padding rows only) and steps agreed to run eagerly (``eager``)."""
        logger.info(
            "KV cache (%s): %d pages x %d tokens = %d token capacity (%.1f MiB paged, %.1f MiB per-seq "
            "state)",
            "packed: the model's fp8 / fp4 formats" if config.kv_cache_dtype == "fp8" else "model dtype",
            num_pages,
            page_size,
            num_pages * page_size,
            num_pages * config.page_bytes / 2**20,
            config.max_num_seqs * config.slot_bytes / 2**20,
        )

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        options: EngineConfig,
        ops: OpTable,
        load: LoadPlan | None = None,
        *,
        family: ModelFamily | None = None,
        model_config: Any = None,
        plugins: Any = None,
        mtp: bool = False,
        parallel: ParallelState | None = None,
    ) -> ModelRunner:
        """Load ``model_dir`` and build its runner: the weights as ``load`` says (``None``:
        :func:`~deepinfer_core.engine.resolved.resolve_load` without a backend), the
        configuration resolved against the model
        (:func:`~deepinfer_core.engine.resolved.resolve_config`), the cache allocated.

        Args:
            options: the user's options.
            family, model_config: the model family and its parsed config; ``None`` = resolved
                from ``config.json``'s ``model_type`` through ``plugins`` (default: the
                process-wide manager).
            mtp: also load and run the checkpoint's draft layers (the ``mtp`` / ``dspark``
                drafters).
            parallel: this process's place in a distributed run (``None`` = a single process).
        """
        if family is None:
            family, model_config = resolve_family(model_dir, plugins)
        elif model_config is None:
            model_config = family.from_file(model_dir)
        if load is None:
            load = resolve_load(options, None, family=family, model_config=model_config)
        model = load_model(
            model_dir, family, model_config, ops, load, mtp=mtp, parallel=parallel, eplb=options.eplb
        )
        # the most draft tokens of a verify step: the per-slot caches keep room for them, so a
        # rejected draft is rolled back by position alone (Model.cache_specs / step_metadata)
        specs = model.cache_specs(options.kv_cache_dtype, num_spec_tokens=options.num_spec_tokens)
        config = resolve_config(
            options,
            load,
            model_dir=model_dir,
            family=family,
            model_config=model_config,
            cache_specs=specs,
            parallel=parallel,
            mtp=mtp,
        )
        return cls(
            model, config, ops, family=family, model_config=model_config, cache_specs=specs, parallel=parallel
        )

    # ---- the resolved values the runner reads (read-only: the configuration is frozen) ----------
    page_size = read_through("config", "page_size", "Token positions per cache page.")
    max_model_len = read_through("config", "max_model_len", "The longest sequence (graph entry-list bounds).")
    num_spec_tokens = read_through("config", "num_spec_tokens", "The most draft tokens of a verify step.")
    replay_tail = read_through("config", "replay_tail", "Tokens recomputed before a prefix-cache hit.")
    mtp = read_through("config", "mtp", "Whether the draft layers are loaded.")
    kv_cache_dtype = read_through("config", "kv_cache_dtype", "``auto`` or ``fp8``.")
    mixed_graph_max_tokens = read_through("config", "mixed_graph_max_tokens", "The largest mixed-step graph.")

    @property
    def capacity_tokens(self) -> int:
        """Token positions the paged cache can hold."""
        return self.kv_cache.num_pages * self.page_size

    def execute(self, chunks: list[SeqChunk], prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; float32 logits of every sampling row, in chunk order.

        A chunk contributes its last row when ``sample`` is set, or all its rows when
        ``all_logits`` is set.  ``prev_tokens`` (async scheduling) are the previous step's
        sampled tokens, still on the device: chunks with ``prev_row >= 0`` take their token
        from it, so no host round trip separates two steps.  With the hidden states kept (the
        ``mtp`` drafter), the step's rows are copied to :attr:`last_hidden` (on the device, in
        stream order: no sync).
        """
        logits = self._execute(chunks, prev_tokens)
        if self._hidden_kept:
            n = sum(c.num_tokens for c in chunks)
            kept = self._hidden_kept[0]
            kept[:n].copy_(self.hidden[:n])
            self._hidden_kept.reverse()
            self.last_hidden = kept[:n]
        return logits

    def _execute(self, chunks: list[SeqChunk], prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """:meth:`execute` but for keeping the hidden rows."""
        for c in chunks:
            if len(c.block_table) * self.page_size < c.end_pos:
                raise ValueError(
                    f"slot {c.seq_slot}: block table of {len(c.block_table)} pages cannot hold "
                    f"{c.end_pos} positions (page_size {self.page_size})"
                )
        if prev_tokens is None and any(c.prev_row >= 0 for c in chunks):
            raise ValueError("chunks refer to the previous step's tokens but none were given")
        verify = self._verify_bucket(chunks)
        if verify is not None:
            t = verify * (1 + self.num_spec_tokens)
            rows = sample_rows(chunks)
            rows += [t - 1] * (t - len(rows))  # fixed shape: padding rows after the real ones
            self.inputs.prepare(chunks, rows, None, t, verify + 1, self.max_model_len)
            return self.verify_graphs[verify].replay()[: sum(c.num_logit_rows for c in chunks)]
        bucket = self._graph_bucket(chunks)
        if self._ep_graphs and self.graphs:  # every EP rank replays the same bucket, or none does
            bucket = self._agree_bucket(bucket)
        if bucket is not None:
            if prev_tokens is not None:
                self.prev_buf[: prev_tokens.shape[0]].copy_(prev_tokens)
            self.inputs.prepare(
                chunks, list(range(bucket)), self.prev_buf, bucket, bucket + 1, self.max_model_len
            )
            return self.graphs[bucket].replay()[: len(chunks)]
        rows = sample_rows(chunks)
        mixed = self._mixed_bucket(chunks, len(rows))
        if mixed is not None:  # fixed shape: padding rows after the real ones
            if prev_tokens is not None:
                self.prev_buf[: prev_tokens.shape[0]].copy_(prev_tokens)
            n = self._mixed_rows(mixed)
            self.inputs.prepare(
                chunks, rows + [mixed - 1] * (n - len(rows)), self.prev_buf, mixed, self.inputs.max_reqs,
                self.max_model_len,
            )  # fmt: skip
            return self.mixed_graphs[mixed].replay()[: len(rows)]
        inputs = self.inputs.prepare(chunks, rows, prev_tokens)
        return self._forward(inputs)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Derive the step's plans on the device and run the model: the work a graph records."""
        md = self._metadata(self.model.step_metadata, inputs)
        with batch_invariant_mode(self.batch_invariant, matmul=self._tile_matmul):
            if self.hidden is not None:
                return self.model.forward(md, self.cache, hidden_out=self.hidden)
            return self.model.forward(md, self.cache)

    def _metadata(self, build: Any, inputs: StepInputs) -> Any:
        """The step's per-token plans from ``build`` (the model's ``step_metadata`` or
        ``mtp_step_metadata``) with the runner's cache geometry."""
        return build(
            inputs,
            self.page_size,
            self.kv_cache.num_slots,
            self.cache.trash_page,
            num_spec_tokens=self.num_spec_tokens,
        )

    def execute_mtp(
        self, chunks: list[SeqChunk], hidden: torch.Tensor, logit_rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One eager step of the multi-token-prediction layer (runner built with ``mtp=True``).

        ``chunks`` describe its rows as a target step's do (slot, positions, block table,
        ``window_from`` / ``cached_until``), with ``token_ids`` the token *after* each row's
        position (the MTP embeds the next token); ``hidden`` ``[T, *hidden_shape]`` is each
        row's input hidden state (the target's at that position, from :attr:`hidden`, or the
        MTP's own output one position earlier when drafting recursively).  The rows write the
        MTP layer's caches at their positions, rolled back by position like the target's.
        Returns float32 logits of ``logit_rows`` and every row's output hidden state.
        """
        if self.hidden is None:
            raise RuntimeError("execute_mtp needs a runner built with mtp=True")
        bucket = self._mtp_bucket(chunks)
        if bucket is not None:  # one row per request: replay the bucket's graph on padded rows
            assert self._mtp_in is not None
            n = len(chunks)
            self._mtp_in[:n].copy_(hidden)
            self.inputs.prepare(chunks, list(range(bucket)), None, bucket, bucket + 1, self.max_model_len)
            logits, streams = self.mtp_graphs[bucket].replay()
            index = tensor_to_device(torch.tensor(logit_rows, dtype=torch.int64), self.device)  # no sync
            return logits.index_select(0, index), streams[:n].clone()
        inputs = self.inputs.prepare(chunks, logit_rows, None)
        return self._mtp_forward(inputs, hidden)

    def _mtp_forward(self, inputs: StepInputs, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Derive an MTP step's plans on the device and run the MTP layer (what an MTP graph
        records)."""
        md = self._metadata(self.model.mtp_step_metadata, inputs)
        with batch_invariant_mode(self.batch_invariant, matmul=self._tile_matmul):
            return self.model.mtp_forward(md, self.cache, hidden)

    def execute_dspark(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """One DSpark block step (runner built with ``mtp=True`` over a model with the
        DSpark drafter, ``family.mtp_kind == "dspark"``): each chunk is one request's block,
        ``token_ids`` = the anchor then noise tokens, ``start_pos`` = the anchor's position,
        ``seq_slot`` / ``window_from`` the request's (no pages are read: ``block_table`` may be
        empty).  Returns every row's float32 base logits ``[T, V]`` and collapsed hidden
        ``[T, D]`` (``Model.dspark_forward``); no request's cache is written.  A step of whole
        blocks replays the smallest captured DSpark graph holding its requests
        (:attr:`dspark_graphs`), else runs eagerly."""
        n = sum(c.num_tokens for c in chunks)
        gamma = self.model.dspark.block_size
        bucket = smallest_bucket(self.dspark_graphs, len(chunks))
        if bucket is not None and all(c.num_tokens == gamma for c in chunks):  # padded to the bucket
            t = bucket * gamma
            self.inputs.prepare(
                chunks, list(range(t)), None, t, bucket + 1, self.max_model_len, block_tables=False
            )
            logits, hidden = self.dspark_graphs[bucket].replay()
            return logits[:n], hidden[:n]
        return self._dspark_forward(self.inputs.prepare(chunks, list(range(n)), None, block_tables=False))

    def _dspark_forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Derive a DSpark block step's plans on the device and run the block (what a DSpark
        graph records)."""
        md = self._metadata(self.model.dspark_step_metadata, inputs)
        with batch_invariant_mode(self.batch_invariant, matmul=self._tile_matmul):
            return self.model.dspark_forward(md, self.cache)

    def _capture_dspark_graphs(
        self, factory: GraphFactory, pool: object | None, buckets: list[int]
    ) -> str | None:
        """One graph per bucket of DSpark block steps (``dspark_block_size`` rows per request,
        padded to the bucket on the trash slot; into :attr:`dspark_graphs`, all or none);
        ``None``, or why a capture failed."""
        gamma = self.model.dspark.block_size

        def make(b: int) -> Callable[[], Any]:
            t = b * gamma
            inputs = self.inputs.prepare(
                [], list(range(t)), None, t, b + 1, self.max_model_len, block_tables=False
            )
            return functools.partial(self._dspark_forward, inputs)

        sizes = [b for b in buckets if b * gamma <= self.inputs.max_tokens]
        graphs, error = self._capture_each(factory, pool, sizes, make, "batch-{} DSpark")
        if error is None:
            self.dspark_graphs = graphs
        return error

    def _mtp_bucket(self, chunks: list[SeqChunk]) -> int | None:
        """The bucket whose MTP graph runs these rows, or ``None`` (eager): MTP graphs run steps
        of exactly one row per request (a draft depth, or the catch-up after a step that kept
        one position per request)."""
        bucket = smallest_bucket(self.mtp_graphs, len(chunks))
        if bucket is None or any(c.num_tokens != 1 for c in chunks):
            return None
        return bucket

    def execute_dummy(self) -> None:
        """One forward of a single padding row on the trash slot (no request's cache is
        touched, the logits are dropped): the step of an expert-parallel rank with nothing
        scheduled, so that every rank runs the same number of forwards and the MoE's
        dispatch / combine collectives line up.  With decode graphs under expert parallelism
        it takes part in the step's bucket agreement (:meth:`_agree_bucket`) and replays the
        agreed bucket's graph on padding rows when the others replay one."""
        if self._ep_graphs and self.graphs:
            bucket = self._agree_bucket(min(self.graphs))
            if bucket is not None:
                self.inputs.prepare(
                    [], list(range(bucket)), self.prev_buf, bucket, bucket + 1, self.max_model_len
                )
                self.graphs[bucket].replay()
                self.ep_graph_stats["dummy"] += 1
                return
        inputs = self.inputs.prepare([], [0], None, 1, 1)
        self._forward(inputs)

    def _agree_bucket(self, want: int | None) -> int | None:
        """The decode-graph bucket every expert-parallel rank replays this step: the largest
        bucket any rank needs (``want``: this rank's, ``None`` = its step must run eagerly), or
        ``None`` when some rank runs eagerly (then every rank runs eagerly, with the dynamic
        dispatch).  One all-reduce MAX of one integer over the gloo ``cpu_group``: the graphs'
        fixed-shape dispatch needs the same capacity (``bucket * k`` rows) on every rank."""
        assert self.parallel is not None
        eager = max(self.graphs) + 1
        t = torch.tensor([eager if want is None else want], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.parallel.cpu_group)
        agreed = int(t.item())
        if agreed == eager:
            self.ep_graph_stats["eager"] += 1
            return None
        self.ep_graph_stats["replayed"] += 1
        if want is not None and agreed > want:
            self.ep_graph_stats["padded_to_peer"] += 1
        return agreed

    def warm_up(self) -> list[int]:
        """Eager forwards on padding rows of the trash slot (no request's cache is touched, the
        logits are dropped) of one token, a full decode batch and a full step of tokens, so that
        kernels compiled at their first call for each static configuration are compiled before
        the first request.  Returns the token counts run."""
        counts = sorted({1, min(self.config.max_num_seqs, self.inputs.max_tokens), self.inputs.max_tokens})
        for t in counts:
            self._forward(self.inputs.prepare([], list(range(t)), None, t, 1))
        self._sync()
        return counts

    def time_step(self, batch: int, tokens_per_request: int, repeats: int = 5) -> float:
        """Seconds of one step of ``batch`` requests x ``tokens_per_request`` tokens, every
        row's logits returned (a verify step's shape), measured on padding rows of the trash
        slot (no request's cache is touched): the fastest of ``repeats`` runs after a warm-up
        (the least disturbed by other work on the machine).
        Speculative decoding's DSpark policy weighs drafts against these costs."""
        t = batch * tokens_per_request
        graphs = self.graphs if tokens_per_request == 1 else self.verify_graphs
        bucket = smallest_bucket(graphs, batch)
        if bucket is not None and tokens_per_request > 1 + self.num_spec_tokens:
            bucket = None
        times = []
        for i in range(repeats + 1):
            if bucket is not None:  # the graph this step would replay (padded to its shape)
                n = bucket * (1 if tokens_per_request == 1 else 1 + self.num_spec_tokens)
                prev = self.prev_buf if tokens_per_request == 1 else None
                self.inputs.prepare([], list(range(n)), prev, n, bucket + 1, self.max_model_len)
                run = graphs[bucket].replay
            else:
                inputs = self.inputs.prepare([], list(range(t)), None, t, 1)
                run = functools.partial(self._forward, inputs)
            self._sync()
            t0 = time.perf_counter()
            run()
            self._sync()
            if i:
                times.append(time.perf_counter() - t0)
        return min(times)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- device graphs -----------------------------------------------------------------------
    def release_graphs(self) -> None:
        """Drop every captured graph (decode, verify, MTP, DSpark, mixed) and wait for the
        device; the runner runs eagerly afterwards.  A distributed run calls it before leaving
        its process group: NCCL does not destroy a communicator that live CUDA graphs captured
        collectives of (the teardown hangs, pytorch/pytorch#115388)."""
        self.graphs, self.verify_graphs, self.mtp_graphs = {}, {}, {}
        self.dspark_graphs, self.mixed_graphs = {}, {}
        gc.collect()  # the graphs' destructors run now, not at some later collection
        synchronize(self.device)

    def capture_graphs(self, factory: GraphFactory | None = None, pool: object | None = None) -> str | None:
        """Capture one decode graph per batch bucket (:mod:`~deepinfer_core.engine.graphs`).

        Args:
            factory: the graph implementation; ``None`` = the device's own (CUDA graphs).
            pool: the memory pool the graphs share (``None`` with an explicit factory).

        Returns:
            ``None`` when the graphs are captured, else why not (the runner stays eager).
        """
        if factory is None:
            factory, pool, reason = device_graph_factory(self.device)
            if factory is None:
                return reason
        buckets = list(self.config.graph_buckets)
        graphs: dict[int, DeviceGraph] = {}
        verify: dict[int, DeviceGraph] = {}
        t = 1 + self.num_spec_tokens  # tokens per request of a verify step
        plans = [(b, 1, graphs) for b in buckets]
        # verify graphs under expert parallelism: not captured (their steps run eagerly, agreed)
        if self.num_spec_tokens and not self._ep_graphs:
            plans += [(b, t, verify) for b in buckets if b * t <= self.inputs.max_tokens]
        # largest first: the others reuse its pool
        for b, tokens, into in sorted(plans, key=lambda p: -p[0] * p[1]):
            n = b * tokens
            prev = self.prev_buf if tokens == 1 else None
            inputs = self.inputs.prepare([], list(range(n)), prev, n, b + 1, self.max_model_len)

            # under expert parallelism: the fixed-shape dispatch, n rows a rank (every rank
            # replays the same bucket, _agree_bucket), so nothing reads a count on the host
            rows = n if self._ep_graphs else None

            def step(inputs: StepInputs = inputs, rows: int | None = rows) -> torch.Tensor:
                with fixed_dispatch_rows(rows):
                    return self._forward(inputs)

            error = None
            try:
                into[b] = self._capture(factory, pool, step)
            except Exception as e:  # an op that cannot be captured: run eagerly, and say so
                error = f"{type(e).__name__}: {e}"
            if self._ep_graphs:  # every EP rank keeps its graphs, or none does (their collectives)
                error = self._agree_captured(error)
            if error is not None:
                what = "decode" if tokens == 1 else f"{tokens}-token verify"
                return f"capturing the batch-{b} {what} graph failed ({error})"
        if self._mtp_in is not None and not self._ep_graphs:
            error = self._capture_mtp_graphs(factory, pool, buckets)
            if error is not None:
                return error
        if self.mtp and getattr(self.model, "dspark", None) is not None and not self._ep_graphs:
            error = self._capture_dspark_graphs(factory, pool, buckets)
            if error is not None:  # the block steps stay eager; the target's graphs are kept
                logger.warning("DSpark block graphs off: %s", error)
        self.graphs, self.verify_graphs = graphs, verify
        if self.mixed_graph_max_tokens and not self._ep_graphs:
            self._capture_mixed_graphs(factory, pool)
        return None

    def _capture_mtp_graphs(
        self, factory: GraphFactory, pool: object | None, buckets: list[int]
    ) -> str | None:
        """One graph per bucket of the MTP layer's one-row-per-request steps (into
        :attr:`mtp_graphs`; the rows' input hidden states are copied into a fixed buffer
        first); ``None``, or why a capture failed."""
        assert self._mtp_in is not None
        if self._mtp_in.shape[0] < max(buckets):
            self._mtp_in = self._mtp_in.new_zeros((max(buckets), *self._mtp_in.shape[1:]))

        def make(b: int) -> Callable[[], Any]:
            inputs = self.inputs.prepare([], list(range(b)), None, b, b + 1, self.max_model_len)

            def step() -> Any:
                assert self._mtp_in is not None
                return self._mtp_forward(inputs, self._mtp_in[:b])

            return step

        graphs, error = self._capture_each(factory, pool, buckets, make, "batch-{} MTP")
        if error is None:
            self.mtp_graphs = graphs
        return error

    def _capture_each(
        self,
        factory: GraphFactory,
        pool: object | None,
        sizes: list[int],
        make: Callable[[int], Callable[[], Any]],
        what: str,
    ) -> tuple[dict[int, DeviceGraph], str | None]:
        """Capture ``make(size)`` (which prepares the step's inputs and returns the step) for
        each of ``sizes``, largest first (the others reuse its memory pool): the graphs by size,
        and ``None`` or why a capture failed (``what.format(size)`` names the graph; the graphs
        captured until then are returned too, for the caller to drop)."""
        graphs: dict[int, DeviceGraph] = {}
        for size in sorted(sizes, reverse=True):
            step = make(size)
            try:
                graphs[size] = self._capture(factory, pool, step)
            except Exception as e:  # an op that cannot be captured at this shape
                return graphs, f"capturing the {what.format(size)} graph failed ({type(e).__name__}: {e})"
        return graphs, None

    def _agree_captured(self, error: str | None) -> str | None:
        """Under expert parallelism, after each graph's capture: ``error``, or when this rank
        captured but another did not, a text saying so (an all-reduce MIN over ``cpu_group``)."""
        assert self.parallel is not None
        t = torch.tensor([0 if error is not None else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.parallel.cpu_group)
        if error is None and not t.item():
            return "another expert-parallel rank failed to capture it; every rank runs eagerly"
        return error

    def _capture(
        self, factory: GraphFactory, pool: object | None, step: Callable[[], torch.Tensor]
    ) -> DeviceGraph:
        """Warm ``step`` up (lazy initialisation, kernel compilation), wait for the device to
        finish it, and capture it.  (Measured on the H200: with an empty Triton cache, capturing
        right after a warm-up that compiled kernels failed with
        ``cudaErrorStreamCaptureInvalidated``; after a device synchronisation it succeeds.)"""
        step()
        self._sync()
        graph = factory(pool)
        graph.capture(step)
        return graph

    def _verify_bucket(self, chunks: list[SeqChunk]) -> int | None:
        """The bucket whose verify graph runs this step, or ``None``: verify graphs run steps
        where every request decodes one token plus at most ``num_spec_tokens`` drafts (and
        some have drafts)."""
        bucket = smallest_bucket(self.verify_graphs, len(chunks))
        if bucket is None or not any(c.num_draft for c in chunks):
            return None
        if any(
            c.num_tokens - c.num_draft != 1 or not c.sample or c.all_logits or c.prev_row >= 0 for c in chunks
        ):
            return None
        return bucket

    def _mixed_rows(self, tokens: int) -> int:
        """Logit rows of the mixed graph of ``tokens`` tokens: a verified row per draft and one
        per request, at most one per token."""
        return min(tokens, (self.inputs.max_reqs - 1) * (1 + self.num_spec_tokens))

    def _mixed_bucket(self, chunks: list[SeqChunk], num_rows: int) -> int | None:
        """The token bucket whose mixed graph runs this step, or ``None`` (eager): mixed
        graphs run steps of at most their tokens and ``max_num_seqs`` requests whose chunks
        want no prompt logprobs (``all_logits``)."""
        if not self.mixed_graphs or any(c.all_logits for c in chunks):
            return None
        bucket = smallest_bucket(self.mixed_graphs, sum(c.num_tokens for c in chunks))
        if bucket is None or num_rows > self._mixed_rows(bucket):
            return None
        return bucket

    def _capture_mixed_graphs(self, factory: GraphFactory, pool: object | None) -> None:
        """One graph per token bucket (64, 128, ... below ``mixed_graph_max_tokens`` or the step
        budget, and that bound itself) of steps mixing prefill chunks and decodes, padded to
        every sequence slot (:attr:`mixed_graphs`).  A capture that fails leaves these graphs
        out (logged): such steps run eagerly, the decode and verify graphs are unaffected."""
        cap = min(self.mixed_graph_max_tokens, self.inputs.max_tokens)
        buckets = [t for t in (2**i for i in range(6, 31)) if t < cap] + [cap]

        def make(t: int) -> Callable[[], Any]:
            rows = list(range(self._mixed_rows(t)))
            inputs = self.inputs.prepare([], rows, self.prev_buf, t, self.inputs.max_reqs, self.max_model_len)
            return functools.partial(self._forward, inputs)

        graphs, error = self._capture_each(factory, pool, buckets, make, "{}-token mixed-step")
        if error is not None:
            logger.warning("mixed-step graphs off: %s", error)
            return
        self.mixed_graphs = graphs
        logger.info("mixed-step graphs captured for %s tokens", ", ".join(map(str, sorted(graphs))))

    def _graph_bucket(self, chunks: list[SeqChunk]) -> int | None:
        """The bucket whose graph runs this step, or ``None`` (eager): graphs run steps where
        every request decodes one token and wants only its logits."""
        bucket = smallest_bucket(self.graphs, len(chunks))
        if bucket is None or any(c.num_tokens != 1 or not c.sample or c.all_logits for c in chunks):
            return None
        return bucket


def smallest_bucket(graphs: dict[int, DeviceGraph], n: int) -> int | None:
    """The smallest captured batch bucket holding ``n`` requests, or ``None`` (none does)."""
    return min((b for b in graphs if b >= n), default=None)


def _size(nbytes: int) -> str:
    """A byte count for the log: GiB from 1 GiB up, MiB below."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def sample_rows(chunks: list[SeqChunk]) -> list[int]:
    """Token rows whose logits a step returns: every row of ``all_logits`` chunks, the last
    ``1 + num_draft`` rows (the verified positions) of the other sampling chunks, in chunk
    order."""
    rows: list[int] = []
    end = 0
    for c in chunks:
        end += len(c.token_ids)
        n = c.num_logit_rows
        if n == 1:  # a decode or a prompt's last chunk
            rows.append(end - 1)
        elif n:
            rows.extend(range(end - n, end))
    return rows
