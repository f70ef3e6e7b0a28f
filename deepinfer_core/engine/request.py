"""The state of one request as it moves through the engine."""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import Any

from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.engine.stop import check_stop
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
        sampling_seed: keys the counter-based sampling noise (with the position of each token);
            the engine derives it from ``params.seed`` or from the engine seed.
        detokenizer: builds the output text incrementally (``None`` without a tokenizer).
        output_token_ids: generated tokens so far.
        logprobs: per generated token ``{token_id: logprob}`` when ``params.logprobs`` is set.
        cumulative_logprob: sum of the sampled tokens' logprobs (when ``params.logprobs`` is set).
        prompt_logprobs: when ``params.prompt_logprobs`` is set, ``None`` then one
            ``{token_id: logprob}`` per prompt token after the first, filled as prefill runs.
        status, finish_reason (``"stop"``, ``"length"``, ``"error"``), error (message).
        stop_reason: the stop token id or stop string that finished it, else ``None``.
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
        sampling_seed: int = 0,
        detokenizer: IncrementalDetokenizer | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.sampling_seed = sampling_seed
        self.detokenizer = detokenizer
        self.output_token_ids: list[int] = []
        # grammar state of a request with structured outputs (set by the engine), else None
        self.structured_matcher: Any = None
        self.logits_processors: list[str] = []  # names of the processors it joined (engine)
        self.processed_tokens = 0  # output tokens already passed to their on_tokens
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.seq_slot: int | None = None
        self.block_table: list[int] = []
        self.table_version = 0  # bumped whenever block_table is replaced (not appended to)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # prefix caching / SWA bounded replay (managed by the scheduler)
        self.page_hashes: list[int] = []  # chained hashes of the leading full pages, in order
        self.cached_until = 0  # positions below have cached paged state (a prefix hit)
        self.window_from = 0  # first position computed since (re)admission: the replay start
        # async scheduling: a token sampled by a step whose outputs are not processed yet
        self.num_pending = 0  # 0, 1, or 2 between scheduling step N+1 and processing step N
        self.pending_row = -1  # its row in that step's sampled-token tensor
        # speculative decoding: tokens proposed to verify in the next step (set by the engine)
        self.draft_token_ids: list[int] = []

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
        """Tokens not yet in the cache (1 while decoding), counting a pending sampled token."""
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    def will_finish_by_length(self, max_model_len: int) -> bool:
        """Whether the pending token already completes ``max_tokens`` or ``max_model_len``
        (so the request needs no further step)."""
        if not self.num_pending:
            return False
        n_out = len(self.output_token_ids) + self.num_pending
        return n_out >= self.params.max_tokens or self.num_tokens + self.num_pending >= max_model_len

    @property
    def output_text(self) -> str:
        """The generated text so far (``""`` without a tokenizer)."""
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def needs_prompt_logits(self, start: int, end: int) -> bool:
        """Whether a chunk over positions ``[start, end)`` must return every row's logits: some
        position ``p`` in it predicts a prompt token ``p + 1`` whose logprobs are still missing."""
        if self.prompt_logprobs is None:
            return False
        first_missing = len(self.prompt_logprobs) - 1  # the position predicting the next entry
        return first_missing < self.num_prompt_tokens - 1 and start <= first_missing < end

    def add_prompt_logprobs(self, start: int, entries: list[dict[int, float]]) -> None:
        """Record ``entries[j]``, the logprobs of prompt token ``start + j + 1``, where missing."""
        assert self.prompt_logprobs is not None
        for j, entry in enumerate(entries):
            if start + j + 1 == len(self.prompt_logprobs) < self.num_prompt_tokens:
                self.prompt_logprobs.append(entry)

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
        """Append a sampled token, detokenise it and decide whether the request is done (``True``).

        The finish check is :func:`deepinfer_core.engine.stop.check_stop`: EOS (unless
        ``ignore_eos``), stop ids and stop strings once ``min_tokens`` are generated give
        ``"stop"``; ``max_tokens`` or ``max_model_len`` give ``"length"``.
        """
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]
        new_text = self.detokenizer.step([token_id]) if self.detokenizer is not None else ""
        params = self.params
        if (
            not params.stop
            and not params.stop_token_ids
            and (params.ignore_eos or token_id not in eos_token_ids)
        ):
            # nothing but the length caps can stop it (check_stop's answer, without the call)
            n_out = len(self.output_token_ids)
            if n_out < params.max_tokens and len(self.prompt_token_ids) + n_out < max_model_len:
                return False
        decision = check_stop(
            self.params,
            token_id,
            len(self.output_token_ids),
            self.num_tokens,
            self.output_text,
            len(new_text),
            eos_token_ids,
            max_model_len,
        )
        if decision.finish_reason is None:
            return False
        if self.detokenizer is not None:
            if decision.truncate_to is not None:
                self.detokenizer.truncate(decision.truncate_to)
            elif decision.finish_reason == "length":
                self.detokenizer.flush()
        self.stop_reason = decision.stop_reason
        self.finish(decision.finish_reason)
        return True
