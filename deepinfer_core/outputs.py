"""What :meth:`deepinfer_core.LLM.generate` returns (shaped like vLLM's outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: which of the prompt's ``n`` completions this is.
        text: the generated text (special tokens skipped; a final stop / EOS token is not included).
        token_ids: the generated token ids, including a final stop / EOS token.
        finish_reason: ``"stop"`` (EOS or a stop token), ``"length"`` (``max_tokens`` or
            ``max_model_len`` reached), ``"error"`` (see :attr:`RequestOutput.error`),
            ``"abort"`` (aborted; ``token_ids`` holds the tokens generated before) or ``None``
            while unfinished.
        logprobs: when ``SamplingParams.logprobs`` is set, one ``{token_id: logprob}`` per generated
            token holding the top-``logprobs`` tokens and the sampled one; else ``None``.
        cumulative_logprob: with ``logprobs`` set, the sum of the sampled tokens' logprobs; else ``None``.
        stop_reason: the stop token id or stop string that ended the completion; ``None`` for
            EOS, length or errors.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """Whether this completion is done."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request (``time.monotonic()`` seconds), as vLLM's ``RequestMetrics``.

    Attributes:
        arrival_time: when the request was added to the engine.
        first_scheduled_time: when it was first scheduled (``None`` if never).
        first_token_time: when its first token was sampled (``None`` if none was).
        last_token_time: when its latest token was sampled (``None`` if none was).
        finished_time: when it finished (``None`` while unfinished).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to first scheduling."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: seconds from arrival to the first sampled token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Seconds from arrival to finish."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The result of one prompt.

    Attributes:
        request_id: the engine's id of the request.
        prompt: the prompt text (``None`` when given as token ids).
        prompt_token_ids: the prompt's token ids.
        outputs: the completions, ``outputs[i].index == i``.
        finished: whether every completion is done.
        error: why the request failed (``finish_reason == "error"``), else ``None``.
        prompt_logprobs: when ``SamplingParams.prompt_logprobs`` is set, ``None`` for the first
            prompt token then, per prompt token, ``{token_id: logprob}`` of the actual token plus
            the ``prompt_logprobs`` most likely ones; else ``None``.
        metrics: the request's timestamps (with ``n > 1``: earliest arrival and first token,
            latest finish over the samples).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
