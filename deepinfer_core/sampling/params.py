"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.errors import SamplingParamsError
from deepinfer_core.sampling.logits_processors import normalize_processor_args

# vLLM fields that DeepInfer will accept in a later release; named in the error so that users
# know the option exists but is not implemented yet.
_NOT_YET = (
    "best_of",
    "bad_words",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
)

# vLLM clamps logit biases to this range.
_MAX_BIAS = 100.0


DEFAULT_JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,4}"
"""The whitespace allowed between JSON tokens when ``whitespace_pattern`` is not given."""


@dataclass
class StructuredOutputsParams:
    """Constrain a completion to a grammar (vLLM's ``StructuredOutputsParams``); exactly one of:

    Attributes:
        choice: the completion is exactly one of these strings.
        regex: the completion matches this regular expression (llguidance's Rust regex syntax).
        json: the completion is JSON matching this schema (a dict or its JSON text).
        grammar: the completion matches this grammar: Lark (llguidance's format, start rule
            ``start``) or GBNF (detected by ``::=``, start rule ``root``; converted to Lark).
        disable_any_whitespace: JSON only: no whitespace at all outside strings (compact JSON).
        whitespace_pattern: JSON only: regex for the whitespace allowed between JSON tokens.
            ``None`` (default) = at most :data:`DEFAULT_JSON_WHITESPACE` (up to 4 spaces, tabs or
            newlines per gap), so a weak model cannot emit whitespace until ``max_tokens``.

    The engine compiles it with the grammar backend registered under ``backend`` through
    ``deepinfer_register_structured_backends`` (default ``"llguidance"``, from the samplers
    plugin: ``pip install -e 'plugins/samplers[structured]'`` from the repository root).  EOS
    is allowed only where the grammar accepts, and is the only token allowed once the grammar
    is finished.

    Raises:
        SamplingParamsError: not exactly one of ``choice`` / ``regex`` / ``json`` / ``grammar``,
            or a bad value.
    """

    choice: list[str] | None = None
    regex: str | None = None
    json: dict[str, Any] | str | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    backend: str = "llguidance"

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        given = [n for n in ("choice", "regex", "json", "grammar") if getattr(self, n) is not None]
        if len(given) != 1:
            raise SamplingParamsError(
                "StructuredOutputsParams needs exactly one of choice / regex / json / grammar, "
                f"got {given or 'none'}"
            )
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise SamplingParamsError(
                "StructuredOutputsParams.grammar must be a non-empty str (Lark or GBNF), "
                f"got {self.grammar!r}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError(
                "StructuredOutputsParams.disable_any_whitespace must be a bool, "
                f"got {self.disable_any_whitespace!r}"
            )
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise SamplingParamsError(
                f"StructuredOutputsParams.whitespace_pattern must be a str, got {self.whitespace_pattern!r}"
            )
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise SamplingParamsError(
                "StructuredOutputsParams: disable_any_whitespace and whitespace_pattern are exclusive"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise SamplingParamsError(
                "StructuredOutputsParams.choice must be a non-empty list of non-empty strs, "
                f"got {self.choice!r}"
            )
        if self.regex is not None and not isinstance(self.regex, str):
            raise SamplingParamsError(f"StructuredOutputsParams.regex must be a str, got {self.regex!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise SamplingParamsError(
                f"StructuredOutputsParams.json must be a dict or a JSON str, got {self.json!r}"
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise SamplingParamsError(
                f"StructuredOutputsParams.backend must be a non-empty str, got {self.backend!r}"
            )


@dataclass(init=False)
class SamplingParams:
    """How to sample one prompt's completion(s).

    Attributes:
        n: completions per prompt (each an independent sample of the same prompt).
        temperature: softmax temperature; ``0`` = greedy (argmax, ties -> lowest token id).
        top_p: nucleus sampling: keep the most probable tokens whose cumulative probability
            (before the token) is below ``top_p``; ``1`` = off. Always keeps at least one token.
        top_k: keep the ``top_k`` most probable tokens; ``0`` or ``-1`` = off.
        seed: per-request seed; the request's tokens then do not depend on the other requests
            in the batch. ``None`` = derived from the engine seed and the request's index.
        max_tokens: most tokens to generate.
        stop_token_ids: tokens that end the completion (included in ``token_ids``, not in ``text``).
        ignore_eos: keep generating after the model's EOS token.
        logprobs: return, for each generated token, the log-probabilities of the ``logprobs``
            most likely tokens plus the sampled one, from the model's raw distribution
            (``log_softmax`` of the logits, before penalties, temperature, top-k...). ``None`` = off.
        min_p: keep only tokens whose probability (after temperature) is at least ``min_p``
            times the most likely token's; ``0`` = off.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token already generated.
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the generated tokens.
        repetition_penalty: > 0; for tokens in the prompt or generated, positive logits are
            divided by it and negative ones multiplied; ``1`` = off.
        logit_bias: ``{token_id: bias}`` added to the logits (biases clamped to [-100, 100]).
        allowed_token_ids: if set, only these tokens can be generated.
        stop: strings that end the completion (``finish_reason="stop"``, ``stop_reason`` the
            string); the text is cut before the string unless ``include_stop_str_in_output``.
        include_stop_str_in_output: keep the stop string (or stop token's text) in ``text``.
        min_tokens: EOS and ``stop_token_ids`` are suppressed, and stop strings ignored, until
            this many tokens were generated.
        prompt_logprobs: for every prompt token after the first, ``{token_id: logprob}`` of the
            actual token plus the ``prompt_logprobs`` most likely ones; ``None`` = off.
        skip_special_tokens: leave special tokens out of ``text``.
        structured_outputs: a :class:`StructuredOutputsParams` constraining the completion
            (``choice`` / ``regex`` / ``json``), or ``None``.
        logits_processors: custom logits processors registered by plugins, by name: a dict
            ``{name: {args}}`` or a list of names (stored as the dict); see
            :mod:`deepinfer_core.sampling.logits_processors`.  An unknown name fails the request
            at submission.

    Raises:
        SamplingParamsError: an unknown keyword or an invalid value, naming field and value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logits_processors: dict[str, dict[str, Any]] | None = None

    def __init__(
        self,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        max_tokens: int = 16,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        allowed_token_ids: list[int] | None = None,
        stop: str | list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        prompt_logprobs: int | None = None,
        skip_special_tokens: bool = True,
        structured_outputs: StructuredOutputsParams | None = None,
        logits_processors: dict[str, dict[str, Any]] | list[str] | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            names = sorted(unknown)
            later = [k for k in names if k in _NOT_YET]
            hint = f" ({later} are not supported yet)" if later else ""
            raise SamplingParamsError(
                f"unknown SamplingParams argument(s) {names}{hint}; supported: {sorted(self.field_names())}"
            )
        self.n = n
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self.max_tokens = max_tokens
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else []
        self.ignore_eos = ignore_eos
        self.logprobs = logprobs
        self.min_p = min_p
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty
        self.logit_bias = _bias_dict(logit_bias)
        self.allowed_token_ids = (
            list(allowed_token_ids) if isinstance(allowed_token_ids, tuple) else allowed_token_ids
        )
        if stop is None:
            stop = []
        self.stop = [stop] if isinstance(stop, str) else (list(stop) if isinstance(stop, tuple) else stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.prompt_logprobs = prompt_logprobs
        self.skip_special_tokens = skip_special_tokens
        self.structured_outputs = structured_outputs
        try:
            self.logits_processors = normalize_processor_args(logits_processors)
        except ValueError as e:
            raise SamplingParamsError(
                f"SamplingParams.logits_processors={logits_processors!r}: {e}"
            ) from None
        self._validate()

    @staticmethod
    def field_names() -> list[str]:
        """Names of all supported fields."""
        return [f.name for f in dataclasses.fields(SamplingParams)]

    @property
    def greedy(self) -> bool:
        """Whether this request is sampled greedily (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the presence / frequency / repetition penalties is active."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def verify_vocab(self, vocab_size: int) -> None:
        """Check the token ids in ``logit_bias``, ``allowed_token_ids`` and ``stop_token_ids``
        against the model's vocabulary ``[0, vocab_size)``.

        Raises:
            SamplingParamsError: naming the field and the first out-of-range ids.
        """
        for name, ids in (
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(
                    f"SamplingParams.{name} has token id(s) {bad[:5]} outside the vocabulary "
                    f"[0, {vocab_size})"
                )

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied."""
        values = {name: getattr(self, name) for name in self.field_names()}
        values.update(changes)
        return SamplingParams(**values)

    def _validate(self) -> None:
        def bad(name: str, value: Any, need: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams.{name} must be {need}, got {value!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            raise bad("n", self.n, "an int >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "an int >= 1, or 0 / -1 to disable")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", self.seed, "None or an int in [0, 2**63)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an int >= 1")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "a bool")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "None or an int >= 0")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "None or an int >= 0")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2 <= value <= 2:
                raise bad(name, value, "a number in [-2, 2]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "None or a {token_id: bias} dict")
            for tok, b in self.logit_bias.items():
                if not is_int(tok) or tok < 0 or not is_num(b):
                    raise bad("logit_bias", {tok: b}, "a {token_id: finite number} dict with token ids >= 0")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise bad(
                "allowed_token_ids", self.allowed_token_ids, "None or a non-empty list of token ids >= 0"
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "None, a non-empty str or a list of non-empty strs")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, getattr(self, name), "a bool")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"an int in [0, max_tokens={self.max_tokens}]")


def _bias_dict(logit_bias: Any) -> Any:
    """``logit_bias`` with string keys (as from JSON) made ints and biases clamped to [-100, 100];
    anything that is not a dict is returned as is (rejected by validation)."""
    if not isinstance(logit_bias, dict):
        return logit_bias
    out: dict[Any, Any] = {}
    for tok, b in logit_bias.items():
        if isinstance(tok, str) and tok.strip().isdigit():
            tok = int(tok)
        if isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b):
            b = max(-_MAX_BIAS, min(_MAX_BIAS, float(b)))
        out[tok] = b
    return out
