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
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.contract.batch import SeqChunk, sample_rows
from deepinfer_core.contract.step_inputs import StepInputBuffers, StepInputs
from deepinfer_core.devices import synchronize
from deepinfer_core.models.cache_spec import CacheSpec, HybridCache, with_kv_formats
from deepinfer_core.models.registry import ModelFamily, resolve_family
from deepinfer_core.ops import OpTable
from deepinfer_core.ops.expert_parallel import fixed_dispatch_rows
from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.speculative.draft_model import DraftModel

from .graph_manager import GraphManager, GraphPlan
from .graphs import GraphFactory
from .kv_cache import KVCacheManager
from .model_loading import load_model
from .resolved import LoadPlan, ResolvedConfig, read_through, resolve_config, resolve_load

if TYPE_CHECKING:
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.contract.parallel import ParallelState

logger = logging.getLogger("deepinfer.engine")


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
        draft_model: the speculative drafter's layers
            (:class:`~deepinfer_core.speculative.draft_model.DraftModel`), built here as
            :attr:`draft_model` after its required model members are checked; with
            ``taps_hidden`` every step's hidden states are kept in :attr:`hidden` for it.

    Every device graph (decode, verify, mixed, and the draft model's families) lives in
    :attr:`graph_manager`.
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
        draft_model: type[DraftModel] | None = None,
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
        specs = self.cache_specs = cache_specs
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
        # with a draft model that taps them: every row's hidden state of the latest step (a fixed
        # address, so the graphs write it too), in the step's row order (chunks in order, padding last)
        self.hidden: torch.Tensor | None = None
        # the hidden rows of the latest steps, copied out of :attr:`hidden` after each (two turns:
        # with async scheduling a step's rows are read after the next step has overwritten it)
        self._hidden_kept: list[torch.Tensor] = []
        self.last_hidden: torch.Tensor | None = None
        """The latest step's hidden rows (a view valid until the step after the next one)."""
        if draft_model is not None:
            drafter = config.speculative.drafter if config.speculative is not None else "?"
            draft_model.check_model(self.model, drafter)
        if draft_model is not None and draft_model.taps_hidden:
            shape = (self.inputs.max_tokens, *self.model.hidden_shape)
            self.hidden = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._hidden_kept = [torch.zeros_like(self.hidden) for _ in range(2)]
        # expert parallelism: decode graphs run the fixed-shape dispatch, their bucket agreed per step
        self._ep_graphs = config.expert_parallel
        self.graph_manager = GraphManager(
            self.device, parallel.cpu_group if parallel is not None and self._ep_graphs else None
        )
        """Every captured graph, by family (``decode``, ``verify``, ``mixed``, the draft
        model's) and bucket."""
        self.ep_graph_stats = self.graph_manager.ep_stats
        self.draft_model: DraftModel | None = draft_model(self) if draft_model is not None else None
        """The speculative drafter's layers (``None`` without)."""
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
        draft_model: type[DraftModel] | None = None,
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
            mtp: also load the checkpoint's draft layers (``ModelFamily.load_mtp_weights``).
            draft_model: the speculative drafter's layers (see the class).
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
        specs = with_kv_formats(specs, load.kv_formats)  # the backend's packed formats, if any
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
        kw = {"family": family, "model_config": model_config, "cache_specs": specs, "parallel": parallel}
        return cls(model, config, ops, draft_model=draft_model, **kw)

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
        page_size = self.page_size
        for c in chunks:
            if len(c.block_table) * page_size < c.end_pos:
                raise ValueError(
                    f"slot {c.seq_slot}: block table of {len(c.block_table)} pages cannot hold "
                    f"{c.end_pos} positions (page_size {page_size})"
                )
        if prev_tokens is None and any(c.prev_row >= 0 for c in chunks):
            raise ValueError("chunks refer to the previous step's tokens but none were given")
        verify = self._verify_bucket(chunks)
        if verify is not None:
            t = verify * (1 + self.num_spec_tokens)
            rows = sample_rows(chunks)
            rows += [t - 1] * (t - len(rows))  # fixed shape: padding rows after the real ones
            self._graph_inputs(chunks, rows, None, t, verify + 1)
            return self.graph_manager.replay("verify", verify)[: sum(c.num_logit_rows for c in chunks)]
        bucket = self._graph_bucket(chunks)
        if self._ep_graphs and self.graph_manager.graphs("decode"):  # every EP rank replays one bucket
            bucket = self.graph_manager.agree_bucket("decode", bucket)
        if bucket is not None:
            if prev_tokens is not None:
                self.prev_buf[: prev_tokens.shape[0]].copy_(prev_tokens)
            self._graph_inputs(chunks, list(range(bucket)), self.prev_buf, bucket, bucket + 1)
            return self.graph_manager.replay("decode", bucket)[: len(chunks)]
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
            return self.graph_manager.replay("mixed", mixed)[: len(rows)]
        inputs = self.inputs.prepare(chunks, rows, prev_tokens)
        return self.forward(inputs)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Derive the step's plans on the device and run the model over ``inputs`` (prepared in
        :attr:`inputs`): the work a graph records.  Logits of the step's sampling rows."""
        if self.hidden is not None:
            return self.run_step(self.model.step_metadata, self.model.forward, inputs, hidden_out=self.hidden)
        return self.run_step(self.model.step_metadata, self.model.forward, inputs)

    def run_step(
        self,
        metadata: Callable[..., Any],
        forward: Callable[..., Any],
        inputs: StepInputs,
        *args: Any,
        **kw: Any,
    ) -> Any:
        """``forward(md, cache, *args, **kw)`` with ``md`` the step's per-token plans from
        ``metadata`` (the model's ``step_metadata``, or a draft model's), under the engine's
        batch-invariant mode: a step of the target or of a draft model, what a graph records."""
        md = self._metadata(metadata, inputs)
        with batch_invariant_mode(self.batch_invariant, matmul=self._tile_matmul):
            return forward(md, self.cache, *args, **kw)

    def _metadata(self, build: Callable[..., Any], inputs: StepInputs) -> Any:
        """The step's per-token plans from ``build`` with the runner's cache geometry."""
        kv, cache = self.kv_cache, self.cache
        return build(
            inputs, self.page_size, kv.num_slots, cache.trash_page, num_spec_tokens=self.num_spec_tokens
        )

    def execute_dummy(self) -> None:
        """One forward of a single padding row on the trash slot (no request's cache is
        touched, the logits are dropped): the step of an expert-parallel rank with nothing
        scheduled, so that every rank runs the same number of forwards and the MoE's
        dispatch / combine collectives line up.  With decode graphs under expert parallelism
        it takes part in the step's bucket agreement (``GraphManager.agree_bucket``) and replays the
        agreed bucket's graph on padding rows when the others replay one."""
        decode = self.graph_manager.graphs("decode")
        if self._ep_graphs and decode:
            bucket = self.graph_manager.agree_bucket("decode", min(decode))
            if bucket is not None:
                self._graph_inputs([], list(range(bucket)), self.prev_buf, bucket, bucket + 1)
                self.graph_manager.replay("decode", bucket)
                self.ep_graph_stats["dummy"] += 1
                return
        inputs = self.inputs.prepare([], [0], None, 1, 1)
        self.forward(inputs)

    def warm_up(self) -> list[int]:
        """Eager forwards on padding rows of the trash slot (no request's cache is touched, the
        logits are dropped) of one token, a full decode batch and a full step of tokens, so that
        kernels compiled at their first call for each static configuration are compiled before
        the first request.  Returns the token counts run."""
        counts = sorted({1, min(self.config.max_num_seqs, self.inputs.max_tokens), self.inputs.max_tokens})
        for t in counts:
            self.forward(self.inputs.prepare([], list(range(t)), None, t, 1))
        synchronize(self.device)
        return counts

    # ---- device graphs -----------------------------------------------------------------------
    def release_graphs(self) -> None:
        """Drop every captured graph (every family) and wait for the device; the runner runs
        eagerly afterwards.  A distributed run calls it before leaving its process group: NCCL
        does not destroy a communicator that live CUDA graphs captured collectives of (the
        teardown hangs, pytorch/pytorch#115388)."""
        self.graph_manager.release()

    def capture_graphs(self, factory: GraphFactory | None = None, pool: object | None = None) -> str | None:
        """Capture the graph families (:mod:`~deepinfer_core.engine.graph_manager`): ``decode``
        and ``verify`` per batch bucket, the draft model's, ``mixed`` per token bucket.

        Args:
            factory: the graph implementation; ``None`` = the device's own (CUDA graphs).
            pool: the memory pool the graphs share (``None`` with an explicit factory).

        Returns:
            ``None`` when the graphs are captured, else why not (the runner stays eager).
        """
        reason = self.graph_manager.start(factory, pool)
        if reason is not None:
            return reason
        buckets = list(self.config.graph_buckets)
        t = 1 + self.num_spec_tokens  # tokens per request of a verify step
        plans = [self._plan("decode", b, 1) for b in buckets]
        # verify graphs under expert parallelism: not captured (their steps run eagerly, agreed)
        if self.num_spec_tokens and not self._ep_graphs:
            plans += [self._plan("verify", b, t) for b in buckets if b * t <= self.inputs.max_tokens]
        error = self.graph_manager.capture(plans, agree=self._ep_graphs)
        if error is None and self.draft_model is not None and not self._ep_graphs:
            error = self.draft_model.capture_graphs(self.graph_manager, buckets)
        if error is not None:
            self.graph_manager.release()
            return error
        if self.mixed_graph_max_tokens and not self._ep_graphs:
            self._capture_mixed_graphs()
        return None

    def _plan(self, family: str, b: int, tokens: int) -> GraphPlan:
        """The graph of a step of ``b`` requests x ``tokens`` tokens (decode: 1, verify)."""
        n = b * tokens

        def make() -> Callable[[], torch.Tensor]:
            prev = self.prev_buf if tokens == 1 else None
            inputs = self._graph_inputs([], list(range(n)), prev, n, b + 1)
            # under expert parallelism: the fixed-shape dispatch, n rows a rank (every rank
            # replays the same bucket, GraphManager.agree_bucket), so nothing reads a count on the host
            rows = n if self._ep_graphs else None

            def step() -> torch.Tensor:
                with fixed_dispatch_rows(rows):
                    return self.forward(inputs)

            return step

        return GraphPlan(
            family, b, n, make, f"batch-{b} " + ("decode" if tokens == 1 else f"{tokens}-token verify")
        )

    def _graph_inputs(self, chunks: list[SeqChunk], rows: list[int], prev, t: int, reqs: int) -> StepInputs:
        """A decode / verify graph's fixed-shape inputs, ``decoding`` (no prefix-hit restores:
        the buckets take no chunk starting below its cached boundary)."""
        return self.inputs.prepare(chunks, rows, prev, t, reqs, self.max_model_len, decoding=True)

    def _verify_bucket(self, chunks: list[SeqChunk]) -> int | None:
        """The bucket whose verify graph runs this step, or ``None``: verify graphs run steps
        where every request decodes one token plus at most ``num_spec_tokens`` drafts (and
        some have drafts)."""
        bucket = self.graph_manager.bucket("verify", len(chunks))
        if bucket is None or not any(c.num_draft for c in chunks):
            return None
        if any(
            c.num_tokens - c.num_draft != 1 or not c.sample or c.all_logits or c.prev_row >= 0
            or c.start_pos < c.cached_until  # a prefix hit's replay: eager
            for c in chunks
        ):  # fmt: skip
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
        if not self.graph_manager.graphs("mixed") or any(c.all_logits for c in chunks):
            return None
        bucket = self.graph_manager.bucket("mixed", sum(c.num_tokens for c in chunks))
        return None if bucket is None or num_rows > self._mixed_rows(bucket) else bucket

    def _capture_mixed_graphs(self) -> None:
        """One ``mixed`` graph per token bucket (64, 128, ... below ``mixed_graph_max_tokens`` or
        the step budget, and that bound itself) of steps mixing prefill chunks and decodes,
        padded to every sequence slot.  A capture that fails leaves these graphs
        out (logged): such steps run eagerly, the decode and verify graphs are unaffected."""
        cap = min(self.mixed_graph_max_tokens, self.inputs.max_tokens)
        buckets = [t for t in (2**i for i in range(6, 31)) if t < cap] + [cap]

        def make(t: int) -> Callable[[], Any]:
            rows = list(range(self._mixed_rows(t)))
            inputs = self.inputs.prepare([], rows, self.prev_buf, t, self.inputs.max_reqs, self.max_model_len)
            return functools.partial(self.forward, inputs)

        error = self.graph_manager.capture_family("mixed", buckets, make, "{}-token mixed-step")
        if error is not None:
            logger.warning("mixed-step graphs off: %s", error)
            return
        logger.info("mixed-step graphs captured for %s tokens", ", ".join(map(str, buckets)))

    def _graph_bucket(self, chunks: list[SeqChunk]) -> int | None:
        """The bucket whose graph runs this step, or ``None`` (eager): graphs run steps where every
        request decodes one token past its prefix-cache boundary and wants only its logits."""
        bucket = self.graph_manager.bucket("decode", len(chunks))
        bad = (
            c.num_tokens != 1 or not c.sample or c.all_logits or c.start_pos < c.cached_until for c in chunks
        )
        return None if bucket is None or any(bad) else bucket
