"""The llguidance structured-output backend: ``choice`` / ``regex`` / ``json`` / ``grammar`` -> token masks.

The engine builds one :class:`LLGuidanceBackend` per tokenizer (building llguidance's tokenizer
costs about a second) and one :class:`LLGuidanceMatcher` per request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance


class LLGuidanceBackend:
    """Compiles :class:`~deepinfer_core.StructuredOutputsParams` into matchers.

    Args:
        tokenizer: the engine's :class:`~deepinfer_core.tokenizer.Tokenizer` (an HF fast tokenizer).
        vocab_size: the model's vocabulary size (the mask's width).
        eos_token_ids: the model's EOS ids (allowed where the grammar accepts).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tok = llguidance.LLTokenizer(
            tokenizer._tok.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )

    def matcher(self, spec: Any) -> LLGuidanceMatcher:
        """A fresh matcher for ``spec``; raises :class:`ValueError` when the grammar is invalid."""
        if spec.choice is not None:
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec.choice)
            )
        elif spec.regex is not None:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
        elif spec.grammar is not None:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark_grammar(spec.grammar))
        else:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options(spec))
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return LLGuidanceMatcher(m, self.vocab_size)


def lark_grammar(text: str) -> str:
    """``text`` as Lark: GBNF (it has ``::=``) is converted with llguidance's converter."""
    if "::=" not in text:
        return text
    try:
        from llguidance.gbnf_to_lark import gbnf_to_lark
    except ImportError:  # pragma: no cover - older llguidance
        raise ValueError("GBNF grammars need llguidance with gbnf_to_lark; give a Lark grammar") from None
    try:
        return gbnf_to_lark(text)
    except Exception as e:
        raise ValueError(f"invalid GBNF grammar: {e}") from None


def json_options(spec: Any) -> dict[str, Any]:
    """llguidance JSON compile options for the spec's whitespace settings (they override the
    schema's ``x-guidance``)."""
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    from deepinfer_core.sampling.params import DEFAULT_JSON_WHITESPACE

    pattern = spec.whitespace_pattern if spec.whitespace_pattern is not None else DEFAULT_JSON_WHITESPACE
    return {"whitespace_flexible": True, "whitespace_pattern": pattern}


class LLGuidanceMatcher:
    """One request's grammar state; :attr:`num_consumed` output tokens consumed so far."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0

    def consume(self, token_ids: Sequence[int]) -> None:
        """Advance over sampled tokens (tokens after the grammar finished are ignored)."""
        for t in token_ids:
            self.num_consumed += 1
            if not self._m.is_stopped():
                self._m.consume_token(int(t))

    def fill_bitmask(self, row: Any) -> None:
        """Write the tokens the grammar allows next into ``row`` (a contiguous CPU int32 tensor
        of ``ceil(V/32)`` words, bit ``t % 32`` of word ``t // 32`` for token ``t``): EOS only
        where the grammar accepts, only EOS once it is finished; all zeros in an error state."""
        if self._m.is_error():
            row.zero_()
            return
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def allowed_token_ids(self) -> list[int]:
        """The ids the grammar allows next (EOS only where it accepts; only EOS once it is finished);
        empty when the matcher is in an error state."""
        if self._m.is_error():
            return []
        mask = self._m.compute_bitmask()
        out = []
        for byte_index, byte in enumerate(mask):
            if byte:
                base = byte_index * 8
                out.extend(base + b for b in range(8) if byte >> b & 1 and base + b < self.vocab_size)
        return out

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None
