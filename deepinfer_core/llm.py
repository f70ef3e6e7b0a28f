"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import RequestError, SamplingParamsError
from deepinfer_core.logging_utils import configure_logging
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.params import SamplingParams

PromptType = str | Mapping[str, Any]


class LLM:
    """An engine for offline batched generation.

    Args:
        model: model directory (``config.json``, safetensors, ``tokenizer.json``); ``None`` = the
            built-in tiny model (created and cached on first use).
        config: a TOML / YAML engine config file.
        backend, dtype, max_num_seqs, max_num_batched_tokens, seed: common engine options.
        kwargs: any other :class:`~deepinfer_core.config.EngineConfig` field.

    Options are merged as defaults < ``config`` file < ``DEEPINFER_*`` environment < arguments;
    an argument left at ``None`` does not override the lower sources.

    Raises:
        ConfigError: invalid option, missing model directory, unreadable config file.
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
        self.engine = LLMEngine(engine_config)
        self._counter = itertools.count()

    @property
    def config(self) -> EngineConfig:
        """The engine's resolved configuration."""
        return self.engine.config

    def get_tokenizer(self) -> Any:
        """The tokenizer (``None`` when the model directory has none)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt; returns one :class:`RequestOutput` per prompt, in prompt order.

        Args:
            prompts: a string, a ``{"prompt_token_ids": [...]}`` dict (optionally with
                ``"prompt"``), or a list mixing both.
            sampling_params: one :class:`SamplingParams` for all prompts, or one per prompt
                (default: ``SamplingParams()``).
            use_tqdm: show a progress bar over finished prompts.

        A prompt that cannot be served (empty, too long) gets ``finish_reason="error"`` and
        ``error`` set; the other prompts are unaffected.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        groups: list[list[str]] = []
        meta: list[tuple[str, str | None, list[int]]] = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            text, ids = self._tokenize(prompt, i)
            rid = str(next(self._counter))
            sub_ids = []
            for k in range(params.n):
                sub_id = rid if params.n == 1 else f"{rid}-{k}"
                self.engine.add_request(sub_id, ids, params, prompt=text, sample_index=k)
                sub_ids.append(sub_id)
            groups.append(sub_ids)
            meta.append((rid, text, ids))
        done = self._run(sum(len(g) for g in groups), len(prompt_list) if use_tqdm else 0)
        return [
            self._merge(rid, text, ids, [done[s] for s in sub])
            for (rid, text, ids), sub in zip(meta, groups, strict=True)
        ]

    def _run(self, num_requests: int, tqdm_total: int) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if tqdm_total:
            from tqdm import tqdm

            bar = tqdm(total=num_requests, desc="generate", unit="req")
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException as e:  # leave the engine clean for the next generate() call
            self.engine.abort_all(f"generate() was interrupted: {type(e).__name__}: {e}")
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
            return prompt, self.engine.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, Sequence) or isinstance(ids, str):
                    raise RequestError(f"prompts[{index}]['prompt_token_ids'] must be a list of ints")
                return prompt.get("prompt"), [int(t) for t in ids]
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.engine.encode(prompt["prompt"])
            raise RequestError(
                f"prompts[{index}] is a dict without 'prompt_token_ids' or 'prompt'; "
                f"got keys {sorted(prompt)}"
            )
        raise RequestError(
            f"prompts[{index}] is a {type(prompt).__name__}; "
            "give a str or a {'prompt_token_ids': [...]} dict"
        )
