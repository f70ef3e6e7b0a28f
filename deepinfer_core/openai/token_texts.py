"""The text of single token ids for logprobs entries, decoded once and cached."""

from __future__ import annotations

from typing import Any

MAX_CACHED = 1 << 16
"""Most token texts kept (the vocabulary of a real model is larger than a batch ever sees)."""


class TokenTexts:
    """Called with a token id: the token's text as the tokenizer decodes it alone (special tokens
    kept), or ``token_id:<id>`` without a tokenizer; the first :data:`MAX_CACHED` distinct ids
    are cached."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < MAX_CACHED:
                self._cache[token_id] = text
        return text
