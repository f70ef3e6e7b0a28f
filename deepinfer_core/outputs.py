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
            ``max_model_len`` reached), ``"error"`` (see :attr:`RequestOutput.error`) or ``None``
            while unfinished.
        logprobs: when ``SamplingParams.logprobs`` is set, one ``{token_id: logprob}`` per generated
            token holding the top-``logprobs`` tokens and the sampled one; else ``None``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        """Whether this completion is done."""
        return self.finish_reason is not None


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
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
