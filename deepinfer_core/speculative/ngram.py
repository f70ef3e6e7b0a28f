"""The ``ngram`` drafter: prompt lookup decoding (no weights).

For a request whose tokens end in the n-gram ``g`` (``n`` from ``ngram_max`` down to
``ngram_min``), find the most recent earlier occurrence of ``g`` in its prompt + output and
propose the tokens that followed it.  Repetitive text (code edits, summaries quoting the
input, lists) gets long accepted drafts; elsewhere no n-gram matches and the request simply
decodes one token.  The search is a scan from the end of the sequence, O(length) per request
and step; it keeps no state.
"""

from __future__ import annotations

from collections.abc import Sequence

from .drafter import Draft, DraftContext, Drafter


def lookup(tokens: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram of ``tokens`` (``n_max`` down to ``n_min``); ``[]`` when none occurs."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = list(tokens[length - n :])
        first = suffix[0]
        # latest start i < length - n with tokens[i:i+n] == suffix
        for i in range(length - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i : i + n]) == suffix:
                return list(tokens[i + n : min(i + n + k, length)])
    return []


class NgramDrafter(Drafter):
    """Prompt lookup: propose what followed the last occurrence of the request's suffix."""

    def propose(self, contexts: Sequence[DraftContext]) -> list[Draft]:
        cfg = self.config
        return [Draft(lookup(c.token_ids, cfg.ngram_min, cfg.ngram_max, c.max_tokens)) for c in contexts]
