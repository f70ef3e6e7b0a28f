"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from deepinfer_core.errors import SamplingParamsError

# vLLM fields that DeepInfer will accept in a later release; named in the error so that users
# know the option exists but is not implemented yet.
_NOT_YET = (
    "min_p",
    "min_tokens",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "prompt_logprobs",
    "structured_outputs",
    "bad_words",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "allowed_token_ids",
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
            (``log_softmax`` of the logits, before temperature / top-k / top-p). ``None`` = off.

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
        self._validate()

    @staticmethod
    def field_names() -> list[str]:
        """Names of all supported fields."""
        return [f.name for f in dataclasses.fields(SamplingParams)]

    @property
    def greedy(self) -> bool:
        """Whether this request is sampled greedily (``temperature == 0``)."""
        return self.temperature == 0

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
