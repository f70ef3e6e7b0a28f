"""Robust least-squares fits of a step's measured host overhead: a line (:func:`robust_line`)
and a plane with non-negative slopes (:func:`robust_plane`), each refitted without the
outliers of a first fit (points more than :data:`OUTLIER_MADS` median absolute deviations off)."""

from __future__ import annotations

from collections.abc import Sequence

OUTLIER_MADS = 4.0
"""A step whose time is this many (normal-scaled) median absolute deviations off the first
line is left out of the second fit (a descheduled process, a collection, a page fault)."""


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
