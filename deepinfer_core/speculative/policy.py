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

import bisect
import itertools
import operator
from collections import deque
from collections.abc import Sequence

import numpy as np

EMA = 0.2
"""Weight of a newly measured drafter call in the engine's drafting-time estimate."""
PROBE_INTERVAL = 8
"""``dspark``: steps without drafting (it did not pay) before the next probe drafts anyway."""
PLAIN_PROBE_INTERVAL = 32
"""``dspark``: drafting steps in a row before one runs without drafts anyway (to keep the cost
of a plain step measured; rarer than :data:`PROBE_INTERVAL`, as it gives up a draft's gain)."""
RECENT_STEPS = 64
"""Observed steps :class:`StepCost` keeps for inspection (``get_metrics``)."""
FORWARD_CACHE = 4096
"""Points :meth:`StepCost.forward` keeps (a step's batch and tokens per request repeat)."""
ARRAY_SEARCH_MIN = 64
"""Candidate drafts from which :func:`dspark_lengths` searches with array operations (below,
the tuple sort is faster)."""
OVERHEAD_WINDOW = 128
"""Steps :class:`StepCost` fits each overhead to (the latest synchronous ones; the latest plain
ones)."""
REFIT_EVERY = 64
"""Observed steps between two fits of the overhead line (before that: at 1, 2, 4 ... 32 steps;
a fit of the full window costs ~0.1 ms of host time on the CPU)."""
OUTLIER_MADS = 4.0
"""A step whose time is this many (normal-scaled) median absolute deviations off the first
line is left out of the second fit (a descheduled process, a collection, a page fault)."""
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


class StepCost:
    """Seconds per step by batch size ``B`` and tokens per request ``t`` (``1 + drafts``).

    Args:
        table: measured forward times ``{(B, t): seconds}``; at least one entry.  ``cost``
            interpolates linearly in ``t`` and in ``B`` between measured points (clamped at the
            ends, proportional in ``B`` beyond the largest, constant in ``t`` where one ``t``
            was measured), plus :meth:`overhead`.
        padded_batch: verify steps of at most this many requests run padded to the longest
            verify (the runner's fixed-shape verify graphs): any ``t > 1`` costs what the
            largest measured ``t`` does, so the forward jumps from ``t = 1`` to that and stays
            flat (interpolating in ``t`` there would price a step with a few drafts as a
            fraction of the jump).  ``0``: no padding.

    The host adds to every step's forward some work per step (scheduling), some per request
    (its inputs, its outputs, stop checks) and some per verified row (every row's sampling
    inputs, sampling, acceptance), which the profiled forwards do not contain.
    :meth:`observe` learns it from the synchronous steps the engine runs as
    ``overhead(rows, batch) = step_overhead + request_overhead * batch + row_overhead * rows``:
    a least-squares fit through the latest :data:`OVERHEAD_WINDOW` ``(batch, rows, step time -
    forward)`` points, refitted without the outliers of a first fit (every term non-negative;
    per row alone while rows and requests have not varied apart: :func:`robust_plane`).
    Requests and rows are told apart because a full batch's verify step has few requests per
    row and a batch's tail many: with rows alone, per-request work was charged to rows, and
    the price of a full batch's verify step followed the mix of steps seen (on the H200 at
    B=64 DSpark drafted less than paid).  The window is long and the fit robust
    because the line is extrapolated: a short, exponentially weighted one followed the few
    requests left at the end of a batch and a single slow step, and priced every verified row
    at ten times what it costs (0.39 ms on the CPU, where a verify step's rows cost 0.05 ms).

    Attributes:
        step_overhead, request_overhead, row_overhead: the fitted overhead.
        plain_overhead: ``(intercept, per request)`` of the time beyond the forward of a step
            without drafts that ran asynchronously (overlapping the host work with the
            device's, so it may be negative), a line in the batch size fitted as the
            synchronous one (:meth:`observe_plain`); ``None`` until one was observed.  A line,
            not one figure: the host's share grows with the requests, and a single average
            followed the last steps observed — a batch's tail of one or two requests — and
            priced full-batch plain steps at the tail's cost (so drafting looked worse than it
            was at B=64 on the H200).
    """

    def __init__(self, table: dict[tuple[int, int], float], padded_batch: int = 0) -> None:
        if not table:
            raise ValueError("StepCost needs at least one measured (batch, tokens) point")
        self.table = dict(table)
        self.padded_batch = padded_batch
        self.batches = sorted({b for b, _ in self.table})
        self.tokens = {b: sorted(t for bb, t in self.table if bb == b) for b in self.batches}
        self.step_overhead = 0.0
        self.request_overhead = 0.0
        self.row_overhead = 0.0
        # (batch, rows, extra) of the latest synchronous steps
        self._points: deque[tuple[float, float, float]] = deque(maxlen=OVERHEAD_WINDOW)
        self._unfitted = 0  # points observed since the last fit
        self.plain_overhead: tuple[float, float] | None = None
        self._plain_points: deque[tuple[float, float]] = deque(maxlen=OVERHEAD_WINDOW)  # (batch, extra)
        self._plain_unfitted = 0
        self.recent: deque[tuple[str, int, float, float]] = deque(maxlen=RECENT_STEPS)
        """The latest observed steps: ``("sync" | "plain", batch, rows, seconds)``."""
        self._forwards: dict[int, list[float]] = {}  # the forward part of costs() by batch
        self._forward_at: dict[tuple[int, float], float] = {}  # forward() by point
        # costs() by batch, with the overhead line they were computed for
        self._curves: dict[int, tuple[tuple[float, float, float], list[float]]] = {}

    def _at_batch(self, b: int, t: float) -> float:
        ts = self.tokens[b]
        if len(ts) == 1 or t <= ts[0]:
            return self.table[(b, ts[0])]
        if t == float("inf"):  # padded (see forward): the longest measured
            return self.table[(b, ts[-1])]
        if t >= ts[-1]:
            t0, t1 = ts[-2], ts[-1]
        else:
            j = bisect.bisect_right(ts, t)
            t0, t1 = ts[j - 1], ts[j]
        c0, c1 = self.table[(b, t0)], self.table[(b, t1)]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    def forward(self, batch: int, tokens_per_request: float) -> float:
        """The measured forward time, interpolated (no overhead; kept per point asked, as the
        table does not change)."""
        key = (batch, tokens_per_request)
        hit = self._forward_at.get(key)
        if hit is None:
            hit = self._forward(batch, tokens_per_request)
            if len(self._forward_at) < FORWARD_CACHE:
                self._forward_at[key] = hit
        return hit

    def _forward(self, batch: int, tokens_per_request: float) -> float:
        if tokens_per_request > 1.0 and batch <= self.padded_batch:
            tokens_per_request = float("inf")  # padded to the longest verify: its cost
        bs = self.batches
        if batch <= bs[0]:
            return self._at_batch(bs[0], tokens_per_request)
        if batch >= bs[-1]:
            return self._at_batch(bs[-1], tokens_per_request) * batch / bs[-1]
        j = bisect.bisect_right(bs, batch)
        b0, b1 = bs[j - 1], bs[j]
        c0, c1 = self._at_batch(b0, tokens_per_request), self._at_batch(b1, tokens_per_request)
        return c0 + (c1 - c0) * (batch - b0) / (b1 - b0)

    def overhead(self, rows: float, batch: float) -> float:
        """The host time a synchronous step of ``rows`` tokens of ``batch`` requests adds to
        its forward."""
        return self.step_overhead + self.request_overhead * batch + self.row_overhead * rows

    def cost(self, batch: int, tokens_per_request: float) -> float:
        """Estimated seconds of a synchronous step of ``batch`` requests of
        ``tokens_per_request`` tokens."""
        return self.forward(batch, tokens_per_request) + self.overhead(batch * tokens_per_request, batch)

    def observe(self, batch: int, tokens_per_request: float, seconds: float) -> None:
        """Fold a measured synchronous step into the overhead fit (its time beyond the
        forward's estimate, never negative, at ``batch`` requests and ``batch *
        tokens_per_request`` rows)."""
        x = batch * tokens_per_request
        self.recent.append(("sync", batch, x, seconds))
        self._points.append((float(batch), x, max(seconds - self.forward(batch, tokens_per_request), 0.0)))
        self._unfitted += 1
        if _refit_due(self._unfitted, len(self._points)):
            self._unfitted = 0
            self.step_overhead, self.request_overhead, self.row_overhead = robust_plane(list(self._points))

    def costs(self, batch: int, max_extra: int) -> list[float]:
        """``[cost(batch, 1 + n / batch) for n in 0 .. max_extra]``: the forward part is
        piecewise linear in ``n`` between the measured ``t`` (evaluated at the knots and
        interpolated, kept per batch: the table does not change), the overhead linear in the
        rows.  Kept per batch while the overhead line stays (a shorter curve is a prefix of a
        longer one), so the policy's calls within one step compute it once."""
        fwd = self._forwards.get(batch)
        if fwd is None or len(fwd) <= max_extra:
            fwd = self._forwards[batch] = self._forward_curve(batch, max_extra)
        line = (self.step_overhead, self.request_overhead, self.row_overhead)
        kept = self._curves.get(batch)
        if kept is None or kept[0] != line or len(kept[1]) <= max_extra:
            base, per_row = self.overhead(batch, batch), self.row_overhead
            kept = self._curves[batch] = (line, [f + base + per_row * n for n, f in enumerate(fwd)])
        return kept[1][: max_extra + 1]

    def _forward_curve(self, batch: int, max_extra: int) -> list[float]:
        """``[forward(batch, 1 + n / batch) for n in 0 .. max_extra]``, computed once per knot."""
        if batch <= self.padded_batch:  # a jump to the padded verify, then flat
            return [self.forward(batch, 1.0)] + [self.forward(batch, 2.0)] * max_extra
        near = [b for b in self.batches if b <= batch][-1:] + [b for b in self.batches if b >= batch][:1]
        knots = {0.0, float(max_extra)}
        knots.update((t - 1) * batch for b in near for t in self.tokens[b] if 0 < (t - 1) * batch < max_extra)
        xs = sorted(knots)
        ys = [self.forward(batch, 1.0 + x / batch) for x in xs]
        out, seg = [], 0
        for n in range(max_extra + 1):
            while seg + 1 < len(xs) - 1 and n > xs[seg + 1]:
                seg += 1
            x0, x1 = xs[seg], xs[min(seg + 1, len(xs) - 1)]
            y0, y1 = ys[seg], ys[min(seg + 1, len(xs) - 1)]
            out.append(y0 if x1 == x0 else y0 + (y1 - y0) * (n - x0) / (x1 - x0))
        return out

    def plain_cost(self, batch: int) -> float:
        """Estimated seconds of a step of ``batch`` requests without drafts, as such steps run
        (:attr:`plain_overhead` once observed, else a synchronous step's); never below a tenth
        of the forward."""
        fwd = self.forward(batch, 1.0)
        line = self.plain_overhead
        extra = self.overhead(batch, batch) if line is None else line[0] + line[1] * batch
        return max(fwd + extra, 0.1 * fwd)

    def observe_plain(self, batch: int, seconds: float) -> None:
        """Fold a measured step without drafts that ran asynchronously (its period: from its
        launch to the next one's) into :attr:`plain_overhead`: its time beyond the forward's
        estimate (which may be negative) at ``batch`` requests, a robust line through the
        latest :data:`OVERHEAD_WINDOW` of them, refitted as :meth:`observe`'s."""
        self.recent.append(("plain", batch, float(batch), seconds))
        self._plain_points.append((float(batch), seconds - self.forward(batch, 1.0)))
        self._plain_unfitted += 1
        if _refit_due(self._plain_unfitted, len(self._plain_points)):  # the first point too
            self._plain_unfitted = 0
            self.plain_overhead = robust_line(list(self._plain_points), clamp=False)


def _refit_due(unfitted: int, points: int) -> bool:
    """Whether a line is refitted now: at 1, 2, 4 ... points, then every :data:`REFIT_EVERY`."""
    return unfitted >= REFIT_EVERY or (points < REFIT_EVERY and points & (points - 1) == 0)


def robust_line(points: Sequence[tuple[float, float]], clamp: bool = True) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``points``, refitted without
    the points more than :data:`OUTLIER_MADS` median absolute deviations off the first fit;
    with ``clamp`` both at least zero (a non-negative slope, then the intercept through the
    mean); a flat line at the mean when the ``x`` have not varied."""

    def fit(pts: Sequence[tuple[float, float]]) -> tuple[float, float]:
        n = len(pts)
        sx = sy = sxx = sxy = 0.0
        for x, y in pts:
            sx += x
            sy += y
            sxx += x * x
            sxy += x * y
        mx, my = sx / n, sy / n
        var = sxx / n - mx * mx
        slope = (sxy / n - mx * my) / var if var > 1e-9 * max(mx * mx, 1.0) else 0.0
        if not clamp:
            return my - slope * mx, slope
        slope = max(slope, 0.0)
        return max(my - slope * mx, 0.0), slope

    if not points:
        return 0.0, 0.0
    a, b = fit(points)
    kept = _inliers(points, [abs(y - a - b * x) for x, y in points])
    return fit(kept) if len(kept) >= 2 else (a, b)


def _inliers(points: Sequence[tuple[float, ...]], residuals: list[float]) -> Sequence[tuple[float, ...]]:
    """The ``points`` whose residual off a first fit is within :data:`OUTLIER_MADS`
    (normal-scaled) median absolute deviations; all of them when that deviation is zero."""
    mad = 1.4826 * sorted(residuals)[len(residuals) // 2]
    if mad == 0:
        return points
    return [p for p, r in zip(points, residuals, strict=True) if r <= OUTLIER_MADS * mad]


def robust_plane(points: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """``(a, b, c)`` of the least-squares fit ``y = a + b x1 + c x2`` through ``points``
    ``(x1, x2, y)`` with ``b, c >= 0`` (the best fit, by squared error, among those over
    ``{x1, x2}``, ``{x2}``, ``{x1}`` and neither whose slopes come out non-negative; ``{x2}``
    before ``{x1}`` on a tie, as when the two have not varied apart) and ``a`` then clamped at
    zero; refitted without the points more than :data:`OUTLIER_MADS` median absolute
    deviations off the first fit."""
    if not points:
        return 0.0, 0.0, 0.0
    a, b, c = _nonneg_plane(points)
    kept = _inliers(points, [abs(y - a - b * x1 - c * x2) for x1, x2, y in points])
    return _nonneg_plane(kept) if len(kept) >= 3 else (a, b, c)


def _nonneg_plane(points: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """:func:`robust_plane`'s fit without the outlier pass (from the points' centred sums)."""
    n = len(points)
    m1 = sum(p[0] for p in points) / n
    m2 = sum(p[1] for p in points) / n
    my = sum(p[2] for p in points) / n
    s11 = s22 = s12 = s1y = s2y = syy = 0.0
    for x1, x2, y in points:
        d1, d2, dy = x1 - m1, x2 - m2, y - my
        s11 += d1 * d1
        s22 += d2 * d2
        s12 += d1 * d2
        s1y += d1 * dy
        s2y += d2 * dy
        syy += dy * dy
    eps = 1e-9 * max(s11, s22, 1.0)
    fits: list[tuple[float, float]] = []  # (b, c) candidates, in order of preference
    det = s11 * s22 - s12 * s12
    if s11 > eps and s22 > eps and det > eps * max(s11, s22):
        fits.append(((s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det))
    fits.append((0.0, s2y / s22 if s22 > eps else 0.0))
    fits.append((s1y / s11 if s11 > eps else 0.0, 0.0))
    fits.append((0.0, 0.0))
    best: tuple[float, float] | None = None
    best_sse = float("inf")
    for b, c in fits:
        if b < 0 or c < 0:
            continue
        sse = syy - 2 * (b * s1y + c * s2y) + b * b * s11 + 2 * b * c * s12 + c * c * s22
        if sse < best_sse - 1e-12 * max(syy, 1e-30):
            best, best_sse = (b, c), sse
    assert best is not None  # (0, 0) is always feasible
    b, c = best
    return max(my - b * m1 - c * m2, 0.0), b, c


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
