"""How many of its drafts each request verifies this step.

* ``fixed``: every draft the drafter proposed (up to ``max_draft_tokens``), as long as the
  step's token budget lasts.
* ``dspark`` (confidence-scheduled verification, as DeepSeek's DSpark): request ``r``'s
  ``j``-th draft is accepted (with all before it) with probability
  ``c_r(j) = prod_{i <= j} a_r(i)``, from the drafter's per-token confidence where it gives
  one, else the request's running acceptance rates (:class:`~.stats.AcceptanceStats`, shrunk
  towards the engine-wide rates).  Verifying it adds ``c_r(j)`` expected tokens and one token
  of work.  With ``B`` decoding requests and ``n`` drafts verified the step is expected to
  emit ``B + sum c`` tokens in ``cost(B, 1 + n / B)`` seconds, from :class:`StepCost`
  (measured at start per batch size and tokens per request, then refined by the steps run).
  The policy takes the drafts in order of decreasing ``c`` (a request's ``c`` never grows
  with ``j``, so each request verifies a prefix) and keeps the count that maximises expected
  tokens per second — a longer verify only where it is expected to pay.  Drafting itself
  costs time (the ``mtp`` drafter runs its layer once per draft depth): before asking the
  drafter, :func:`drafting_gain` weighs the best verify lengths the requests' running
  acceptance rates allow, plus the drafter's measured time, against a step without drafts
  as such steps run (with async scheduling they overlap the host work with the device's,
  while a verify step needs the previous step's tokens first: :meth:`StepCost.plain_cost`);
  when drafting does not pay the step runs without proposing, with a probe after
  :data:`PROBE_INTERVAL` such steps so the rates can recover (and, the other way, a step
  without drafts after :data:`PLAIN_PROBE_INTERVAL` drafting ones, so the plain step's cost
  stays measured); a probe that does not change the decision doubles its interval
  (:class:`ProbeSchedule`), so a settled decision costs ever fewer probes.
  The overhead the host adds to a step grows with its requests and its rows (every verified
  row is sampled), so :class:`StepCost` fits it per step, per request and per row from the
  steps run.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import numpy as np

from .step_cost import StepCost

EMA = 0.2
"""Weight of a newly measured drafter call in the engine's drafting-time estimate."""
PROBE_INTERVAL = 8
"""``dspark``: steps without drafting (it did not pay) before the next probe drafts anyway."""
PLAIN_PROBE_INTERVAL = 32
"""``dspark``: drafting steps in a row before one runs without drafts anyway (to keep the cost
of a plain step measured; rarer than :data:`PROBE_INTERVAL`, as it gives up a draft's gain)."""
ARRAY_SEARCH_MIN = 64
"""Candidate drafts from which :func:`dspark_lengths` searches with array operations (below,
the tuple sort is faster)."""
SETTLED_GAIN = 1.25
"""``dspark``: a decision whose :func:`drafting_gain` was above this (or below its inverse) is
reused for the next :data:`SETTLED_STEPS` steps without weighing it again (the estimates
move by a step's worth of observations at a time; weighing costs host time every step)."""
SETTLED_STEPS = 8
UNSETTLED_STEPS = 1
"""``dspark``: a decision that is not clear is reused for this many steps (weighing it costs
host time, ~1 % of a CPU step of the tiny model, and the estimates move slowly)."""
MAX_REUSE_STEPS = 32
"""``dspark``: a decision that each weighing confirms is reused for twice as many steps as
the last time, up to this many (a flip falls back to :data:`SETTLED_STEPS` or
:data:`UNSETTLED_STEPS`): weighing the same answer every other step was a third of DSpark's
own host time at B=4 on the CPU, and the verify lengths are still chosen every step."""
CERTAIN_GAIN = 2.0
"""``dspark``: drafting that is expected to pay more than this is not probed on the plain side
(:class:`ProbeSchedule`): a step without drafts would have to cost under half its estimate to
flip the decision, and each such probe gives up a verify step's tokens (at B=1 on the H200,
where drafting gained 3x, three probes cost DSpark 5 % against ``fixed``)."""
PROBE_BACKOFF_CAP = 8
"""``dspark``: a probe interval grows (doubling while probes confirm the decision) to at most
this many times its start (:class:`ProbeSchedule`)."""


class ProbeSchedule:
    """When ``dspark`` overrides its own decision to keep both sides of it measured.

    After :data:`PROBE_INTERVAL` steps in a row without drafting (it did not pay) one drafts
    anyway, so the acceptance rates can recover; after :data:`PLAIN_PROBE_INTERVAL` drafting
    steps in a row one runs without drafts, so the cost of a plain step stays known (unless
    drafting pays so clearly that no plain step's cost could change that: :data:`CERTAIN_GAIN`).
    A probe whose next decision is the same as before it (it did not change the estimate enough
    to flip) doubles that side's interval, up to :data:`PROBE_BACKOFF_CAP` times its start; a
    flip resets both intervals. A settled decision thus pays ever fewer probes, while a changed
    workload is noticed within the base interval after the flip. A draft probe verifies every
    draft proposed (as ``fixed``): verifying only those the current estimates favour would
    verify none and teach nothing.
    """

    def __init__(self) -> None:
        self.draft_interval = PROBE_INTERVAL  # steps without drafting before a draft probe
        self.plain_interval = PLAIN_PROBE_INTERVAL  # drafting steps before a plain probe
        self._run = 0  # steps in a row with the same decision
        self._last: bool | None = None  # the last decision (before any override)
        self._probed = False  # the previous step was a probe
        self.probing = False
        """The last :meth:`decide` overrode the decision (this step is a probe)."""

    def decide(self, pays: bool, certain: bool = False) -> bool:
        """Whether this step drafts, given whether drafting is expected to pay (``certain``:
        by more than :data:`CERTAIN_GAIN`, so no plain probe could flip it)."""
        if self._last is not None and pays != self._last:
            self.draft_interval, self.plain_interval = PROBE_INTERVAL, PLAIN_PROBE_INTERVAL
            self._run = 0
        elif self._probed:  # the probe confirmed the decision: back off
            if pays:
                self.plain_interval = min(2 * self.plain_interval, PROBE_BACKOFF_CAP * PLAIN_PROBE_INTERVAL)
            else:
                self.draft_interval = min(2 * self.draft_interval, PROBE_BACKOFF_CAP * PROBE_INTERVAL)
        self._last, self._probed = pays, False
        self._run += 1
        due = self._run > (self.plain_interval if pays else self.draft_interval)
        self.probing = due and not (pays and certain)
        if self.probing:
            self._run, self._probed = 0, True
            return not pays
        return pays


def fixed_lengths(proposed: Sequence[int], budget: int) -> list[int]:
    """``fixed``: every proposed draft, in request order while ``budget`` extra tokens last."""
    out = []
    for n in proposed:
        take = min(n, max(budget, 0))
        out.append(take)
        budget -= take
    return out


def dspark_lengths(
    confidences: Sequence[Sequence[float]], budget: int, cost: StepCost, causal: bool = False
) -> list[int]:
    """``dspark``: drafts to verify per request (see the module docstring).

    Args:
        confidences: per request, the cumulative acceptance probability of each draft prefix
            (``c_r(1) >= c_r(2) >= ...``), one entry per proposed draft.
        budget: most draft tokens the step can add.
        cost: the step cost model.
        causal: stop at the first candidate that does not raise the expected tokens per
            second (DSpark's Algorithm 1) instead of taking the best count over all of them.
            Needed for ``rejection`` acceptance of sampled drafts whose confidences depend on
            the drafts drawn before (the DSpark drafter): a global search may admit draft ``1``
            because of draft ``2``'s confidence, which depends on the realised draft ``1``,
            and so bias the output distribution (the paper's Appendix A).
    """
    b = len(confidences)
    if b == 0:
        return []
    counts = [len(cs) for cs in confidences]
    if not causal and sum(counts) >= ARRAY_SEARCH_MIN:
        return _dspark_lengths_array(confidences, counts, budget, cost)
    # by decreasing c, then position, then request (tuples sort natively: no key function)
    cands = sorted((-c, j, r) for r, cs in enumerate(confidences) for j, c in enumerate(cs))
    cands = cands[: max(budget, 0)]
    costs = cost.costs(b, len(cands))
    best_value, best_n = b / costs[0], 0
    expected = float(b)
    for n, (neg_c, _, _) in enumerate(cands, start=1):
        expected -= neg_c
        value = expected / costs[n]
        if value > best_value:
            best_value, best_n = value, n
        elif causal:
            break
    lengths = [0] * b
    for _, j, r in cands[:best_n]:
        lengths[r] = max(lengths[r], j + 1)
    return lengths


def _dspark_lengths_array(
    confidences: Sequence[Sequence[float]], counts: list[int], budget: int, cost: StepCost
) -> list[int]:
    """:func:`dspark_lengths` (not causal) as array operations: one stable sort of the batch's
    confidences, the expected tokens per second of every prefix, the first best.  The same
    lengths up to ties between requests at the cut (equal confidences: either request's draft,
    the same expected value); 2.6x faster at B=64 x 5 drafts, where the tuple sort and the
    Python loop were a DSpark step's largest host cost."""
    b = len(confidences)
    flat = np.fromiter(itertools.chain.from_iterable(confidences), dtype=np.float64, count=sum(counts))
    order = np.argsort(-flat, kind="stable")[: max(budget, 0)]  # request order, then position
    costs = np.asarray(cost.costs(b, len(order)))
    values = (b + np.concatenate(([0.0], np.cumsum(flat[order])))) / costs
    best = int(np.argmax(values))  # the first of the best, as the loop's strict improvement
    owner = np.repeat(np.arange(b), counts)
    return np.bincount(owner[order[:best]], minlength=b).tolist()


def uniform_lengths(
    confidences: Sequence[Sequence[float]], budget: int, cost: StepCost, causal: bool = False
) -> list[int]:
    """``dspark`` without varlen verify (``SpeculativeConfig.varlen=False``): one length ``L``
    for every request (each verifies ``min(L, its drafts)``, in request order while ``budget``
    lasts), the ``L`` of most expected tokens per second (``L = 0``: none).

    Args:
        confidences: per request, the cumulative acceptance probability of each draft prefix.
        budget: most draft tokens the step can add.
        cost: the step cost model.
        causal: stop at the first ``L`` that does not improve (whether position ``L`` is
            verified then depends on no draft after it, as :func:`dspark_lengths`' ``causal``).
    """
    b = len(confidences)
    if b == 0:
        return []
    longest = max((len(cs) for cs in confidences), default=0)
    costs = cost.costs(b, max(min(budget, b * longest), 0))
    best, best_value = [0] * b, b / costs[0]
    for length in range(1, longest + 1):
        lengths = fixed_lengths([min(length, len(cs)) for cs in confidences], budget)
        expected = b + sum(sum(cs[:n]) for cs, n in zip(confidences, lengths, strict=True))
        value = expected / costs[sum(lengths)]
        if value > best_value:
            best, best_value = lengths, value
        elif causal:
            break
    return best


def drafting_gain(
    confidences: Sequence[Sequence[float]],
    budget: int,
    cost: StepCost,
    draft_seconds: float,
    reach: Sequence[Sequence[float]] | None = None,
) -> float:
    """``dspark``: expected tokens per second of a step that drafts over those of a step
    without drafts.

    Args:
        confidences: per decoding request, the estimated cumulative acceptance probability of
            each draft prefix it could verify (the running acceptance rates: the drafts
            themselves are not known yet).
        budget: most draft tokens the step can add.
        cost: the step cost model (its overhead excludes drafting).
        draft_seconds: the drafter's measured time per call.
        reach: per request and position, the probability that the drafter proposes a draft
            there at all (``None``: always); the expected tokens and verified rows are
            weighted by it.

    Returns:
        The expected tokens per second of the best verify lengths (:func:`dspark_lengths` on
        the weighted confidences), counting ``draft_seconds``, over those of a step without
        drafts as such steps run (:meth:`StepCost.plain_cost`: asynchronously where the engine
        can); ``0`` when no draft is worth verifying.
    """
    b = len(confidences)
    if reach is not None:
        confidences = [
            [c * p for c, p in zip(cs, ps, strict=False)] for cs, ps in zip(confidences, reach, strict=True)
        ]
    lengths = dspark_lengths(confidences, budget, cost)
    if sum(lengths) == 0:
        return 0.0
    rows = sum(
        length if reach is None else sum(ps[:length])
        for ps, length in zip(reach or confidences, lengths, strict=True)
    )
    expected = b + sum(sum(cs[:length]) for cs, length in zip(confidences, lengths, strict=True))
    return expected / (cost.cost(b, 1.0 + rows / b) + draft_seconds) / (b / cost.plain_cost(b))


def cumulative(rates: Sequence[float], clamp: bool = True) -> list[float]:
    """Cumulative products ``[a1, a1 a2, ...]`` of per-position acceptance rates, each clamped
    to ``[0, 1]`` (``clamp=False``: the caller's rates already are — running rates, shrunk
    averages of 0/1 outcomes — and the products cost a third of the time)."""
    if clamp:
        rates = [min(max(a, 0.0), 1.0) for a in rates]
    return list(itertools.accumulate(rates, operator.mul))
