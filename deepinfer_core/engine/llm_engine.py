"""The engine loop: requests in, one scheduled + executed + sampled step at a time, outputs out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.engine.builder import build_engine_parts, resolve_model_dir, resolve_tokenizer_dir
from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.metrics import Metrics, StepStats
from deepinfer_core.engine.prompt_logprobs import logit_rows, record_prompt_logprobs
from deepinfer_core.engine.request import Request, RequestStatus
from deepinfer_core.engine.resolved import ResolvedConfig
from deepinfer_core.engine.scheduler import SchedulerOutput
from deepinfer_core.engine.speculative import SpeculativeDecoder, VerifyResult
from deepinfer_core.engine.structured import MaskFill
from deepinfer_core.errors import RequestError, SamplingParamsError
from deepinfer_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_core.plugins import get_plugins
from deepinfer_core.sampling.params import SamplingParams
from deepinfer_core.sampling.random import derive_seed
from deepinfer_core.sampling.sampler import Sampler, SamplingBatch
from deepinfer_core.sampling.transfer import HostCopy

logger = logging.getLogger("deepinfer.engine")


@dataclass
class _Launched:
    """A step that ran (or, on an accelerator, is running) and whose outputs are not processed."""

    sched: SchedulerOutput
    token_ids: torch.Tensor  # sampled token per sampling chunk, on the device
    host_ids: HostCopy | None  # the same on their way to the host (read without waiting for later steps)
    logprobs: list[dict[int, float] | None]
    t0: float
    verified: VerifyResult | None = None  # speculative decoding: tokens emitted per chunk
    hidden: torch.Tensor | None = None  # its hidden rows, when kept (the ``mtp`` drafter)


__all__ = ["LLMEngine", "StepStats", "resolve_model_dir", "resolve_tokenizer_dir"]


class LLMEngine:
    """An :class:`~deepinfer_core.engine.client.EngineClient`: the step loop over the parts
    :func:`~deepinfer_core.engine.builder.build_engine_parts` wires (the scheduler, the model
    runner, the sampler, the tokenizer).

    Args:
        config: the validated engine configuration (``config.model`` ``None`` = built-in tiny model).
        plugins: the plugin manager (default: the process-wide one).
        parallel: this process's place in a distributed run
            (:class:`~deepinfer_core.contract.parallel.ParallelState`; ``None`` = a single
            process).  With expert parallelism every :meth:`step` runs exactly one forward,
            a dummy one (:meth:`ModelRunner.execute_dummy`) when nothing is scheduled, so the
            ranks' expert-parallel collectives line up.

    Attributes:
        config: the frozen :class:`~deepinfer_core.engine.resolved.ResolvedConfig` (``dtype``,
            ``device``, ``max_model_len``, ``page_size``... resolved; the other options as given).
        backend: the chosen :class:`~deepinfer_core.backends.BackendSpec`.
        ops: the resolved :class:`~deepinfer_core.ops.OpTable`.
        family: the :class:`~deepinfer_core.models.registry.ModelFamily` of the checkpoint's
            ``model_type``, resolved through the plugins (``deepinfer_register_models``).
        runner: the :class:`~deepinfer_core.engine.model_runner.ModelRunner`.
        tokenizer: the tokenizer, or ``None`` when the model directory has none (then only
            token-id prompts work and ``text`` is empty).
    """

    def __init__(self, config: EngineConfig, plugins: Any = None, parallel: ParallelState | None = None):
        parts = build_engine_parts(config, get_plugins() if plugins is None else plugins, parallel)
        self.config: ResolvedConfig = parts.config
        self.plugins = parts.plugins
        self.parallel = parts.parallel
        self.family = parts.family
        self.backend, self.ops = parts.backend, parts.ops
        self.runner = parts.runner
        self.model_config = self.runner.model_config
        self.eplb = parts.eplb
        self.tokenizer, self._tokenizer_error = parts.tokenizer, parts.tokenizer_error
        self.eos_token_ids = parts.eos_token_ids
        self.scheduler = parts.scheduler
        self.structured = parts.structured
        self.processors = parts.processors
        self.sampler = Sampler(self.ops)  # greedy rows through the backend's argmax_rows
        self.metrics = Metrics(self.config.capacity_tokens)
        self._inflight: _Launched | None = None  # async: the step whose outputs are pending
        self._num_added = 0
        self._num_steps = 0
        self._errored: list[Request] = []  # finished before scheduling (failed, aborted)
        self._abort_ids: list[str] = []  # aborts asked for, applied at the start of the next step
        self._abort_lock = threading.Lock()
        self._req_metrics: dict[str, RequestMetrics] = {}
        self._want_stats = bool(self.plugins.pm.hook.deepinfer_step_stats.get_hookimpls())
        self.spec = self._speculative(parts.drafter_cls)
        self.plugins.engine_started(self)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (``config.max_model_len``)."""
        return self.config.max_model_len

    def _speculative(self, drafter_cls: type | None) -> SpeculativeDecoder | None:
        """Speculative decoding when configured.  A step that verifies drafts runs
        synchronously (its drafts need the previous step's tokens on the host); steps without
        drafts stay asynchronous (a drafter that follows every step, ``mtp``, observes each one
        when it is processed, from the hidden rows kept with it)."""
        if self.config.speculative is None:
            return None
        return SpeculativeDecoder(self, drafter_cls)

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

    def get_metrics(self) -> dict[str, Any]:
        """The totals since start (:meth:`~deepinfer_core.engine.metrics.Metrics.as_dict`), with
        speculative decoding's (``speculative``) and EPLB's (``eplb``) when they run."""
        metrics = self.metrics.as_dict()
        if self.spec is not None:
            metrics["speculative"] = self.spec.metrics_dict()
        if self.eplb is not None:
            metrics["eplb"] = self.eplb.metrics_dict()
        return metrics

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Token positions the paged KV cache holds."""
        return self.runner.capacity_tokens

    def shutdown(self) -> None:
        """Stop the grammar worker thread (if one was started); idempotent."""
        self.structured.close()

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
        device work: processing step N waits only for its tokens' copy to the host, started when
        they were sampled (:class:`HostCopy`), not for step N+1.  Outputs lag one step; tokens
        and texts are those of synchronous mode because sampling (penalties, min_tokens, the
        counter-based draw) runs after the previous step's tokens are appended.
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
                return _Launched(sched, logits.new_empty(0), None, [], t0, verified)
            self.spec.record_without_drafts(sched)
        positions = [c.end_pos for c in sched.chunks if c.sample]  # of the tokens sampled
        requests = sched.sampling_requests
        batch = SamplingBatch.from_requests(requests, self.eos_token_ids, positions)
        self.structured.apply(batch, requests, masks)
        if any(r.logits_processors for r in requests):
            logits = self.processors.apply(logits.float(), list(requests))
        ids, logprobs = (sampled := self.sampler(logits, batch)).token_ids, sampled.logprobs
        return _Launched(sched, ids, HostCopy(ids, self.config.device_timeout_s), logprobs, t0)

    def _complete(self, step: _Launched, next_launch: float | None = None) -> list[Request]:
        """Process a launched step's outputs (the only host sync on its sampled tokens);
        ``next_launch``: when the step after it started, for a step processed after that one
        was launched (its period then ends there)."""
        if step.verified is not None:
            v = step.verified
            finished = self.scheduler.complete_tokens(step.sched, v.token_ids, v.logprobs, self.eos_token_ids)
        else:
            finished = self.scheduler.complete(
                step.sched, step.host_ids.get().tolist(), step.logprobs, self.eos_token_ids
            )
        self._record_step(step, finished)
        if self.spec is not None:
            end = time.perf_counter() if next_launch is None else next_launch
            self.spec.observe_step(step.sched, end - step.t0, overlapped=next_launch is not None)
            self.spec.observe(step.sched, step.hidden)
        return finished

    def _record_step(self, step: _Launched, finished: list[Request]) -> None:
        """Per-request timestamps, this step's :class:`StepStats` into :attr:`metrics` and the hook."""
        sched, verified, now = step.sched, step.verified, time.monotonic()
        metrics, dropped = self._req_metrics, {id(r) for r in sched.discarded}  # (async: ran finished)
        num_tokens = num_decode_seqs = num_draft = num_sampled = num_prompt_tokens = 0
        for req, c in zip(sched.requests, sched.chunks, strict=True):  # one pass (large batches)
            n = len(c.token_ids)
            num_tokens, num_draft = num_tokens + n, num_draft + c.num_draft
            num_decode_seqs += n - c.num_draft == 1 and c.start_pos > 0
            m = metrics.get(req.request_id)
            if m is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = now
            if not c.sample or id(req) in dropped:
                continue
            num_sampled += 1
            if m is not None and req.output_token_ids:
                m.last_token_time = now
                m.first_token_time = now if m.first_token_time is None else m.first_token_time
            if len(req.output_token_ids) == 1:  # the step that completed its prompt
                num_prompt_tokens += req.num_prompt_tokens
        self._num_steps += 1
        stats = StepStats(
            step=self._num_steps,
            num_seqs=len(sched.chunks),
            num_tokens=num_tokens,
            num_decode_seqs=num_decode_seqs,
            num_preempted=len(sched.preempted),
            num_finished=len(finished),
            cache_usage=self.runner.kv_cache.usage(),
            step_time_s=time.perf_counter() - step.t0,
            num_prompt_tokens=num_prompt_tokens,
            num_generated_tokens=num_sampled if verified is None else sum(map(len, verified.token_ids)),
            num_draft_tokens=num_draft,
            num_accepted_tokens=0 if verified is None else verified.num_accepted,
            num_prefix_hit_tokens=sched.num_prefix_hit_tokens,
            num_replayed_tokens=sched.num_replayed_tokens,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            host_wait_s=step.host_ids.waited_s if step.host_ids is not None else 0.0,
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
