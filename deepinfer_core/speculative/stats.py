"""Acceptance statistics (per request, for DSpark's estimates) and the engine's speculative
metrics (``LLM.get_metrics()["speculative"]``)."""

from __future__ import annotations

from typing import Any

PRIOR_WEIGHT = 2.0
"""Pseudo-observations of the engine-wide rate a request's own estimate starts from."""
REQUEST_DECAY = 0.75
"""Weight a request's earlier observations keep at each new one (its estimates follow its
recent behaviour: a request that starts repeating itself after wandering gets its drafts
accepted at once, and its all-time rate would hide that)."""


class AcceptanceStats:
    """Per draft position ``i`` (1-based): how often a draft there was verified with every
    earlier draft accepted, and how often it was accepted — the conditional acceptance rate
    ``P(d_i accepted | d_<i accepted)``; and how often the drafter, asked for at least ``i``
    drafts, proposed ``i`` or more — its reach ``P(len >= i)`` (a lookup drafter proposes
    nothing where it finds no match).

    Args:
        max_draft_tokens: positions tracked.
        decay: weight the earlier counts keep at each new observation (``1``: all-time counts;
            below, exponentially weighted towards the recent ones).
    """

    def __init__(self, max_draft_tokens: int, decay: float = 1.0) -> None:
        self.decay = decay
        self.tried = [0.0] * max_draft_tokens
        self.accepted = [0.0] * max_draft_tokens
        self.asked = [0.0] * max_draft_tokens
        self.proposed = [0.0] * max_draft_tokens

    def record_proposal(self, room: int, num_proposed: int) -> None:
        """One drafter call that could propose up to ``room`` drafts and proposed ``num_proposed``."""
        d = self.decay
        for i in range(min(room, len(self.asked))):
            self.asked[i] = d * self.asked[i] + 1
            self.proposed[i] = d * self.proposed[i] + (i < num_proposed)

    def reach(self, i: int, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """Estimated probability that the drafter proposes a draft at 0-based position ``i``
        (when asked for that many), shrunk towards ``prior``."""
        return (self.proposed[i] + weight * prior) / (self.asked[i] + weight)

    def reaches(self, prior: list[float], weight: float = PRIOR_WEIGHT) -> list[float]:
        """:meth:`reach` at every position (``prior`` per position)."""
        pairs = zip(self.proposed, self.asked, prior, strict=False)
        return [(p + weight * q) / (a + weight) for p, a, q in pairs]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verify of ``num_drafts`` drafts of which the first ``num_accepted`` were accepted."""
        d = self.decay
        for i in range(min(num_drafts, num_accepted + 1)):
            self.tried[i] = d * self.tried[i] + 1
            self.accepted[i] = d * self.accepted[i] + (i < num_accepted)

    def rate(self, i: int, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """Estimated acceptance rate at 0-based position ``i``, shrunk towards ``prior``."""
        return (self.accepted[i] + weight * prior) / (self.tried[i] + weight)

    def rates(self, prior: list[float], weight: float = PRIOR_WEIGHT) -> list[float]:
        """:meth:`rate` at every position (``prior`` per position)."""
        pairs = zip(self.accepted, self.tried, prior, strict=False)
        return [(a + weight * q) / (t + weight) for a, t, q in pairs]

    def cumulative_rates(self, prior: list[float], weight: float = PRIOR_WEIGHT) -> list[float]:
        """The cumulative products of :meth:`rates` (``P(d_1 .. d_i all accepted)``, one per
        position of ``prior``), in one pass: DSpark asks this of every drafting request every step."""
        out, acc = [], 1.0
        for a, t, q in zip(self.accepted, self.tried, prior, strict=False):
            acc *= (a + weight * q) / (t + weight)
            out.append(acc)
        return out


CALIBRATION_DECAY = 0.995
"""Weight the earlier verifies keep in :class:`ConfidenceCalibration` at each new one."""
CALIBRATION_PRIOR = 4.0
"""Pseudo-verifies at which a drafter's confidence is taken at its word."""


class ConfidenceCalibration:
    """Online calibration of a drafter's own confidences, per draft position (as vLLM does
    for DSpark; the paper calibrates offline, and raw confidence heads are over-confident):
    recency-weighted sums of the predicted conditional acceptance ``c_i`` of every draft that
    was verified with the ones before it accepted, and of its realised acceptance; the
    calibrated ``c_i`` is ``c_i * realised / predicted`` (clamped to ``[0, 1]``), starting at
    ``c_i`` (:data:`CALIBRATION_PRIOR` pseudo-verifies at ratio 1)."""

    def __init__(self, max_draft_tokens: int) -> None:
        self.predicted = [0.0] * max_draft_tokens
        self.realised = [0.0] * max_draft_tokens

    def record(self, confidence: list[float], num_drafts: int, num_accepted: int) -> None:
        """One verify of ``num_drafts`` drafts (their conditional ``confidence``) of which the
        first ``num_accepted`` were accepted."""
        d = CALIBRATION_DECAY
        for i in range(min(num_drafts, num_accepted + 1, len(confidence), len(self.predicted))):
            self.predicted[i] = d * self.predicted[i] + float(confidence[i])
            self.realised[i] = d * self.realised[i] + (i < num_accepted)

    def ratio(self, i: int) -> float:
        """Realised over predicted acceptance at 0-based position ``i`` (shrunk towards 1)."""
        w = CALIBRATION_PRIOR
        return (self.realised[i] + w) / (self.predicted[i] + w)

    def apply(self, confidence: list[float]) -> list[float]:
        """``confidence`` (conditional, per position) calibrated."""
        return [
            min(max(c * self.ratio(i), 0.0), 1.0) for i, c in enumerate(confidence[: len(self.predicted)])
        ]


class SpeculativeMetrics:
    """Engine totals of speculative decoding (see :meth:`as_dict`)."""

    def __init__(self, max_draft_tokens: int) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.reset()

    def reset(self) -> None:
        """Zero every total."""
        k = self.max_draft_tokens
        self.num_drafts = 0  # verifies of at least one draft token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_proposed_tokens = 0  # what the drafter proposed (before the policy cut)
        self.accepted_per_position = [0] * k
        self.verified_per_position = [0] * k
        self.verify_length_histogram = [0] * (k + 1)  # drafts verified per decode: 0..k
        self.num_steps_without_drafting = 0  # dspark: steps drafting was not expected to pay

    def record(self, proposed: int, verified: int, accepted: int) -> None:
        """One decoding request in a step: drafts ``proposed``, ``verified`` of them, ``accepted``."""
        self.num_proposed_tokens += proposed
        self.verify_length_histogram[verified] += 1
        if verified:
            self.num_drafts += 1
            self.num_draft_tokens += verified
            self.num_accepted_tokens += accepted
            for i in range(verified):
                self.verified_per_position[i] += 1
                self.accepted_per_position[i] += i < accepted

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify of at least one draft: ``1 + accepted / drafts``."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, Any]:
        """``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``, ``num_proposed_tokens``,
        ``acceptance_rate`` (accepted / verified draft tokens), ``mean_acceptance_length``,
        ``acceptance_per_position`` (rate at each draft position, of the drafts verified
        there), ``verify_length_histogram`` (decodes by drafts verified, 0..k),
        ``num_steps_without_drafting`` (``dspark``: decode steps that did not ask the drafter,
        drafting not being expected to pay)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_proposed_tokens": self.num_proposed_tokens,
            "acceptance_rate": (
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
            ),
            "mean_acceptance_length": self.mean_acceptance_length,
            "num_steps_without_drafting": self.num_steps_without_drafting,
            "acceptance_per_position": [
                a / v if v else 0.0
                for a, v in zip(self.accepted_per_position, self.verified_per_position, strict=True)
            ],
            "verify_length_histogram": list(self.verify_length_histogram),
        }
