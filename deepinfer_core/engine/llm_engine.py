"""The engine loop: requests in, one scheduled + executed + sampled step at a time, outputs out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.backends.resolve import resolve_backend
from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.devices import check_device
from deepinfer_core.distributed.eplb import EplbController
from deepinfer_core.distributed.init import check_parallel_config
from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.logits_processing import LogitsProcessors
from deepinfer_core.engine.metrics import Metrics, StepStats
from deepinfer_core.engine.model_runner import ModelRunner
from deepinfer_core.engine.prompt_logprobs import logit_rows, record_prompt_logprobs
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer_core.engine.speculative import (
    SpeculativeDecoder,
    VerifyResult,
    check_draft_layers,
    drafter_class,
)
from deepinfer_core.engine.structured import MaskFill, StructuredOutputs
from deepinfer_core.errors import ConfigError, RequestError, SamplingParamsError
from deepinfer_core.hub import TOKENIZER_PATTERNS, parse_repo_id, snapshot_dir
from deepinfer_core.models.registry import default_model_dir, resolve_family
from deepinfer_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_core.plugins import get_plugins
from deepinfer_core.plugins.lookup import ComponentLookup, subclass_of
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.random import derive_seed
from deepinfer_core.sampling.sampler import Sampler, SamplingBatch
from deepinfer_core.tokenizer import load_tokenizer

logger = logging.getLogger("deepinfer.engine")


@dataclass
class _Launched:
    """A step that ran (or, on an accelerator, is running) and whose outputs are not processed."""

    sched: SchedulerOutput
    token_ids: torch.Tensor  # sampled token per sampling chunk, on the device
    logprobs: list[dict[int, float] | None]
    t0: float
    verified: VerifyResult | None = None  # speculative decoding: tokens emitted per chunk
    hidden: torch.Tensor | None = None  # its hidden rows, when kept (the ``mtp`` drafter)


__all__ = ["LLMEngine", "StepStats", "resolve_model_dir", "resolve_tokenizer_dir"]


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


class LLMEngine:
    """Owns the scheduler, the model runner, the sampler and the tokenizer.

    Args:
        config: the validated engine configuration (``config.model`` ``None`` = built-in tiny model).
        plugins: the plugin manager (default: the process-wide one).
        parallel: this process's place in a distributed run
            (:class:`~deepinfer_core.contract.parallel.ParallelState`; ``None`` = a single
            process).  With expert parallelism every :meth:`step` runs exactly one forward,
            a dummy one (:meth:`ModelRunner.execute_dummy`) when nothing is scheduled, so the
            ranks' expert-parallel collectives line up.

    Attributes:
        config: the configuration with ``dtype``, ``device``, ``max_model_len`` and ``page_size``
            resolved.
        backend: the chosen :class:`~deepinfer_core.backends.BackendSpec`.
        ops: the resolved :class:`~deepinfer_core.ops.OpTable`.
        family: the :class:`~deepinfer_core.models.registry.ModelFamily` of the checkpoint's
            ``model_type``, resolved through the plugins (``deepinfer_register_models``).
        runner: the :class:`~deepinfer_core.engine.model_runner.ModelRunner`.
        tokenizer: the tokenizer, or ``None`` when the model directory has none (then only
            token-id prompts work and ``text`` is empty).
    """

    def __init__(self, config: EngineConfig, plugins: Any = None, parallel: ParallelState | None = None):
        if plugins is None:
            plugins = get_plugins()
        self.plugins = plugins
        self.parallel = parallel
        plugins.configure(config)
        model_dir = resolve_model_dir(config.model, config.revision, config.download_dir, plugins)
        tokenizer_dir = resolve_tokenizer_dir(config.tokenizer, model_dir, config.download_dir)
        self.family, model_config = resolve_family(model_dir, plugins)
        self.backend, self.ops = resolve_backend(config.backend, config.strict_ops, plugins=plugins)
        ratios = self.family.cache_ratios(model_config)
        quantized_formats = config.resolved_quantized_formats(self.backend.quantized_weights)
        self.config = config.model_copy(
            update={
                "model": str(model_dir),
                "keep_quantized": bool(quantized_formats),
                "dtype": config.resolved_dtype(self.backend.device_type),
                "device": config.device or self.backend.device_type,
                "max_model_len": config.resolved_max_model_len(model_config.max_position_embeddings),
                "page_size": config.resolved_page_size(ratios),
            }
        )
        check_device(self.config.device)
        if self.config.batch_invariant:
            self._check_batch_invariance(torch.device(self.config.device).type)
        logger.info(
            "engine: model %s (%s), backend %r (device %s, dtype %s), max_model_len %d, page_size %d, "
            "quantised weights kept: %s%s",
            model_dir,
            self.family.model_type,
            self.backend.name,
            self.config.device,
            self.config.dtype,
            self.config.max_model_len,
            self.config.page_size,
            ", ".join(quantized_formats) or "none",
            " (the backend's declaration)" if config.keep_quantized is None else "",
        )
        drafter_cls = None
        if self.config.speculative is not None:  # before the runner: the mtp drafter's layer loads with it
            drafter_cls = drafter_class(self.config.speculative, plugins)
        if parallel is not None and parallel.world_size > 1:
            self._check_parallel(drafter_cls)
        if drafter_cls is not None and drafter_cls.uses_mtp_layers:
            drafter = self.config.speculative.drafter  # type: ignore[union-attr]
            check_draft_layers(self.family, drafter, drafter_cls.mtp_kind, model_config)
        try:
            self.runner = ModelRunner(
                model_dir,
                self.config,
                self.ops,
                quantized_formats=quantized_formats,
                family=self.family,
                model_config=model_config,
                mtp=drafter_cls is not None and drafter_cls.uses_mtp_layers,
                parallel=parallel,
            )
        except (MemoryError, RuntimeError) as e:  # torch's CPU allocator raises a RuntimeError
            if not isinstance(e, MemoryError | torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            raise ConfigError(
                f"not enough memory on {self.config.device} for the model, its KV cache and step buffers "
                f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); lower max_num_seqs, "
                "max_num_batched_tokens, max_model_len or num_cache_pages / kv_cache_memory_gb"
            ) from None
        self.config = self.config.model_copy(
            update={"max_model_len": self._fit_max_model_len(config.max_model_len is not None)}
        )
        self.runner.max_model_len = self.config.max_model_len
        self.eplb = None  # expert-parallel load balancing, stepped after every step (before graph capture)
        if self.config.eplb is not None and parallel is not None and parallel.expert_parallel:
            eplb = self.config.eplb
            self.eplb = EplbController(
                eplb, None, self.runner.model, parallel, layers_per_step=eplb.layers_per_step
            )
        self._capture_graphs()
        if self.eplb is not None:  # the captures' forwards routed padding rows: not load
            self.eplb.counts.zero_()
        self.model_config = self.runner.model_config
        self.tokenizer, self._tokenizer_error = self._load_tokenizer(tokenizer_dir)
        eos = list(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos += [t for t in self.tokenizer.eos_token_ids if t not in eos]
        self.eos_token_ids = eos
        self.max_model_len: int = self.config.max_model_len  # type: ignore[assignment]
        self.scheduler = self._scheduler_class()(
            self.runner.kv_cache,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.config.enable_chunked_prefill,
            replay_tail=self.runner.replay_tail,
            max_model_len=self.max_model_len,
        )
        self._inflight: _Launched | None = None  # async: the step whose outputs are pending
        self.sampler = Sampler()
        self._num_added = 0
        self._num_steps = 0
        self._errored: list[Request] = []  # finished before scheduling (failed, aborted)
        self._abort_ids: list[str] = []  # aborts asked for, applied at the start of the next step
        self._abort_lock = threading.Lock()
        self._req_metrics: dict[str, RequestMetrics] = {}
        self.metrics = Metrics(self.runner.capacity_tokens)
        self.structured = StructuredOutputs(
            plugins,
            self.tokenizer,
            self._tokenizer_error,
            self.model_config.vocab_size,
            self.eos_token_ids,
            overlap=self.runner.device.type == "cpu",  # the forward runs on this thread
        )
        self.processors = LogitsProcessors(plugins, self.model_config.vocab_size, self.runner.device)
        self._want_stats = bool(plugins.pm.hook.deepinfer_step_stats.get_hookimpls())
        self.spec = self._speculative(drafter_cls)
        plugins.engine_started(self)

    def _check_parallel(self, drafter_cls: type | None) -> None:
        """Refuse what a distributed run cannot do (one-line :class:`ConfigError` saying why)."""
        check_parallel_config(self.config)
        assert self.parallel is not None
        if drafter_cls is not None and drafter_cls.uses_mtp_layers and self.parallel.expert_parallel:
            raise ConfigError(
                f"speculative.drafter={self.config.speculative.drafter!r} runs the MTP layer, whose extra "  # type: ignore[union-attr]
                "forwards would not line up with the other ranks' expert-parallel collectives; use a "
                "drafter without model layers ('ngram') or turn enable_expert_parallel off"
            )

    def _speculative(self, drafter_cls: type | None) -> SpeculativeDecoder | None:
        """Speculative decoding when configured.  A step that verifies drafts runs
        synchronously (its drafts need the previous step's tokens on the host); steps without
        drafts stay asynchronous (a drafter that follows every step, ``mtp``, observes each one
        when it is processed, from the hidden rows kept with it)."""
        if self.config.speculative is None:
            return None
        return SpeculativeDecoder(self, drafter_cls)

    def _check_batch_invariance(self, device_type: str) -> None:
        """Refuse ``batch_invariant=True`` where the op table does not honour it on this device.

        The backend's declaration covers its whole table as the engine runs it: its kernels,
        and the reference ops it leaves to fall back, whose fixed-tile GEMMs run on the table's
        ``tile_matmul``.  So a backend declaring a device the reference does not hold on must
        provide ``tile_matmul`` itself.
        """
        backend = self.backend
        if device_type not in backend.batch_invariant_devices:
            honoured = ", ".join(backend.batch_invariant_devices) or "no device"
            raise ConfigError(
                f"batch_invariant=True: backend {backend.name!r} does not guarantee batch invariance on "
                f"{device_type} (it does on: {honoured}); run on such a device, pick another backend, or "
                "turn batch_invariant off"
            )
        reference = self.plugins.get_backend("reference")
        if (
            self.ops.sources.get("tile_matmul") == "reference"
            and device_type not in reference.batch_invariant_devices
        ):
            raise ConfigError(
                f"batch_invariant=True: backend {backend.name!r} declares batch invariance on {device_type} "
                "but leaves op 'tile_matmul' (the GEMM every batch-invariant product runs on) to the "
                f"reference, which does not hold on {device_type}; provide 'tile_matmul' in the backend "
                "or turn batch_invariant off"
            )

    def _capture_graphs(self) -> None:
        """Capture the decode graphs when the backend supports it (``enforce_eager`` off), and
        log what was decided."""
        if self.config.enforce_eager:
            logger.info("device graphs off: enforce_eager=True")
            return
        if not self.backend.supports_graph_capture:
            logger.info("device graphs off: backend %r does not support graph capture", self.backend.name)
            return
        t0 = time.perf_counter()
        reason = self.runner.capture_graphs()
        if reason is None:
            logger.info(
                "captured %d decode graphs (batch sizes %s), %d verify graphs (%d tokens per request) "
                "and %d MTP graphs in %.1f s",
                len(self.runner.graphs),
                sorted(self.runner.graphs),
                len(self.runner.verify_graphs),
                1 + self.runner.num_spec_tokens,
                len(self.runner.mtp_graphs),
                time.perf_counter() - t0,
            )
        elif self.runner.device.type == "cpu":
            logger.debug("device graphs off: %s", reason)
        else:
            logger.warning("device graphs off, decode runs eagerly: %s", reason)

    def _fit_max_model_len(self, explicit: bool) -> int:
        """``max_model_len`` checked against the cache: a sequence of that length must fit in the
        whole cache, or the configuration could never serve it.  An explicit value that does not
        fit is an error; a defaulted one is lowered to the cache's capacity (with a warning)."""
        wanted: int = self.config.max_model_len  # type: ignore[assignment]
        page, pages = self.runner.page_size, self.runner.kv_cache.num_pages
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
            "max_model_len lowered from %d to %d: the cache has %d pages of %d tokens; %s for longer "
            "sequences",
            wanted,
            capacity,
            pages,
            page,
            fix,
        )
        return capacity

    @staticmethod
    def _load_tokenizer(path: Path) -> tuple[Any, str | None]:
        try:
            return load_tokenizer(path), None
        except ConfigError as e:
            logger.warning("no tokenizer (%s): only token-id prompts can be served", e)
            return None, str(e)

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt."""
        if self.tokenizer is None:
            raise RequestError(
                f"a text prompt needs a tokenizer: {self._tokenizer_error}; pass prompt_token_ids"
            )
        return self.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        """Detokenize (special tokens skipped); empty without a tokenizer."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        sample_index: int = 0,
        seed_index: int | None = None,
    ) -> Request:
        """Queue one request (one sample: ``params.n`` is handled by :class:`~deepinfer_core.LLM`).

        A request that cannot be served (empty prompt, prompt longer than ``max_model_len``,
        token id outside the vocabulary) is finished at once with ``finish_reason="error"`` and
        returned by the next :meth:`step`; it never disturbs the others.

        Args:
            sample_index: which of the ``n`` samples of a prompt this is; the request's sampling
                seed is ``derive_seed(params.seed, sample_index)`` when ``params.seed`` is set, else
                ``derive_seed(engine seed, index of the request in this engine)``.
            seed_index: the index to derive an unseeded request's seed from instead of its
                index in this engine (a data-parallel replica gets the index the request has
                in the whole run, so sampled outputs equal a single process's).

        Raises:
            SamplingParamsError: ``params`` names token ids outside the model's vocabulary, or
                has stop strings but the engine has no tokenizer.
        """
        self.check_params(params)
        index = self._num_added
        self._num_added += 1
        if params.seed is not None:
            seed = derive_seed(params.seed, sample_index)
        else:
            seed = derive_seed(self.config.seed, index if seed_index is None else seed_index)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        req = Request(
            request_id, prompt_token_ids, params, prompt=prompt, sampling_seed=seed, detokenizer=detok
        )
        self._req_metrics[request_id] = RequestMetrics(arrival_time=time.monotonic())
        error = self._check_prompt(req)
        if error is None and params.structured_outputs is not None:
            error = self.structured.attach(req)
        if error is None and params.logits_processors:
            error = self.processors.attach(req)
        if error is not None:
            req.finish("error", error)
            self._errored.append(req)
        else:
            self.scheduler.add(req)
        return req

    def _scheduler_class(self) -> type[Scheduler]:
        """The scheduler class registered as ``config.scheduler``; :class:`ConfigError` naming the
        registered ones when it is unknown, unavailable or not a :class:`Scheduler`."""
        lookup = ComponentLookup(self.plugins, "schedulers", "scheduler {}", check=subclass_of(Scheduler))
        return lookup.get(self.config.scheduler)

    def check_params(self, params: SamplingParams) -> None:
        """Check what ``params`` needs from this engine (token ids in the vocabulary, a tokenizer
        for stop strings); raises :class:`SamplingParamsError` naming the field."""
        params.verify_vocab(self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise SamplingParamsError(
                f"SamplingParams.stop={params.stop!r} needs a tokenizer, and the engine has none "
                f"({self._tokenizer_error}); use stop_token_ids"
            )

    def _check_prompt(self, req: Request) -> str | None:
        n, vocab = req.num_prompt_tokens, self.model_config.vocab_size
        if n == 0:
            return f"request {req.request_id!r}: the prompt is empty; give at least one token"
        if n > self.max_model_len:
            return (
                f"request {req.request_id!r}: the prompt has {n} tokens, more than max_model_len="
                f"{self.max_model_len}; shorten it or raise max_model_len"
            )
        bad = [t for t in req.prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            return (
                f"request {req.request_id!r}: prompt token ids {bad[:5]} are outside the vocabulary "
                f"[0, {vocab})"
            )
        if not self.scheduler.can_ever_fit(n):
            return (
                f"request {req.request_id!r}: the prompt's {n} tokens do not fit in the cache of "
                f"{self.runner.kv_cache.num_pages} pages; raise num_cache_pages or kv_cache_memory_gb"
            )
        return None

    def reset_metrics(self) -> None:
        """Zero the engine totals (:attr:`metrics`) and speculative decoding's, e.g. after a
        warm-up; the running requests and the caches stay."""
        self.metrics.reset()
        if self.spec is not None:
            self.spec.metrics.reset()

    def has_unfinished(self) -> bool:
        """Whether any request is still queued, running, in flight, or finished but not returned."""
        return bool(self._errored) or self._inflight is not None or self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that finished.

        Synchronous mode: schedule, execute, sample, process the outputs.  Async mode
        (``async_scheduling``, the default): schedule and launch step N+1 *before* processing
        step N's outputs; N+1's decode inputs are N's sampled tokens taken on the device (no
        host round trip between the steps), so on an accelerator the host work overlaps the
        device work.  Outputs therefore lag one step; the tokens and texts are identical to
        synchronous mode because sampling (penalties, min_tokens, the counter-based draw) runs
        after the previous step's tokens are appended.
        """
        t0 = time.perf_counter()
        self._apply_aborts()
        finished, self._errored = self._errored, []
        previous, self._inflight = self._inflight, None
        if previous is not None and self.structured.wants_tokens_first(self.scheduler.running):
            finished += self._complete(previous, t0)  # CPU: the grammar masks overlap the forward
            previous = None
        if self.spec is not None:
            if self.spec.wants_drafts(self.scheduler.running) and previous is not None:
                finished += self._complete(previous)  # the drafts need its tokens
                previous = None
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        finished += sched.finished
        logits = None
        masks = None
        if not sched.is_empty:
            prev_tokens = previous.token_ids if previous is not None else None
            if not any(c.num_draft for c in sched.chunks):
                masks = self.structured.start(sched.sampling_requests)  # runs with the forward
            logits = self.runner.execute(sched.chunks, prev_tokens)
        elif self.parallel is not None and self.parallel.expert_parallel:
            self.runner.execute_dummy()  # the other ranks' MoE collectives wait for this rank's
        if previous is not None:
            finished += self._complete(previous, t0)
        if logits is not None:
            launched = self._sample(sched, logits, t0, masks)
            launched.hidden = self.runner.last_hidden
            if self.config.async_scheduling and launched.verified is None:
                self._inflight = launched
            else:
                finished += self._complete(launched)
        elif previous is None and not finished and self.scheduler.has_unfinished():
            raise RuntimeError(f"scheduler made no progress with running requests {self.scheduler.running}")
        if self.eplb is not None:
            self.eplb.step()  # between two steps: may rebalance and move expert weights
        self.metrics.record_finished(len(finished))
        return [self.make_output(r) for r in finished]

    def _sample(
        self, sched: SchedulerOutput, logits: torch.Tensor, t0: float, masks: Future[MaskFill] | None = None
    ) -> _Launched:
        """Prompt logprobs and the sampled tokens of a step (tokens stay on the device);
        ``masks``: the grammar masks already being filled on the worker thread."""
        sample_rows, first_rows = logit_rows(sched.chunks)
        if any(f is not None for f in first_rows):  # prompt logprobs: all rows of some chunks
            record_prompt_logprobs(sched.requests, sched.chunks, logits, first_rows)
            logits = logits[sample_rows]
        if self.spec is not None:
            if any(c.num_draft for c in sched.chunks):
                verified = self.spec.sample(sched, logits)
                return _Launched(sched, logits.new_empty(0), [], t0, verified)
            self.spec.record_without_drafts(sched)
        positions = [c.end_pos for c in sched.chunks if c.sample]  # of the tokens sampled
        requests = sched.sampling_requests
        batch = SamplingBatch.from_requests(requests, self.eos_token_ids, positions)
        self.structured.apply(batch, requests, masks)
        if any(r.logits_processors for r in requests):
            logits = self.processors.apply(logits.float(), list(requests))
        sampled = self.sampler(logits, batch)
        return _Launched(sched, sampled.token_ids, sampled.logprobs, t0)

    def _complete(self, step: _Launched, next_launch: float | None = None) -> list[Request]:
        """Process a launched step's outputs (the only host sync on its sampled tokens);
        ``next_launch``: when the step after it started, for a step processed after that one
        was launched (its period then ends there)."""
        if step.verified is not None:
            v = step.verified
            finished = self.scheduler.complete_tokens(step.sched, v.token_ids, v.logprobs, self.eos_token_ids)
        else:
            finished = self.scheduler.complete(
                step.sched, step.token_ids.tolist(), step.logprobs, self.eos_token_ids
            )
        self._record_step(step.sched, finished, step.t0, step.verified)
        if self.spec is not None:
            end = time.perf_counter() if next_launch is None else next_launch
            self.spec.observe_step(step.sched, end - step.t0, overlapped=next_launch is not None)
            self.spec.observe(step.sched, step.hidden)
        return finished

    def _record_step(
        self, sched: SchedulerOutput, finished: list[Request], t0: float, verified: VerifyResult | None = None
    ) -> None:
        """Per-request timestamps, this step's :class:`StepStats` into :attr:`metrics` and the hook."""
        now = time.monotonic()
        for req in sched.requests:
            m = self._req_metrics.get(req.request_id)
            if m is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = now
        dropped = {id(r) for r in sched.discarded}  # async: ran after they had finished
        sampled = [r for r in sched.sampling_requests if id(r) not in dropped]
        num_prompt_tokens = 0
        for req in sampled:
            m = self._req_metrics.get(req.request_id)
            if m is not None and req.output_token_ids:
                m.last_token_time = now
                if m.first_token_time is None:
                    m.first_token_time = now
            if len(req.output_token_ids) == 1:  # the step that completed its prompt
                num_prompt_tokens += req.num_prompt_tokens
        self._num_steps += 1
        stats = StepStats(
            step=self._num_steps,
            num_seqs=len(sched.chunks),
            num_tokens=sched.num_tokens,
            num_decode_seqs=sum(c.num_tokens - c.num_draft == 1 and c.start_pos > 0 for c in sched.chunks),
            num_preempted=len(sched.preempted),
            num_finished=len(finished),
            cache_usage=self.runner.kv_cache.usage(),
            step_time_s=time.perf_counter() - t0,
            num_prompt_tokens=num_prompt_tokens,
            num_generated_tokens=len(sampled) if verified is None else sum(map(len, verified.token_ids)),
            num_draft_tokens=sum(c.num_draft for c in sched.chunks),
            num_accepted_tokens=0 if verified is None else verified.num_accepted,
            num_prefix_hit_tokens=sched.num_prefix_hit_tokens,
            num_replayed_tokens=sched.num_replayed_tokens,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
        )
        self.metrics.update(stats)
        if self._want_stats:
            self.plugins.step_stats(stats)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several, as vLLM's ``LLMEngine.abort_request``.

        Safe to call from another thread or from a ``deepinfer_step_stats`` hook: the abort is
        applied at the start of the next :meth:`step`, which frees the request's cache pages and
        slot and returns its output with ``finish_reason="abort"`` and the tokens generated so
        far.  Ids that are unknown or already finished are ignored (the request may have just
        completed).
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._abort_lock:
            self._abort_ids.extend(ids)

    def _apply_aborts(self) -> None:
        with self._abort_lock:
            ids, self._abort_ids = set(self._abort_ids), []
        if not ids:
            return
        self._errored += self.scheduler.finish_requests(ids, "abort")

    def abort_all(self, reason: str) -> list[RequestOutput]:
        """Finish every unfinished request with ``finish_reason="error"`` and free its cache."""
        done, self._errored = self._errored, []
        self._inflight = None  # its requests are aborted below; its outputs are dropped
        with self._abort_lock:
            self._abort_ids = []
        done += self.scheduler.abort_all(reason)
        self.metrics.record_finished(len(done))
        return [self.make_output(r) for r in done]

    def make_output(self, req: Request) -> RequestOutput:
        """The user-facing output of a request (text detokenized, stop token excluded from it)."""
        if req.logits_processors and req.is_finished:
            self.processors.release(req)
        if self.spec is not None and req.is_finished:
            self.spec.release(req)
        want_logprobs = req.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=req.output_text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            logprobs=list(req.logprobs) if want_logprobs else None,
            cumulative_logprob=req.cumulative_logprob if want_logprobs else None,
            stop_reason=req.stop_reason,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[completion],
            finished=req.status is RequestStatus.FINISHED,
            error=req.error,
            metrics=self._request_metrics(req),
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
        )

    def _request_metrics(self, req: Request) -> RequestMetrics | None:
        """The request's timestamps; a finished request's are stamped and forgotten."""
        if not req.is_finished:
            return self._req_metrics.get(req.request_id)
        m = self._req_metrics.pop(req.request_id, None)
        if m is not None and m.finished_time is None:
            m.finished_time = time.monotonic()
        return m
