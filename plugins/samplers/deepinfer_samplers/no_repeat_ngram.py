"""The ``no_repeat_ngram`` logits processor: no n-gram occurs twice in prompt + completion.

``SamplingParams(logits_processors={"no_repeat_ngram": {"size": 3}})`` bans, at every step, each
token that would complete an n-gram (``size`` tokens) already present in the request's prompt
and output — HF ``generate``'s ``no_repeat_ngram_size``.  Per request it keeps a map from each
``(size - 1)``-gram seen to the tokens that followed it, updated as tokens are accepted; a step
costs one dict lookup per request and one scatter on the device.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from deepinfer_core.sampling.logits_processors import LogitsProcessor


class _State:
    def __init__(self, size: int, prompt: Sequence[int]) -> None:
        self.size = size
        self.tokens: list[int] = []
        self.followers: defaultdict[tuple[int, ...], set[int]] = defaultdict(set)
        self.added: list[bool] = []  # per token: whether it added a new follower (for rollback)
        self.extend(prompt)

    def extend(self, token_ids: Sequence[int]) -> None:
        n = self.size
        for t in token_ids:
            self.tokens.append(int(t))
            new = False
            if len(self.tokens) >= n:
                followers = self.followers[tuple(self.tokens[-n:-1])]
                new = self.tokens[-1] not in followers
                followers.add(self.tokens[-1])
            self.added.append(new)

    def rollback(self, num_tokens: int) -> None:
        n = self.size
        for _ in range(num_tokens):
            if self.added.pop():
                self.followers[tuple(self.tokens[-n:-1])].discard(self.tokens[-1])
            self.tokens.pop()

    def banned(self) -> set[int]:
        n = self.size
        if len(self.tokens) < n - 1:
            return set()
        key = tuple(self.tokens[len(self.tokens) - n + 1 :])
        return self.followers.get(key, set())


class NoRepeatNgram(LogitsProcessor):
    """Ban tokens that would repeat an n-gram of the prompt + output (argument ``size`` >= 1)."""

    supports_rollback = True

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self._states: dict[str, _State] = {}

    def add_request(self, request_id: str, args: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        unknown = sorted(set(args) - {"size"})
        if unknown:
            raise ValueError(f"unknown arguments {unknown}; takes 'size'")
        size = args.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"'size' must be an int >= 1, got {size!r}")
        self._states[request_id] = _State(size, prompt_token_ids)

    def on_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._states[request_id].extend(token_ids)

    def on_rollback(self, request_id: str, num_tokens: int) -> None:
        self._states[request_id].rollback(num_tokens)

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str | None]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for i, rid in enumerate(request_ids):
            if rid is not None:
                banned = self._states[rid].banned()
                rows += [i] * len(banned)
                cols += sorted(banned)
        if rows:
            index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device, non_blocking=True)
            logits = logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))
        return logits
