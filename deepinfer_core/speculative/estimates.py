"""DSpark's acceptance estimates: per request (recency-weighted) and engine-wide acceptance rates
and drafter reach (:class:`~.stats.AcceptanceStats`), and the online calibration of the
drafter's own confidences (:class:`~.stats.ConfidenceCalibration`)."""

from __future__ import annotations

from .drafter import Draft
from .policy import cumulative
from .stats import REQUEST_DECAY, AcceptanceStats, ConfidenceCalibration


class AcceptanceEstimates:
    """What the ``dspark`` policy weighs drafts by: cumulative acceptance probabilities per
    draft position and the probability that the drafter proposes a draft there.

    Args:
        max_draft_tokens: draft positions tracked.
    """

    def __init__(self, max_draft_tokens: int) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.global_stats = AcceptanceStats(max_draft_tokens)
        self._stats: dict[str, AcceptanceStats] = {}
        self.calibration = ConfidenceCalibration(max_draft_tokens)
        k = max_draft_tokens
        self._halves, self._ones = [0.5] * k, [1.0] * k  # the engine-wide rates' priors

    def confidences(
        self,
        request_ids: list[str],
        drafts: list[Draft],
        proposed: list[int],
        estimates: list[list[float]] | None,
    ) -> list[list[float]]:
        """``dspark``: each request's cumulative acceptance probability per proposed draft —
        the drafter's own confidence (calibrated online) where it gives one, else the running
        rates (``estimates`` when the decoder's drafting decision computed them this step; else computed
        here, for the requests with drafts only)."""
        prior: list[float] | None = None
        out: list[list[float]] = []
        for i, (draft, n) in enumerate(zip(drafts, proposed, strict=True)):
            if n == 0:
                out.append([])
            elif draft.confidence is not None:
                out.append(cumulative(self.calibration.apply(draft.confidence[:n])))
            elif estimates is not None:
                out.append(estimates[i][:n])
            else:
                prior = self.global_rates() if prior is None else prior
                out.append(self.rate_confidence(request_ids[i], n, prior))
        return out

    def reach(self, request_id: str, n: int, prior: list[float]) -> list[float]:
        """The probability that the drafter proposes a draft at each of the request's first ``n``
        positions: its running proposal rates shrunk towards the engine's (``prior``), made
        non-increasing."""
        stats = self._stats.get(request_id)
        out, acc = [], 1.0
        for r in prior[:n] if stats is None else stats.reaches(prior[:n]):
            acc = min(acc, r)
            out.append(acc)
        return out

    def request_stats(self, request_id: str) -> AcceptanceStats:
        """A request's own statistics (recency-weighted: :data:`~.stats.REQUEST_DECAY`)."""
        stats = self._stats.get(request_id)
        if stats is None:
            stats = self._stats[request_id] = AcceptanceStats(self.max_draft_tokens, REQUEST_DECAY)
        return stats

    def global_rates(self) -> list[float]:
        """The engine-wide acceptance rate per draft position (shrunk towards 0.5)."""
        return self.global_stats.rates(self._halves)

    def global_reach(self) -> list[float]:
        """The engine-wide probability that the drafter proposes a draft at each position
        (shrunk towards 1)."""
        return self.global_stats.reaches(self._ones)

    def rate_confidence(self, request_id: str, n: int, prior: list[float]) -> list[float]:
        """Cumulative acceptance probabilities of ``n`` draft positions from the request's running
        rates shrunk towards the engine's (``prior``, :meth:`global_rates`)."""
        stats = self._stats.get(request_id)
        return cumulative(prior[:n], clamp=False) if stats is None else stats.cumulative_rates(prior[:n])

    def forget(self, request_id: str) -> None:
        """Drop a finished request's statistics."""
        self._stats.pop(request_id, None)
