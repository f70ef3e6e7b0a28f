"""The state of one request as it moves through the engine."""

from __future__ import annotations

import enum
from collections.abc import Collection

import torch

from deepinfer_core.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    """WAITING (queued or preempted) -> RUNNING (holds a slot and pages) -> FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One prompt being completed (one sample of it when ``n > 1``).

    The tokens of the sequence are ``prompt_token_ids + output_token_ids``; the first
    ``num_computed_tokens`` of them are in the cache.  A request with ``num_tokens -
    num_computed_tokens == 1`` is decoding; with more, it is prefilling (or recomputing after
    a preemption).

    Attributes:
        request_id: unique id.
        prompt: the prompt text, if given as text.
        prompt_token_ids: the prompt's tokens.
        params: its sampling parameters.
        generator: the request's own RNG (``None`` for greedy requests).
        output_token_ids: generated tokens so far.
        logprobs: per generated token ``{token_id: logprob}`` when ``params.logprobs`` is set.
        status, finish_reason (``"stop"``, ``"length"``, ``"error"``), error (message).
        seq_slot: the cache slot while RUNNING, else ``None``.
        block_table: cache page ids covering the computed positions.
        num_preemptions: how often it was sent back to WAITING.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        generator: torch.Generator | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.seq_slot: int | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # prefix caching / SWA bounded replay (managed by the scheduler)
        self.page_hashes: list[int] = []  # chained hashes of the leading full pages, in order
        self.cached_until = 0  # positions below have cached paged state (a prefix hit)
        self.window_from = 0  # first position computed since (re)admission: the replay start

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the cache (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the request is done (completed, capped or failed)."""
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(start - p, 0) : end - p]

    def finish(self, reason: str, error: str | None = None) -> None:
        """Mark finished with ``reason``; the caller frees the cache it held."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def append_token(
        self,
        token_id: int,
        logprobs: dict[int, float] | None,
        eos_token_ids: Collection[int],
        max_model_len: int,
    ) -> bool:
        """Append a sampled token and decide whether the request is done; returns ``True`` if so.

        Finishes with ``"stop"`` on an EOS token (unless ``ignore_eos``) or a ``stop_token_ids``
        token, else with ``"length"`` at ``max_tokens`` or when the sequence reaches
        ``max_model_len`` tokens.
        """
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if (
            token_id in eos_token_ids and not self.params.ignore_eos
        ) or token_id in self.params.stop_token_ids:
            self.finish("stop")
        elif len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self.finish("length")
        return self.is_finished
