"""The step cost model of speculative decoding (:class:`StepCost`): measured forward times by
batch size and tokens per request, interpolated, plus the host overhead learned from the steps
run (:mod:`.robust_fit`)."""

from __future__ import annotations

import bisect
from collections import deque

from .robust_fit import robust_line, robust_plane

RECENT_STEPS = 64
"""Observed steps :class:`StepCost` keeps for inspection (``get_metrics``)."""
FORWARD_CACHE = 4096
"""Points :meth:`StepCost.forward` keeps (a step's batch and tokens per request repeat)."""
OVERHEAD_WINDOW = 128
"""Steps :class:`StepCost` fits each overhead to (the latest synchronous ones; the latest plain
ones)."""
REFIT_EVERY = 64
"""Observed steps between two fits of the overhead line (before that: at 1, 2, 4 ... 32 steps;
a fit of the full window costs ~0.1 ms of host time on the CPU)."""


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
