"""Incremental detokenisation: generated token ids -> text deltas, one step at a time.

Decoding each new token alone is wrong for byte-level BPE (a character may span tokens) and
decoding the whole output every step is quadratic.  As in vLLM, the detokenizer keeps two
offsets into the token list: it decodes ``tokens[prefix:read]`` (text already emitted) and
``tokens[prefix:]``; the new text is the difference, emitted only when it does not end in
an incomplete UTF-8 sequence (``"\\ufffd"``), otherwise held back until the next token completes
it.  A few prompt tokens seed the context so that the first generated token decodes as it
would after the prompt (leading spaces of sentencepiece-style tokenizers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens used as decoding context for the first generated tokens.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    """The part of :class:`deepinfer_core.tokenizer.Tokenizer` the detokenizer needs."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of one request's generated tokens, built incrementally.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens)``.
        prompt_token_ids: the prompt (its last tokens are decoding context, never output).
        skip_special_tokens: leave special tokens out of the text.

    Attributes:
        output_text: the text emitted so far (possibly truncated by :meth:`truncate`).
    """

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def step(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; returns the text they complete (possibly ``""``)."""
        self._ids.extend(token_ids)
        return self._emit(force=False)

    def flush(self) -> str:
        """Emit the text held back for an incomplete character (at the end of generation)."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if not force and (len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE)):
            return ""  # no new text yet, or a character still incomplete: wait for more tokens
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.output_text += delta
        return delta

    def truncate(self, length: int) -> None:
        """Cut :attr:`output_text` to ``length`` characters (stop strings, stop-token text)."""
        self.output_text = self.output_text[:length]
