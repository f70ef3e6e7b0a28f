"""The comparison the distributed tests make: a distributed run's completions against one process's."""

from __future__ import annotations

from typing import Any


def logprob_value(lp: Any) -> float:
    """A logprob entry as a float (a plain float, or an object with ``.logprob``)."""
    return float(getattr(lp, "logprob", lp))


def assert_same_completions(got: list[Any], want: list[Any], exact: bool, tolerance: float = 1e-5) -> None:
    """``got[i]`` and ``want[i]`` (``CompletionOutput``) have the same tokens and the same top
    logprob ids at every step, with values bitwise equal (``exact``: batch-invariant runs) or
    within ``tolerance``."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"prompt {i}: tokens {g.token_ids} != {w.token_ids}"
        assert (g.logprobs is None) == (w.logprobs is None), f"prompt {i}: logprobs present on one side only"
        for step, (a, b) in enumerate(zip(g.logprobs or [], w.logprobs or [], strict=True)):
            assert set(a) == set(b), f"prompt {i} step {step}: top ids {sorted(a)} vs {sorted(b)}"
            for tok in b:
                x, y = logprob_value(a[tok]), logprob_value(b[tok])
                ok = x == y if exact else abs(x - y) <= tolerance
                assert ok, f"prompt {i} step {step} token {tok}: {x!r} vs {y!r} (exact={exact})"
