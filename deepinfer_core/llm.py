"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, as in vLLM.

Also ``chat(messages)`` (the checkpoint's chat template), ``abort(request_ids)``,
``get_metrics()`` and a progress bar with live output tokens/s on ``generate``.
"""

from __future__ import annotations

import copy
import itertools
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.client import EngineClient
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine.resolved import ResolvedConfig
from deepinfer_core.errors import RequestError, SamplingParamsError
from deepinfer_core.logging_utils import configure_logging
from deepinfer_core.outputs import RequestMetrics, RequestOutput
from deepinfer_core.sampling.params import SamplingParams

PromptType = str | Mapping[str, Any]
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: model directory (``config.json``, safetensors, ``tokenizer.json``), or a Hugging
            Face Hub repo id ``org/name[@revision]`` fetched into the HF cache (``revision``,
            ``download_dir`` and ``HF_HUB_OFFLINE=1`` apply; e.g. the production checkpoint
            ``deepseek-ai/DeepSeek-V4.1-Flash-1017``); ``None`` = the built-in tiny model
            (created and cached on first use, no download).
        config: a TOML / YAML engine config file.
        backend, dtype, max_num_seqs, max_num_batched_tokens, seed: common engine options.
        kwargs: any other :class:`~deepinfer_core.config.EngineConfig` field; with
            ``data_parallel_size`` / ``context_parallel_size`` above 1 this process becomes
            rank 0 of a distributed run and starts the other ranks as worker processes
            itself (under torchrun it joins the launched world instead); see
            ``docs/distributed.md`` and :meth:`shutdown`.

    Options are merged as defaults < ``config`` file < ``DEEPINFER_*`` environment < arguments;
    an argument left at ``None`` does not override the lower sources.

    Raises:
        ConfigError: invalid option, missing model directory, a Hub repo that cannot be had
            (offline and uncached, no network, unknown repo or revision), unreadable config file.
        BackendError: unknown or unavailable backend.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | None = None,
        backend: str | None = None,
        dtype: str | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ):
        engine_config = EngineConfig.load(
            config_file=config,
            model=None if model is None else os.fspath(model),
            backend=backend,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=seed,
            **kwargs,
        )
        configure_logging(engine_config.log_level)
        if engine_config.world_size > 1:
            self._attach_distributed(engine_config)
        else:
            engine = LLMEngine(engine_config)
            self._attach(engine, engine)

    def _attach_distributed(self, config: EngineConfig) -> None:
        """Rank 0 of a distributed run drives it (:mod:`deepinfer_core.distributed.coordinator`);
        another rank of a launched world (torchrun) serves it and ends its process when the run
        ends (:func:`~deepinfer_core.distributed.worker.exit_rank`)."""
        from deepinfer_core.distributed.coordinator import Coordinator
        from deepinfer_core.distributed.init import launched_by_torchrun

        if launched_by_torchrun() and os.environ.get("RANK") != "0":
            from deepinfer_core.distributed.worker import exit_rank, serve_rank

            exit_rank(serve_rank(config))
        coordinator = Coordinator.start(config)
        self._attach(coordinator, coordinator.engine)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An ``LLM`` over an engine built by hand (e.g. with a custom plugin manager)."""
        llm = cls.__new__(cls)
        llm._attach(engine, engine)
        return llm

    def _attach(self, client: EngineClient, engine: LLMEngine) -> None:
        self.client = client
        """What this ``LLM`` drives: the engine, or rank 0's coordinator of a distributed run."""
        self.engine = engine
        """This process's engine (in a distributed run, rank 0's)."""
        self._counter = itertools.count()
        self._in_flight: dict[str, list[str]] = {}  # request id -> engine ids, during generate()
        self._in_flight_lock = threading.Lock()
        # shutdown() when this LLM is released (its last reference gone) or at interpreter exit;
        # the callback refers to what it releases, never to the LLM
        self._release = weakref.finalize(self, client.shutdown)

    @property
    def config(self) -> ResolvedConfig:
        """The engine's resolved configuration (frozen)."""
        return self.client.config

    def get_tokenizer(self) -> Any:
        """The tokenizer (``None`` when the model directory has none)."""
        return self.client.tokenizer

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Token positions the paged KV cache holds (also logged at INFO when the engine starts);
        in a distributed run, the data-parallel replicas' caches together."""
        return self.client.kv_cache_capacity_tokens

    def shutdown(self) -> None:
        """End a distributed run: the worker ranks exit (killed if they do not within a few
        seconds) and this process leaves the ``torch.distributed`` world, so another
        distributed ``LLM`` can start in it.  For a single process it only stops the grammar
        worker thread (see :mod:`deepinfer_core.engine.structured`).

        Idempotent.  It also runs at the end of a ``with LLM(...)`` block, when the ``LLM`` is
        released (``del llm``, its last reference gone) and at interpreter exit."""
        self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_metrics(self) -> dict[str, Any]:
        """Engine totals since start: a plain dict, keys documented in
        :meth:`deepinfer_core.engine.metrics.Metrics.as_dict` (tokens, prefix hits, replays,
        preemptions, tokens/s, cache use, ``kv_cache_capacity_tokens``); with speculative
        decoding also ``speculative``: drafts, draft / accepted tokens, mean acceptance length,
        acceptance per position and the histogram of verify lengths, and for ``dspark`` its
        cost model (:meth:`deepinfer_core.engine.speculative.SpeculativeDecoder.metrics_dict`);
        with EPLB (``eplb=...``) also ``eplb``: steps, rebalancings, the last check's max/mean
        GPU expert load before and after and the recent checks
        (:meth:`deepinfer_core.distributed.eplb.EplbController.metrics_dict`, rank 0's).

        In a distributed run the counters are summed over the data-parallel replicas and
        ``per_rank`` holds every rank's own dict
        (:func:`deepinfer_core.distributed.coordinator.merge_metrics`)."""
        return self.client.get_metrics()

    def reset_metrics(self) -> None:
        """Zero the totals :meth:`get_metrics` reports (e.g. after a warm-up): this engine's,
        or in a distributed run every rank's (one message round, no step)."""
        self.client.reset_metrics()

    def abort(self, request_ids: str | Iterable[str] | None = None) -> None:
        """Abort requests of the running :meth:`generate` / :meth:`chat` call.

        Args:
            request_ids: ``RequestOutput.request_id`` values (``"0"``, ``"1"``, ... in the order
                prompts were given to this ``LLM``; every sample of an ``n > 1`` prompt is
                aborted); ``None`` = every request in flight.

        Safe from another thread (e.g. a ``threading.Timer`` as a timeout) and from a
        ``deepinfer_step_stats`` hook.  The aborts apply at the engine's next step: the call
        still returns one output per prompt, aborted ones with ``finish_reason="abort"`` and the
        tokens generated so far.  Unknown or finished ids are ignored.
        """
        with self._in_flight_lock:
            if request_ids is None:
                ids = list(self._in_flight)
            else:
                ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            sub_ids = [s for rid in ids for s in self._in_flight.get(rid, [rid])]
        self.client.abort_request(sub_ids)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the checkpoint's chat template.

        Args:
            messages: one conversation (``[{"role": "user", "content": "..."}, ...]``) or a list
                of conversations.
            sampling_params, use_tqdm: as in :meth:`generate`.
            add_generation_prompt: end the rendered prompt with the assistant turn's opening.
            chat_template: a jinja template to use instead of the checkpoint's.
            chat_template_kwargs: extra variables for the template (e.g. ``tools``).

        The rendered text is tokenized without adding a BOS (the template writes its own).
        Returns one :class:`RequestOutput` per conversation (``prompt`` is the rendered text).

        Raises:
            ConfigError: the checkpoint has no chat template (and none is given) or it fails.
            RequestError: the model has no tokenizer.
        """
        tokenizer = self.client.tokenizer
        if tokenizer is None:
            raise RequestError("LLM.chat needs a tokenizer with a chat template; the model has no tokenizer")
        if chat_template is not None:
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = chat_template
        conversations = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                list(conv), add_generation_prompt=add_generation_prompt, **dict(chat_template_kwargs or {})
            )
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_bos=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; returns one :class:`RequestOutput` per prompt, in prompt order.

        Args:
            prompts: a string, a ``{"prompt_token_ids": [...]}`` dict (optionally with
                ``"prompt"``), or a list mixing both.
            sampling_params: one :class:`SamplingParams` for all prompts, or one per prompt
                (default: ``SamplingParams()``).
            use_tqdm: show a progress bar on stderr: finished prompts and live output tokens/s.

        A prompt that cannot be served (empty, too long) gets ``finish_reason="error"`` and
        ``error`` set; the other prompts are unaffected.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        tokenized = [self._tokenize(prompt, i) for i, prompt in enumerate(prompt_list)]
        for params in params_list:  # raise before any request is queued
            self.client.check_params(params)
        groups: list[list[str]] = []
        meta: list[tuple[str, str | None, list[int]]] = []
        try:
            for (text, ids), params in zip(tokenized, params_list, strict=True):
                rid = str(next(self._counter))
                sub_ids = [rid] if params.n == 1 else [f"{rid}-{k}" for k in range(params.n)]
                with self._in_flight_lock:
                    self._in_flight[rid] = sub_ids
                for k, sub_id in enumerate(sub_ids):
                    self.client.add_request(sub_id, ids, params, prompt=text, sample_index=k)
                groups.append(sub_ids)
                meta.append((rid, text, ids))
            done = self._run(groups, use_tqdm)
        finally:
            with self._in_flight_lock:
                self._in_flight.clear()
        return [
            self._merge(rid, text, ids, [done[s] for s in sub])
            for (rid, text, ids), sub in zip(meta, groups, strict=True)
        ]

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step the engine until every request is done; a bar counts prompts whose samples all finished."""
        done: dict[str, RequestOutput] = {}
        left = [len(sub) for sub in groups]  # unfinished samples per prompt
        prompt_of = {s: i for i, sub in enumerate(groups) for s in sub}
        driver = self.client
        bar = _ProgressBar(len(groups), driver.metrics) if use_tqdm else None
        try:
            while driver.has_unfinished():
                completed = 0
                for out in driver.step():
                    done[out.request_id] = out
                    i = prompt_of.get(out.request_id)
                    if i is not None:
                        left[i] -= 1
                        completed += left[i] == 0
                if bar is not None:
                    bar.update(completed)
        except BaseException as e:  # leave the engine clean for the next generate() call
            driver.abort_all(f"generate() was interrupted: {type(e).__name__}: {e}")
            raise
        finally:
            if bar is not None:
                bar.close()
        return done

    @staticmethod
    def _merge(rid: str, text: str | None, ids: list[int], parts: list[RequestOutput]) -> RequestOutput:
        outputs = []
        for k, part in enumerate(parts):
            completion = part.outputs[0]
            completion.index = k
            outputs.append(completion)
        errors = [p.error for p in parts if p.error]
        return RequestOutput(
            request_id=rid,
            prompt=text,
            prompt_token_ids=list(ids),
            outputs=outputs,
            finished=all(p.finished for p in parts),
            error=errors[0] if errors else None,
            metrics=parts[0].metrics if len(parts) == 1 else _merge_metrics([p.metrics for p in parts]),
            prompt_logprobs=parts[0].prompt_logprobs,
        )

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise SamplingParamsError(
                f"got {len(params)} SamplingParams for {num_prompts} prompts; pass one SamplingParams "
                "for all prompts or exactly one per prompt"
            )
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise SamplingParamsError(f"sampling_params[{i}] is a {type(p).__name__}, not SamplingParams")
        return params

    def _tokenize(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.client.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, Sequence) or isinstance(ids, str):
                    raise RequestError(f"prompts[{index}]['prompt_token_ids'] must be a list of ints")
                return prompt.get("prompt"), [int(t) for t in ids]
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.client.encode(prompt["prompt"])
            raise RequestError(
                f"prompts[{index}] is a dict without 'prompt_token_ids' or 'prompt'; "
                f"got keys {sorted(prompt)}"
            )
        raise RequestError(
            f"prompts[{index}] is a {type(prompt).__name__}; "
            "give a str or a {'prompt_token_ids': [...]} dict"
        )


def _merge_metrics(parts: list[RequestMetrics | None]) -> RequestMetrics | None:
    """One prompt's timestamps from its samples': earliest arrival and first token, latest finish."""
    ms = [m for m in parts if m is not None]
    if not ms:
        return None

    def pick(values: list[float | None], fn: Any) -> float | None:
        present = [v for v in values if v is not None]
        return fn(present) if present else None

    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in ms),
        first_scheduled_time=pick([m.first_scheduled_time for m in ms], min),
        first_token_time=pick([m.first_token_time for m in ms], min),
        last_token_time=pick([m.last_token_time for m in ms], max),
        finished_time=pick([m.finished_time for m in ms], max),
    )


class _ProgressBar:
    """A tqdm bar on stderr over finished prompts, with the output tokens/s of this call."""

    def __init__(self, total: int, metrics: Any):
        from tqdm import tqdm

        self._metrics = metrics
        self._tokens0 = metrics.num_generated_tokens
        self._t0 = time.perf_counter()
        self._bar = tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        self._bar.set_postfix_str("output 0.0 tok/s", refresh=False)

    def update(self, completed: int) -> None:
        elapsed = time.perf_counter() - self._t0
        tokens = self._metrics.num_generated_tokens - self._tokens0
        rate = tokens / elapsed if elapsed > 0 else 0.0
        self._bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        self._bar.update(completed)  # redraws at most every mininterval, also for 0

    def close(self) -> None:
        self._bar.close()
