"""The llguidance structured-output backend: ``choice`` / ``regex`` / ``json`` / ``grammar`` -> token masks.

The engine builds one :class:`LLGuidanceBackend` per tokenizer (building llguidance's tokenizer
costs about a second) and one :class:`LLGuidanceMatcher` per request.  The backend keeps a
bounded LRU cache of compiled grammars keyed by the spec's canonical text, so a repeated spec
(the common case: many requests with one schema) costs a ``deep_copy()`` of a compiled,
never-advanced ``llguidance.LLMatcher`` instead of a compile; an invalid spec is cached as its
error message, so a repeated bad spec fails fast with the same message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import llguidance

from deepinfer_samplers import json_schema, specs
from deepinfer_samplers.specs import DEFAULT_CACHE_SIZE, CacheInfo

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "CacheInfo",
    "LLGuidanceBackend",
    "LLGuidanceMatcher",
    "cache_key",
    "grammar_text",
    "json_text",
    "one_line",
]


class LLGuidanceBackend(specs.GrammarCache):
    """Compiles :class:`~deepinfer_core.StructuredOutputsParams` into matchers.

    Args:
        tokenizer: the engine's :class:`~deepinfer_core.tokenizer.Tokenizer` (an HF fast tokenizer).
        vocab_size: the model's vocabulary size (the mask's width).
        eos_token_ids: the model's EOS ids (allowed where the grammar accepts).

    The compiled grammars are cached (:class:`~deepinfer_samplers.specs.GrammarCache`:
    ``cache_size``, ``cache_info()``, ``cache_clear()``).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tok = llguidance.LLTokenizer(
            tokenizer._tok.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        super().__init__()  # entries: compiled, never-advanced LLMatchers (or an error message)
        self._executor = llguidance.LLExecutor()

    def fill_bitmasks(self, matchers: Sequence[tuple[LLGuidanceMatcher, int]], bitmask: Any) -> None:
        """Fill row ``i`` of ``bitmask`` (a contiguous CPU int32 ``[B, ceil(V/32)]`` tensor) for
        each ``(matcher, i)``, all rows in one call that llguidance spreads over its threads
        (:meth:`LLGuidanceMatcher.fill_bitmask` says what a row holds)."""
        import llguidance.torch

        ready = []
        for m, i in matchers:
            if m._m.is_error():
                bitmask[i].zero_()
            else:
                ready.append((m._m, i))
        if ready:
            llguidance.torch.fill_next_token_bitmask_par(self._executor, ready, bitmask)

    def matcher(self, spec: Any) -> LLGuidanceMatcher:
        """A fresh matcher for ``spec``; raises :class:`ValueError` when the grammar is invalid.

        The compiled grammar comes from the cache when an equal spec (same canonical key, see
        :func:`cache_key`) was compiled before; every request gets its own ``deep_copy()``.
        """
        entry = self.compiled(cache_key(spec), lambda: self._compile(spec))
        return LLGuidanceMatcher(entry.deep_copy(), self.vocab_size)

    def _compile(self, spec: Any) -> Any:
        """A compiled, never-advanced ``llguidance.LLMatcher`` for ``spec``, or the error message."""
        try:
            grammar = grammar_text(spec)
        except ValueError as e:
            return one_line(str(e), spec)
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            return one_line(m.get_error(), spec)
        return m

    @staticmethod
    def check_spec(spec: Any) -> None:
        """Compile ``spec`` without a tokenizer; :class:`ValueError` with the one-line reason
        when it is invalid (what :meth:`matcher` would say)."""
        try:
            grammar = grammar_text(spec)
        except ValueError as e:
            raise ValueError(one_line(str(e), spec)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(one_line(messages[0], spec))


def grammar_text(spec: Any) -> str:
    """llguidance's grammar for ``spec`` (not yet validated); :class:`ValueError` when the spec
    cannot even be turned into one (a JSON schema llguidance rejects, a bad GBNF grammar).  A
    ``oneOf`` whose branches cannot overlap becomes ``anyOf``
    (:func:`deepinfer_samplers.json_schema.one_of_as_any_of_text`)."""
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choice)))
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(lark_grammar(spec.grammar))
    schema = json_text(spec.json)
    if schema == "true":  # the schema that accepts any value; options need an object
        schema = "{}"
    elif schema == "false":
        raise ValueError("the JSON schema false accepts no value")
    elif '"oneOf"' in schema:
        schema = json_schema.one_of_as_any_of_text(schema)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options(spec))


# llguidance's position prefix, ``1(8): `` or ``at 1(8): ``: line 1, column 8 of its grammar text
_POSITION = re.compile(r"^(?:at )?([0-9]+)\(([0-9]+)\): ")
_ONE_OF = "oneOf constraints are not supported"


def one_line(message: str, spec: Any) -> str:
    """An llguidance error as one line: its first line without the grammar dump that follows
    (source lines and carets), a regex parse error's own reason appended, and a position kept
    only where it points into the user's text (a Lark grammar as given)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid"
    if _ONE_OF in lines[0]:  # its advice names an option of llguidance's, not ours
        return (
            "oneOf whose branches may overlap is not supported: make them disjoint (different "
            "types, or a property with a different const in each) or use anyOf"
        )
    head = lines[0].replace(" (in regex)", "").removesuffix("regex parse error:").rstrip(" :")
    if not head and len(lines) > 1:  # a JSON-schema pattern: the regex is the next line
        head = f"invalid regex {lines[1]!r}"
    reason = next((line.removeprefix("error: ") for line in lines[1:] if line.startswith("error: ")), None)
    at = _POSITION.match(head)
    if at is not None:
        own = spec.grammar is not None and "::=" not in spec.grammar  # not a generated grammar
        where = f"line {at.group(1)}, column {at.group(2)}: " if own else ""
        head = where + head[at.end() :]
    return f"{head}: {reason}" if reason else head


def json_text(schema: dict[str, Any] | str) -> str:
    """:func:`deepinfer_samplers.specs.json_text` for this backend."""
    return specs.json_text(schema, "llguidance")


def cache_key(spec: Any) -> tuple[str, ...]:
    """The canonical cache key of ``spec`` (:func:`deepinfer_samplers.specs.cache_key`) with this
    backend's JSON whitespace options."""
    return specs.cache_key(spec, json_options(spec), "llguidance")


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

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from the current state (draft
        tokens of speculative decoding), without consuming them."""
        if self._m.is_stopped() or self._m.is_error():
            return 0
        return int(self._m.validate_tokens([int(t) for t in token_ids]))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` :meth:`consume` d tokens (rejected drafts)."""
        self._m.rollback(num_tokens)
        self.num_consumed -= num_tokens

    def fill_bitmask(self, row: Any) -> None:
        """Write the tokens the grammar allows next into ``row`` (a contiguous CPU int32 tensor
        of ``ceil(V/32)`` words, bit ``t % 32`` of word ``t // 32`` for token ``t``): EOS only
        where the grammar accepts, only EOS once it is finished; all zeros in an error state."""
        if self._m.is_error():
            row.zero_()
            return
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def allowed_token_ids(self) -> list[int]:
        """The ids :meth:`fill_bitmask` allows, as a list (for inspection and tests)."""
        import torch

        from deepinfer_core.sampling.penalties import bitmask_words, unpack_bitmask

        row = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        self.fill_bitmask(row)
        return unpack_bitmask(row[None], self.vocab_size)[0].nonzero().flatten().tolist()

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None
