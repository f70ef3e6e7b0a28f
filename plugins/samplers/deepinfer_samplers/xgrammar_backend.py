"""The xgrammar structured-output backend: ``choice`` / ``regex`` / ``json`` / ``grammar`` -> token masks.

The same interface as :mod:`deepinfer_samplers.llguidance_backend` (the engine cannot tell them
apart): one :class:`XGrammarBackend` per tokenizer, one :class:`XGrammarMatcher` per request, a
bounded LRU cache of compiled grammars keyed by the spec's canonical text (xgrammar's own
compiler cache is off so that this one is the only bound), invalid specs cached as their error.

xgrammar converts a spec to a grammar and *warns* (on the native stderr) when it drops a
constraint it cannot express, e.g. ``maxLength`` next to ``format`` or ``pattern``,
``multipleOf`` on numbers, ``allOf`` with several branches, a ``oneOf`` whose branches it cannot
prove disjoint (it compiles ``anyOf`` instead), a lookahead in a regex; and it drops many JSON-schema
keywords without a word (:mod:`deepinfer_samplers.xgrammar_schema` says which).  A completion
could then violate the spec, so this backend refuses such specs (the request fails with the
reason) instead: it checks the schema first and reads the conversion's warnings.  A ``oneOf``
whose branches accept disjoint JSON types is compiled as the equal ``anyOf``
(:func:`deepinfer_samplers.json_schema.one_of_as_any_of`).  One xgrammar defect is repaired:
see :data:`_LOOSE_STRING_CHAR`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import xgrammar

from deepinfer_samplers import json_schema, specs
from deepinfer_samplers.xgrammar_schema import unenforced

# the conversion warnings of a `oneOf` compiled as `anyOf`: no backend takes it, so no llguidance advice
_ONE_OF_WARNING = "falling back to anyOf semantics"
# the whitespace characters xgrammar's flexible JSON whitespace allows (its `[ \n\r\t]`)
_JSON_WHITESPACE = frozenset(" \n\r\t")
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: \(.*?\) is false: )?")
_STDERR_LOCK = threading.Lock()
# xgrammar 0.2.9 spells a character of a length-bounded JSON string (minLength / maxLength) as
# this class, which lets raw control characters (U+0000..U+001F but CR, LF) through: invalid JSON.
# The grammar is re-read from its EBNF with the class of its unbounded strings instead.
_LOOSE_STRING_CHAR = '([^\\"\\\\\\r\\n])'
_JSON_STRING_CHAR = '([^\\0-\\x1f\\"\\\\])'


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """xgrammar's ``TokenizerInfo`` for the engine's tokenizer (an HF fast tokenizer).

    The vocabulary type (byte-level, byte-fallback, raw) and the prefix-space flag are detected
    by ``TokenizerInfo.from_huggingface``; the vocabulary is then rebuilt with the special
    (added) tokens blanked, which xgrammar treats as special, so that no grammar can spell text
    with them (xgrammar would otherwise read ``<｜User｜>`` as its text).  The EOS ids are the stop
    tokens (allowed where the grammar accepts)."""
    from transformers import PreTrainedTokenizerFast

    detected = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok),
        vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids),
    )
    special = set(tokenizer.special_token_ids) - set(eos_token_ids)
    encoded = [""] * vocab_size
    for token, i in tokenizer._tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            encoded[i] = token
    return xgrammar.TokenizerInfo(
        encoded,
        vocab_type=detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(eos_token_ids),
        add_prefix_space=detected.add_prefix_space,
    )


class XGrammarBackend(specs.GrammarCache):
    """Compiles :class:`~deepinfer_core.StructuredOutputsParams` into matchers with xgrammar.

    Args:
        tokenizer: the engine's :class:`~deepinfer_core.tokenizer.Tokenizer` (an HF fast tokenizer).
        vocab_size: the model's vocabulary size (the mask's width).
        eos_token_ids: the model's EOS ids (allowed where the grammar accepts).

    The compiled grammars are cached (:class:`~deepinfer_samplers.specs.GrammarCache`:
    ``cache_size``, ``cache_info()``, ``cache_clear()``).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        from deepinfer_core.sampling.penalties import bitmask_of

        self.vocab_size = vocab_size
        self._info = tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        self._compiler = xgrammar.GrammarCompiler(
            self._info, max_threads=max(1, min(8, os.cpu_count() or 1)), cache_enabled=False
        )
        self._batch = xgrammar.BatchGrammarMatcher(max_threads="auto")
        self._eos_row = bitmask_of(eos_token_ids, vocab_size)
        super().__init__()  # entries: CompiledGrammars (or an error message)

    def fill_bitmasks(self, matchers: Sequence[tuple[XGrammarMatcher, int]], bitmask: Any) -> None:
        """Fill row ``i`` of ``bitmask`` (a contiguous CPU int32 ``[B, ceil(V/32)]`` tensor) for
        each ``(matcher, i)``; the live rows in one ``BatchGrammarMatcher`` call that xgrammar
        spreads over its threads (:meth:`XGrammarMatcher.fill_bitmask` says what a row holds)."""
        live, rows = [], []
        for m, i in matchers:
            if m._error is not None:
                bitmask[i].zero_()
            elif m._m.is_terminated():
                bitmask[i] = self._eos_row
            else:
                live.append(m._m)
                rows.append(i)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, indices=rows)

    def matcher(self, spec: Any) -> XGrammarMatcher:
        """A fresh matcher for ``spec``; raises :class:`ValueError` (``"xgrammar: ..."``) when
        the spec is invalid or uses what xgrammar would not enforce.

        The compiled grammar comes from the cache when an equal spec (same :func:`cache_key`)
        was compiled before; every request gets its own matcher over it."""
        # compiled outside the cache lock: xgrammar drops the GIL while compiling
        entry = self.compiled(cache_key(spec), lambda: self._compile(spec))
        return XGrammarMatcher(xgrammar.GrammarMatcher(entry), self.vocab_size, self._eos_row)

    def _compile(self, spec: Any) -> Any:
        """A ``CompiledGrammar`` for ``spec``, or the error message (one line, ``xgrammar: ...``)."""
        try:
            grammar = grammar_of(spec, self._info)
            return self._compiler.compile_grammar(grammar)
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError / TypeError
            return f"xgrammar: {one_line(e)}"

    @staticmethod
    def check_spec(spec: Any) -> None:
        """Convert ``spec`` to an xgrammar grammar without a tokenizer (a Lark grammar's special
        tokens are then not resolved); :class:`ValueError` (``"xgrammar: ..."``, one line) when
        it is invalid or uses what xgrammar would not enforce."""
        try:
            grammar_of(spec, None)
        except Exception as e:
            raise ValueError(f"xgrammar: {one_line(e)}") from None


def grammar_of(spec: Any, info: Any) -> Any:
    """The ``xgrammar.Grammar`` of ``spec`` (``info``: the ``TokenizerInfo`` a Lark grammar's
    special tokens are resolved with, or ``None``); :class:`ValueError` when it is unsupported."""
    if spec.choice is not None:
        return _convert(lambda: xgrammar.Grammar.from_ebnf(choice_ebnf(spec.choice)), "choice")
    if spec.regex is not None:
        return _convert(lambda: xgrammar.Grammar.from_regex(spec.regex), "regex")
    if spec.grammar is not None:
        text = spec.grammar
        if "::=" in text:
            try:
                return _convert(lambda: xgrammar.Grammar.from_ebnf(text, root_rule_name="root"), "GBNF")
            except RuntimeError as e:
                raise ValueError(f"invalid GBNF grammar (start rule 'root'): {one_line(e)}") from None
        if "x-guidance" in text:  # xgrammar's %json ignores llguidance's JSON options
            raise ValueError(
                "the Lark grammar's x-guidance JSON options are llguidance's (xgrammar would ignore "
                "them): use backend='llguidance'"
            )
        try:
            return _convert(lambda: xgrammar.Grammar.from_lark(text, tokenizer_info=info), "Lark grammar")
        except RuntimeError as e:
            raise ValueError(
                f"cannot compile this Lark grammar: {one_line(e)}; "
                "xgrammar's Lark is a subset of llguidance's: use backend='llguidance'"
            ) from None
    schema_text = json_text(spec.json)
    try:
        schema = json.loads(schema_text)
    except ValueError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if schema is False:
        raise ValueError("the JSON schema false accepts no value")
    if '"oneOf"' in schema_text:
        schema = json_schema.one_of_as_any_of(schema)
        schema_text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    problem = unenforced(schema)
    if problem is not None:
        raise ValueError(problem)
    options = json_options(spec)
    grammar = _convert(lambda: xgrammar.Grammar.from_json_schema(schema_text, **options), "JSON schema")
    text = str(grammar)
    if _LOOSE_STRING_CHAR in text:  # control characters are not JSON string characters
        grammar = xgrammar.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
    return grammar


def _convert(build: Callable[[], Any], what: str) -> Any:
    """``build()`` (an xgrammar ``Grammar`` constructor) with its native warnings read; raises
    :class:`ValueError` naming the first warning that means a constraint was dropped."""
    grammar, warnings = _with_native_warnings(build)
    if warnings:
        advice = "use backend='llguidance'"
        if _ONE_OF_WARNING in warnings[0]:
            advice = "make the branches disjoint (different types, or a property with a different const each)"
        raise ValueError(f"it would not enforce this {what}: {warnings[0]}; {advice}")
    return grammar


def _with_native_warnings(build: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run ``build()`` with the process's stderr (fd 2, where xgrammar's C++ logging writes)
    redirected to a file; returns the result and the ``Warning:`` lines, writing everything else
    back to stderr.  Without a usable fd 2 it just runs ``build()``."""
    with _STDERR_LOCK:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            return build(), []
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                result = build()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                tmp.seek(0)
                text = tmp.read().decode("utf-8", errors="replace")
        warnings, other = [], []
        for line in text.splitlines(keepends=True):
            if "Warning: " in line:
                warnings.append(line.split("Warning: ", 1)[1].strip())
            else:
                other.append(line)
        if other:
            os.write(2, "".join(other).encode())
        return result, warnings


def one_line(e: BaseException) -> str:
    """An xgrammar error as one line: its C++ log prefix and any context lines dropped."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return _LOG_PREFIX.sub("", lines[0]) if lines else type(e).__name__


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (each an escaped literal)."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


def ebnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal: printable ASCII as is (``"`` and ``\\`` escaped), every
    other character as ``\\uXXXX`` / ``\\UXXXXXXXX``."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def json_text(schema: dict[str, Any] | str) -> str:
    """:func:`deepinfer_samplers.specs.json_text` for this backend."""
    return specs.json_text(schema, "xgrammar")


def cache_key(spec: Any) -> tuple[str, ...]:
    """The canonical cache key of ``spec`` (:func:`deepinfer_samplers.specs.cache_key`) with this
    backend's JSON whitespace options."""
    return specs.cache_key(spec, [spec.disable_any_whitespace, spec.whitespace_pattern], "xgrammar")


def json_options(spec: Any) -> dict[str, Any]:
    """``Grammar.from_json_schema`` options for the spec's whitespace settings: compact JSON for
    ``disable_any_whitespace``, else xgrammar's flexible whitespace (``[ \\n\\r\\t]``) bounded as
    ``whitespace_pattern`` (default :data:`~deepinfer_core.sampling.params.DEFAULT_JSON_WHITESPACE`,
    at most 4 per gap) says; :class:`ValueError` naming ``whitespace_pattern`` when it is not
    such a pattern."""
    compact = {"any_whitespace": False, "separators": (",", ":")}
    if spec.disable_any_whitespace:
        return compact
    from deepinfer_core.sampling.params import DEFAULT_JSON_WHITESPACE

    pattern = spec.whitespace_pattern if spec.whitespace_pattern is not None else DEFAULT_JSON_WHITESPACE
    bound = whitespace_bound(pattern)
    if bound == 0:
        return compact
    if bound is None:
        return {"any_whitespace": True}
    return {"any_whitespace": True, "max_whitespace_cnt": bound}


def whitespace_bound(pattern: str) -> int | None:
    """The most whitespace characters per gap that ``pattern`` allows, when it is one class of
    exactly space, tab, CR and LF (any spelling: ``[ \\t\\n\\r]``, ``[\\x20\\x0A\\x0D\\x09]``)
    repeated ``{0,N}`` (N) or ``*`` (``None``: unbounded); ``""`` allows none (0).  Raises
    :class:`ValueError` naming ``whitespace_pattern`` for any other pattern (xgrammar's JSON
    whitespace is that class, only its count can be bounded)."""
    if pattern == "":
        return 0
    m = re.fullmatch(r"(\[[^\]]+\])(\*|\{0?,([0-9]+)\})", pattern)
    chars = None
    if m is not None:
        try:
            cls = re.compile(m.group(1))
            chars = {chr(c) for c in range(0x3001) if cls.fullmatch(chr(c))}
        except re.error:
            chars = None
    if chars != _JSON_WHITESPACE:
        raise ValueError(
            f"whitespace_pattern={pattern!r} is not supported: xgrammar takes only "
            "[ \\t\\n\\r]{0,N} or [ \\t\\n\\r]* (or disable_any_whitespace); use backend='llguidance'"
        )
    return None if m.group(3) is None else int(m.group(3))


class XGrammarMatcher:
    """One request's grammar state; :attr:`num_consumed` output tokens consumed so far.

    It mirrors :class:`~deepinfer_samplers.llguidance_backend.LLGuidanceMatcher`: a token the
    grammar forbids puts it in an error state (:attr:`error`; xgrammar itself would just refuse
    the token), tokens after the grammar finished (its EOS accepted) or after an error are
    counted but ignored, and :meth:`rollback` undoes consumed tokens, the ignored ones too.
    """

    def __init__(self, matcher: Any, vocab_size: int, eos_row: Any) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._eos_row = eos_row
        self.num_consumed = 0
        self._advanced: list[bool] = []  # per consumed token: whether xgrammar took it
        self._error: str | None = None
        self._error_at = 0  # the output position of the token that caused _error

    def consume(self, token_ids: Sequence[int]) -> None:
        """Advance over sampled tokens (tokens after the grammar finished are ignored)."""
        for t in token_ids:
            took = False
            if self._error is None and not self._m.is_terminated():
                took = bool(self._m.accept_token(int(t)))
                if not took:
                    self._error = (
                        f"xgrammar: token {int(t)} at output position {self.num_consumed} is not "
                        "allowed by the grammar"
                    )
                    self._error_at = self.num_consumed
            self._advanced.append(took)
            self.num_consumed += 1

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar accepts from the current state (draft
        tokens of speculative decoding), without consuming them."""
        if self._error is not None or self._m.is_terminated():
            return 0
        n = 0
        for t in token_ids:
            if not self._m.accept_token(int(t)):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` :meth:`consume` d tokens (rejected drafts)."""
        if num_tokens <= 0:
            return
        if num_tokens > self.num_consumed:
            raise ValueError(f"xgrammar: cannot roll back {num_tokens} tokens, {self.num_consumed} consumed")
        undone = self._advanced[-num_tokens:]
        del self._advanced[-num_tokens:]
        self.num_consumed -= num_tokens
        steps = sum(undone)
        if steps:
            self._m.rollback(steps)
        if self._error is not None and self._error_at >= self.num_consumed:
            self._error = None

    def fill_bitmask(self, row: Any) -> None:
        """Write the tokens the grammar allows next into ``row`` (a contiguous CPU int32 tensor
        of ``ceil(V/32)`` words, bit ``t % 32`` of word ``t // 32`` for token ``t``): EOS only
        where the grammar accepts, only EOS once it is finished; all zeros in an error state."""
        if self._error is not None:
            row.zero_()
        elif self._m.is_terminated():
            row.copy_(self._eos_row)
        else:
            self._m.fill_next_token_bitmask(row[None], 0)

    def allowed_token_ids(self) -> list[int]:
        """The ids :meth:`fill_bitmask` allows, as a list (for inspection and tests)."""
        import torch

        from deepinfer_core.sampling.penalties import bitmask_words, unpack_bitmask

        row = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        self.fill_bitmask(row)
        return unpack_bitmask(row[None], self.vocab_size)[0].nonzero().flatten().tolist()

    def is_stopped(self) -> bool:
        """Whether the grammar finished: its EOS was consumed where the grammar accepts."""
        return self._error is None and bool(self._m.is_terminated())

    @property
    def error(self) -> str | None:
        return self._error
