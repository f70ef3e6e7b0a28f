"""When a request is done: the pure finish check after each generated token (vLLM semantics).

In order, after the token is appended and its text detokenised:

1. fewer than ``min_tokens`` generated: no stop condition applies (EOS and stop ids were
   also masked out by the sampler), only the length caps;
2. EOS (unless ``ignore_eos``): ``finish_reason="stop"``, ``stop_reason=None``;
3. a ``stop_token_ids`` token: ``"stop"``, ``stop_reason`` = the token id;
   for 2 and 3 the token's own text is cut from the output unless
   ``include_stop_str_in_output``;
4. a ``stop`` string in the text (searched only where the new text can complete one, the
   first matching string of the list wins): ``"stop"``, ``stop_reason`` = the string; the
   text is cut before it, or just after it with ``include_stop_str_in_output``;
5. the sequence reached ``max_model_len`` or ``max_tokens`` tokens were generated:
   ``"length"``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from deepinfer_core.sampling.params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    """The outcome of :func:`check_stop`.

    Attributes:
        finish_reason: ``"stop"``, ``"length"`` or ``None`` (keep going).
        stop_reason: the stop token id or stop string that ended it, else ``None``.
        truncate_to: the length the output text must be cut to, or ``None`` to keep it.
    """

    finish_reason: str | None = None
    stop_reason: int | str | None = None
    truncate_to: int | None = None


CONTINUE = StopDecision()


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str: bool
) -> tuple[str, int | None] | None:
    """The first stop string completed by the last ``num_new_chars`` characters of ``text``.

    Returns ``(stop_string, truncate_to)`` where ``truncate_to`` is ``None`` when nothing
    follows the kept text, or ``None`` when no stop string matched.
    """
    if num_new_chars == 0:
        return None
    for s in stop:
        # a match must end inside the new text, so it starts at most len(s) - 1 chars before it
        start = max(len(text) - num_new_chars - len(s) + 1, 0)
        idx = text.find(s, start)
        if idx == -1:
            continue
        end = idx + len(s) if include_stop_str else idx
        return s, (end if end < len(text) else None)
    return None


def check_stop(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    output_text: str,
    num_new_chars: int,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> StopDecision:
    """Whether the request stops after generating ``token_id`` (see the module docstring).

    Args:
        params: the request's sampling parameters.
        token_id: the token just appended.
        num_output_tokens: generated tokens, ``token_id`` included.
        num_tokens: prompt plus generated tokens.
        output_text: the generated text so far, the new token's text included.
        num_new_chars: how many characters at the end of ``output_text`` the token added.
        eos_token_ids: the model's EOS ids.
        max_model_len: the engine's longest sequence.
    """
    if num_output_tokens >= params.min_tokens:
        is_eos = token_id in eos_token_ids and not params.ignore_eos
        if is_eos or token_id in params.stop_token_ids:
            cut = None
            if num_new_chars and not params.include_stop_str_in_output:
                cut = len(output_text) - num_new_chars
            return StopDecision("stop", None if is_eos else token_id, cut)
        if params.stop:
            found = find_stop_string(
                output_text, num_new_chars, params.stop, params.include_stop_str_in_output
            )
            if found is not None:
                return StopDecision("stop", found[0], found[1])
    if num_tokens >= max_model_len or num_output_tokens >= params.max_tokens:
        return StopDecision("length")
    return CONTINUE
