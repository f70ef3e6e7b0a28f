"""DSpark / fixed verify lengths against a brute-force optimum, the step-cost model, the
acceptance statistics and the n-gram drafter against a direct search."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from deepinfer_core.config import SpeculativeConfig
from deepinfer_core.speculative.drafter import DraftContext
from deepinfer_core.speculative.ngram import NgramDrafter, lookup
from deepinfer_core.speculative.policy import (
    PLAIN_PROBE_INTERVAL,
    PROBE_BACKOFF_CAP,
    PROBE_INTERVAL,
    ProbeSchedule,
    cumulative,
    drafting_gain,
    dspark_lengths,
    fixed_lengths,
    uniform_lengths,
)
from deepinfer_core.speculative.robust_fit import robust_line, robust_plane
from deepinfer_core.speculative.stats import (
    CALIBRATION_PRIOR,
    AcceptanceStats,
    ConfidenceCalibration,
    SpeculativeMetrics,
)
from deepinfer_core.speculative.step_cost import StepCost


def _value(lengths, confidences, cost):
    b = len(confidences)
    expected = b + sum(sum(c[:n]) for c, n in zip(confidences, lengths, strict=True))
    return expected / cost.cost(b, 1 + sum(lengths) / b)


@pytest.mark.parametrize("seed", range(12))
def test_dspark_lengths_maximise_expected_tokens_per_second(seed):
    """The greedy choice equals the best of every prefix-closed assignment (brute force)."""
    rng = random.Random(seed)
    b, k = rng.randint(1, 3), rng.randint(1, 4)
    per_token = rng.choice([0.0, 0.05, 0.3, 1.0])
    cost = StepCost(
        {(bb, t): 1.0 + per_token * bb * (t - 1) + 0.01 * bb for bb in (1, 4) for t in range(1, k + 2)}
    )
    confidences = [cumulative([rng.random() for _ in range(rng.randint(0, k))]) for _ in range(b)]
    budget = rng.randint(0, 2 * k)
    got = dspark_lengths(confidences, budget, cost)
    best = max(
        (
            lengths
            for lengths in itertools.product(*[range(len(c) + 1) for c in confidences])
            if sum(lengths) <= budget
        ),
        key=lambda lengths: _value(lengths, confidences, cost),
    )
    assert sum(got) <= budget
    assert _value(got, confidences, cost) == pytest.approx(_value(best, confidences, cost), rel=1e-12)


def test_dspark_verifies_only_where_it_pays():
    """Free extra tokens: every draft with a chance is verified; expensive ones: none."""
    conf = [cumulative([0.9, 0.9, 0.1]), cumulative([0.2])]
    free = StepCost({(1, 1): 1.0, (1, 4): 1.0})
    assert dspark_lengths(conf, 10, free) == [3, 1]
    dear = StepCost({(1, 1): 1.0, (1, 4): 4.0})
    assert dspark_lengths(conf, 10, dear) == [0, 0]
    assert dspark_lengths(conf, 1, free) == [1, 0]  # the budget takes the likeliest first


@pytest.mark.parametrize("seed", range(6))
def test_dspark_lengths_array_search_equals_the_tuple_search(seed, monkeypatch):
    """From :data:`ARRAY_SEARCH_MIN` candidates the search runs as array operations: the same
    lengths as the tuple sort on distinct confidences, the same expected value where ties
    (rates of 1, shared priors) let either request take the draft at the cut."""
    import deepinfer_core.speculative.policy as policy

    rng = random.Random(seed)
    b, k = rng.choice([(13, 5), (64, 5), (40, 3)])
    per_token = rng.choice([0.0, 0.002, 0.02])
    cost = StepCost(
        {(bb, t): 1.0 + per_token * bb * (t - 1) + 0.01 * bb for bb in (1, 16, 64) for t in (1, 4, 6)}
    )
    ties = seed % 2 == 1
    pool = [1.0, 0.9, 0.5, 0.3] if ties else None
    confidences = [
        cumulative([rng.choice(pool) if ties else rng.random() ** 0.3 for _ in range(rng.randint(0, k))])
        for _ in range(b)
    ]
    budget = rng.choice([5, 40, 1000])
    monkeypatch.setattr(policy, "ARRAY_SEARCH_MIN", 1)
    fast = dspark_lengths(confidences, budget, cost)
    monkeypatch.setattr(policy, "ARRAY_SEARCH_MIN", 10**9)
    slow = dspark_lengths(confidences, budget, cost)
    assert sum(fast) <= budget and all(0 <= n <= len(c) for n, c in zip(fast, confidences, strict=True))
    if ties:
        assert _value(fast, confidences, cost) == pytest.approx(_value(slow, confidences, cost), rel=1e-12)
    else:
        assert fast == slow


def test_causal_dspark_lengths_stop_at_the_first_non_improving_draft():
    """Algorithm 1's early stop (``causal``): a first draft that does not pay on its own is not
    admitted because a second one would make the pair pay (the global search admits both: with
    sampled drafts under rejection acceptance, the second's confidence depends on the realised
    first draft, so admitting the first through it biases the output -- the paper's Appendix A)."""
    cost = StepCost({(1, 1): 1.0, (1, 2): 2.0, (1, 3): 2.0})  # the first extra row costs, the second not
    conf = [cumulative([0.9, 1.0])]
    assert dspark_lengths(conf, 10, cost) == [2]  # (1 + 0.9 + 0.9) / 2 > 1
    assert dspark_lengths(conf, 10, cost, causal=True) == [0]  # (1 + 0.9) / 2 < 1: stop there
    cheap = StepCost({(1, 1): 1.0, (1, 3): 1.2})
    assert dspark_lengths(conf, 10, cheap, causal=True) == dspark_lengths(conf, 10, cheap) == [2]


def test_drafting_pays_counts_the_drafters_time():
    """Drafting pays when the expected extra tokens outweigh the verify cost plus the drafter's
    time; never when no draft is worth verifying."""
    conf = [cumulative([0.9, 0.8]), cumulative([0.9])]
    cost = StepCost({(2, 1): 1.0, (2, 3): 1.2})
    assert drafting_gain(conf, 10, cost, draft_seconds=0.0) > 1
    # (2 + 0.9 + 0.72 + 0.9) / (1.15 + d) > 2 / 1.0  <=>  d < 1.11
    assert drafting_gain(conf, 10, cost, draft_seconds=1.0) > 1
    assert not drafting_gain(conf, 10, cost, draft_seconds=1.2) > 1
    assert not drafting_gain([cumulative([0.0, 0.0])] * 2, 10, cost, draft_seconds=0.0) > 1
    assert not drafting_gain(conf, 0, cost, draft_seconds=0.0) > 1  # no budget for drafts


def test_fixed_lengths_respect_the_budget():
    assert fixed_lengths([3, 2, 4], 6) == [3, 2, 1]
    assert fixed_lengths([3, 2], 0) == [0, 0]


def test_step_cost_interpolates_and_fits_the_overhead_per_step_and_row():
    cost = StepCost({(1, 1): 1.0, (1, 3): 3.0, (4, 1): 2.0, (4, 3): 6.0, (8, 1): 2.5})
    assert cost.cost(1, 2) == pytest.approx(2.0)
    assert cost.cost(2, 1) == pytest.approx(1.0 + (2.0 - 1.0) / 3)
    assert cost.cost(16, 1) == pytest.approx(5.0)  # proportional beyond the largest batch
    assert cost.cost(8, 3) == pytest.approx(2.5)  # one t measured there: constant in t
    cost.observe(1, 1, 2.0)  # a whole step took 1 s more than the forward
    assert (cost.step_overhead, cost.row_overhead) == (pytest.approx(1.0), 0.0)  # one point: flat
    assert cost.cost(1, 3) == pytest.approx(4.0)
    cost.observe(1, 2, 1.5)  # faster than the forward's estimate: no negative overhead
    # the line through the two (falling with the rows) is flattened: the mean
    assert cost.overhead(1, 1) == pytest.approx(0.5) and cost.overhead(2, 1) == pytest.approx(0.5)
    # steps whose host time is 0.5 s + 0.25 s per row: the fit finds that line
    for _ in range(60):
        for b, t in ((4, 1), (4, 3), (1, 3), (4, 2)):
            cost.observe(b, t, cost.forward(b, t) + 0.5 + 0.25 * b * t)
    assert cost.step_overhead == pytest.approx(0.5, abs=1e-9)
    assert cost.row_overhead == pytest.approx(0.25, abs=1e-9)
    assert cost.cost(4, 3) == pytest.approx(6.0 + 0.5 + 3.0, abs=1e-9)


def test_step_cost_overhead_line_ignores_slow_outliers_and_a_short_tail():
    """A few slow steps (a descheduled process) and a run's tail of few requests do not tilt
    the overhead line: it was an exponentially weighted fit that followed both and priced
    every verified row at 8x its cost on the CPU."""
    cost = StepCost({(1, 1): 1.0, (1, 6): 1.2, (16, 1): 2.0, (16, 6): 3.0})
    rng = random.Random(0)

    def step(b: int, t: int, spike: float = 0.0) -> None:
        cost.observe(b, t, cost.forward(b, t) + 0.6 + 0.01 * b * t + rng.uniform(-0.02, 0.02) + spike)

    for i in range(100):  # steps of 16 requests verifying 0..5 drafts each
        step(16, 1 + i % 6, spike=3.0 if i % 25 == 24 else 0.0)
    for i in range(64):  # the tail: one request left, one slow step among its steps
        step(1, 1 + i % 6, spike=2.0 if i == 50 else 0.0)  # (refitted at step 160, in the tail)
    assert cost.step_overhead == pytest.approx(0.6, abs=0.03)
    assert cost.row_overhead == pytest.approx(0.01, abs=0.002)


def test_step_cost_tells_per_request_from_per_row_overhead():
    """Host work per request (inputs, outputs) and per verified row (sampling) are fitted
    apart: a batch's tail of few requests verifying few rows and full batches verifying many
    price a full verify step right, where a line in the rows alone charges per-request work
    to rows and misprices it.
    While requests and rows have not varied apart (no drafts yet) the fit is per row alone,
    as before; no term is negative."""
    table = {(1, 1): 1e-3, (1, 6): 1.1e-3, (64, 1): 4e-3, (64, 6): 9e-3}
    cost = StepCost(table)
    for _ in range(8):  # plain synchronous steps only: rows == batch
        for b in (1, 2, 4):
            cost.observe(b, 1, cost.forward(b, 1) + 1e-3 + 50e-6 * b)
    assert cost.request_overhead == 0.0 and cost.row_overhead == pytest.approx(50e-6)
    true = {"step": 1e-3, "request": 60e-6, "row": 4e-6}
    rng = random.Random(1)
    for i in range(128):  # full batches verifying 0..5 drafts each, then a tail of 1..4 requests
        b, t = (64, 1 + i % 6) if i < 64 else (1 + i % 4, 1 + (i // 4) % 6)
        extra = true["step"] + true["request"] * b + true["row"] * b * t + rng.uniform(-1e-5, 1e-5)
        cost.observe(b, t, cost.forward(b, t) + extra)
    assert cost.step_overhead == pytest.approx(true["step"], rel=0.05)
    assert cost.request_overhead == pytest.approx(true["request"], rel=0.05)
    assert cost.row_overhead == pytest.approx(true["row"], rel=0.1)
    assert cost.cost(64, 6) == pytest.approx(9e-3 + 1e-3 + 64 * 60e-6 + 384 * 4e-6, rel=0.01)
    # a line in the rows alone through the same steps misprices the full verify step
    truth = 9e-3 + 1e-3 + 64 * 60e-6 + 384 * 4e-6
    a, per_row = robust_line([(rows, extra) for _, rows, extra in cost._points])
    assert abs(9e-3 + a + per_row * 384 - truth) > 5 * abs(cost.cost(64, 6) - truth)
    _, b, c = robust_plane([(1.0, 2.0, 5.0), (2.0, 1.0, 1.0), (3.0, 3.0, 4.0)])
    assert b >= 0 and c >= 0


def test_plain_steps_learn_their_own_cost_and_drafting_weighs_it():
    """A step without drafts that ran asynchronously may cost less than the synchronously
    measured forward (negative :attr:`plain_overhead`).  Drafting is weighed against the
    plain step as it runs: verifying two sure drafts triples the tokens of a step costing
    1.5x a synchronous plain one, but not of one that overlaps; and the per-row overhead makes
    verifying rows dearer."""
    cost = StepCost({(1, 1): 1.0, (1, 3): 1.5})
    assert cost.plain_cost(1) == pytest.approx(1.0)  # nothing observed: a synchronous step
    assert drafting_gain([[1.0, 1.0]], 2, cost, 0.0) > 1  # 3 tokens / 1.5 s > 1 token / 1 s
    cost.observe_plain(1, 0.4)
    assert cost.plain_overhead == pytest.approx((-0.6, 0.0))
    assert cost.plain_cost(1) == pytest.approx(0.4)
    assert not drafting_gain([[1.0, 1.0]], 2, cost, 0.0) > 1  # 3 / 1.5 s < 1 / 0.4 s
    cost.observe_plain(1, 0.0)
    assert cost.plain_cost(1) == pytest.approx(0.2)  # one batch size: the mean, -0.8
    cost.plain_overhead = (-2.0, 0.0)
    assert cost.plain_cost(1) == pytest.approx(0.1)  # never below a tenth of the forward
    sync = StepCost({(1, 1): 1.0, (1, 3): 1.5})
    assert drafting_gain([[0.3, 0.09]], 2, sync, 0.0) > 1  # one draft: 1.3 tokens / 1.25 s > 1 / 1 s
    sync.row_overhead = 1.0  # each verified row costs a second of host time
    assert not drafting_gain([[0.3, 0.09]], 2, sync, 0.0) > 1  # 1.3 / (1.25 + 2) s < 1 / (1 + 1) s


def test_plain_step_overhead_is_a_line_in_the_batch_not_the_last_steps_average():
    """The overhead of asynchronous plain steps grows with the requests a step serves: it is
    fitted as a line in the batch size, so a batch's tail (a few requests, observed last)
    does not set the price of a full batch's plain step; overlapped steps may lie below the
    forward (negative overhead, kept: no clamping)."""
    cost = StepCost({(1, 1): 1e-3, (64, 1): 4e-3})
    for i in range(96):  # full batches, 2 ms of host work beyond the forward each
        cost.observe_plain(64, 4e-3 + 2e-3 + (1e-5 if i % 2 else -1e-5))
    for _ in range(64):  # then a tail: one request, its host work overlapped (-0.5 ms)
        cost.observe_plain(1, 1e-3 - 0.5e-3)
    assert cost.plain_cost(64) == pytest.approx(6e-3, rel=0.02)  # not 64 requests at the tail's price
    assert cost.plain_cost(1) == pytest.approx(0.5e-3, rel=0.05)
    a, per_request = cost.plain_overhead
    assert a < 0 < per_request


def _probe_gaps(schedule, pays, steps):
    """Steps between the overrides (probes) of ``schedule`` under a constant decision."""
    gaps, last = [], -1
    for i in range(steps):
        if schedule.decide(pays) != pays:
            gaps.append(i - last - 1)
            last = i
    return gaps


@pytest.mark.parametrize(("pays", "base"), [(True, PLAIN_PROBE_INTERVAL), (False, PROBE_INTERVAL)])
def test_probes_back_off_while_they_confirm_the_decision(pays, base):
    """Under a constant decision the probes come after ``base`` steps, then twice, four
    times... as many, up to the cap; a flip of the decision resets the interval."""
    schedule = ProbeSchedule()
    cap = PROBE_BACKOFF_CAP * base
    steps = sum(min(base * 2**i, cap) + 1 for i in range(6))
    gaps = _probe_gaps(schedule, pays, steps)
    assert gaps == [min(base * 2**i, cap) for i in range(6)]
    assert schedule.decide(not pays) == (not pays)  # the flip itself is never overridden
    assert _probe_gaps(schedule, pays, base + 1) == [base]  # reset to the base interval


def test_certain_drafting_is_not_probed_on_the_plain_side():
    """Drafting that pays beyond ``CERTAIN_GAIN`` runs no plain probe (none could flip it); a
    merely profitable decision is probed after the base interval, and a decision that drafting
    does not pay keeps its draft probes whatever ``certain`` says."""
    certain = ProbeSchedule()
    assert all(certain.decide(True, certain=True) for _ in range(10 * PLAIN_PROBE_INTERVAL))
    assert _probe_gaps(ProbeSchedule(), True, PLAIN_PROBE_INTERVAL + 1) == [PLAIN_PROBE_INTERVAL]
    unsure = ProbeSchedule()
    assert [unsure.decide(False, certain=True) for _ in range(PROBE_INTERVAL + 1)][-1] is True


def test_acceptance_stats_are_conditional_rates():
    s = AcceptanceStats(3)
    s.record(3, 1)  # d1 accepted, d2 rejected, d3 never tested
    s.record(2, 2)
    assert s.tried == [2, 2, 0] and s.accepted == [2, 1, 0]
    assert s.rate(1, prior=0.5, weight=0.0) == 0.5
    assert s.rate(2, prior=0.3) == pytest.approx(0.3)  # no data: the prior
    # the drafter's reach P(len >= i), counted where it was asked for i drafts
    s.record_proposal(3, 0)
    s.record_proposal(3, 2)
    s.record_proposal(1, 1)
    assert s.asked == [3, 2, 2] and s.proposed == [2, 1, 0]
    assert s.reach(0, prior=1.0, weight=0.0) == pytest.approx(2 / 3)
    assert s.reach(2, prior=1.0, weight=0.0) == 0.0
    priors = [0.9, 0.5, 0.2]  # every position at once: the same numbers
    assert s.rates(priors) == [s.rate(i, p) for i, p in enumerate(priors)]
    assert s.reaches(priors[:2]) == [s.reach(i, p) for i, p in enumerate(priors[:2])]
    # their running products in one pass: the identity with the rates' products
    products = [math.prod(s.rates(priors)[: i + 1]) for i in range(3)]
    assert s.cumulative_rates(priors) == pytest.approx(products)
    assert s.cumulative_rates(priors[:2]) == pytest.approx(cumulative(s.rates(priors[:2])))
    # recency-weighted: with decay, the latest observations outweigh an older run of them
    r = AcceptanceStats(1, decay=0.5)
    for _ in range(10):
        r.record(1, 0)
    r.record(1, 1)
    r.record(1, 1)
    assert r.rate(0, prior=0.0, weight=0.0) == pytest.approx(1.5 / (1.5 + 0.25 * (2 - 2**-9)))  # ~0.75
    assert AcceptanceStats(1).rate(0, prior=0.5) == 0.5


def test_padded_verify_steps_cost_the_longest_verify():
    """Verify graphs pad every verify step to ``1 + k`` tokens per request: with
    ``padded_batch``, one draft costs what ``k`` do (no interpolation between ``t = 1`` and
    the measured ``t``), up to that batch; beyond it the eager steps interpolate."""
    table = {(4, 1): 1.0, (4, 3): 2.0, (4, 6): 2.0, (8, 1): 1.5, (8, 3): 3.0, (8, 6): 3.5}
    free, padded = StepCost(table), StepCost(table, padded_batch=4)
    assert free.forward(4, 1.5) == pytest.approx(1.25)
    assert padded.forward(4, 1.5) == pytest.approx(2.0) == padded.forward(4, 6.0)
    assert padded.forward(4, 1.0) == 1.0
    assert padded.forward(8, 1.5) == free.forward(8, 1.5) == pytest.approx(1.875)
    padded.row_overhead = 0.01
    assert padded.costs(4, 3) == pytest.approx([1.04, 2.05, 2.06, 2.07])
    # one sure draft per request pays where a verify costs twice a plain step only if each
    # request gets it: a lookup drafter that proposes for one request in ten does not
    sure = [[1.0, 1.0, 1.0]] * 4
    assert drafting_gain(sure, 12, padded, 0.0) > 1
    assert not drafting_gain(sure, 12, padded, 0.0, reach=[[0.1, 0.1, 0.1]] * 4) > 1


def test_speculative_metrics():
    m = SpeculativeMetrics(3)
    m.record(proposed=3, verified=3, accepted=2)
    m.record(proposed=2, verified=1, accepted=0)
    m.record(proposed=0, verified=0, accepted=0)
    d = m.as_dict()
    assert d["num_drafts"] == 2 and d["num_draft_tokens"] == 4 and d["num_accepted_tokens"] == 2
    assert d["mean_acceptance_length"] == 2.0
    assert d["acceptance_per_position"] == [0.5, 1.0, 0.0]
    assert d["verify_length_histogram"] == [1, 1, 0, 1]


def _naive_lookup(tokens, n_min, n_max, k):
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if starts:
            i = starts[-1]
            return tokens[i + n : i + n + k]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_ngram_lookup_matches_a_direct_search(seed):
    rng = random.Random(seed)
    tokens = [rng.randint(0, 4) for _ in range(rng.randint(1, 40))]
    n_min = rng.randint(1, 3)
    n_max = n_min + rng.randint(0, 3)
    k = rng.randint(1, 6)
    assert lookup(tokens, n_min, n_max, k) == _naive_lookup(tokens, n_min, n_max, k)


def test_ngram_drafter_proposes_the_continuation_of_the_last_match():
    drafter = NgramDrafter(SpeculativeConfig(ngram_min=2, ngram_max=3), vocab_size=100)
    ctx = DraftContext("r", [5, 6, 7, 8, 9, 1, 5, 6, 7], num_prompt_tokens=9, max_tokens=3)
    assert drafter.propose([ctx])[0].token_ids == [8, 9, 1]
    none = DraftContext("s", [1, 2, 3], num_prompt_tokens=3, max_tokens=3)
    assert drafter.propose([none])[0].token_ids == []


@pytest.mark.parametrize("padded_batch", [0, 4])
@pytest.mark.parametrize("batch", [1, 3, 4, 6, 8, 20])
def test_step_cost_curve_equals_pointwise_costs(batch, padded_batch):
    """:meth:`StepCost.costs` (evaluated at the knots, interpolated between) equals
    :meth:`StepCost.cost` at every draft count, between, beyond and at the measured points,
    with and without padded verify steps."""
    table = {(1, 1): 1.0, (1, 3): 3.0, (1, 6): 4.0, (4, 1): 2.0, (4, 3): 6.0, (8, 1): 2.5, (8, 6): 9.0}
    cost = StepCost(table, padded_batch=padded_batch)
    cost.step_overhead, cost.row_overhead = 0.3, 0.05
    curve = cost.costs(batch, 7 * batch)
    assert len(curve) == 7 * batch + 1
    for n, c in enumerate(curve):
        assert c == pytest.approx(cost.cost(batch, 1 + n / batch), rel=1e-9), n
    # a shorter curve is the kept longer one's prefix; a new overhead line recomputes it
    short = cost.costs(batch, 2 * batch)
    assert short == curve[: 2 * batch + 1]
    cost.row_overhead = 0.5
    for n, c in enumerate(cost.costs(batch, 3 * batch)):
        assert c == pytest.approx(cost.cost(batch, 1 + n / batch), rel=1e-9), n


def test_confidence_calibration_scales_by_realised_over_predicted():
    """A drafter that claims 0.9 at every position, whose first draft passes half the time and
    whose second always does when reached: position 1 is scaled towards 0.5 / 0.9, position 2
    towards 1 / 0.9 (clamped at 1); an unseen position keeps the drafter's word."""
    cal = ConfidenceCalibration(3)
    assert cal.apply([0.9, 0.9, 0.9]) == pytest.approx([0.9, 0.9, 0.9])
    for i in range(400):
        cal.record([0.9, 0.9, 0.9], 2, 2 if i % 2 else 0)
    assert cal.ratio(0) == pytest.approx(0.5 / 0.9, rel=0.05)  # recency weights: the last verify passed
    assert cal.ratio(1) == pytest.approx(1 / 0.9, rel=0.05)
    assert cal.ratio(2) == 1.0 and CALIBRATION_PRIOR > 0
    assert cal.apply([0.9, 0.95, 0.3]) == pytest.approx([0.5, 1.0, 0.3], rel=0.05)


@pytest.mark.parametrize("seed", range(8))
def test_uniform_lengths_are_the_best_single_length(seed):
    """Without varlen verify every request verifies ``min(L, its drafts)`` for one ``L``: the
    best such ``L`` by brute force, never better than the per-request optimum."""
    rng = random.Random(seed)
    b, k = rng.randint(1, 4), rng.randint(1, 5)
    cost = StepCost(
        {(bb, t): 1.0 + rng.choice([0.02, 0.1, 0.4]) * bb * (t - 1) for bb in (1, 4) for t in (1, k + 1)}
    )
    confidences = [cumulative([rng.random() for _ in range(rng.randint(0, k))]) for _ in range(b)]
    budget = rng.randint(0, 2 * k)
    got = uniform_lengths(confidences, budget, cost)
    candidates = [
        fixed_lengths([min(length, len(c)) for c in confidences], budget) for length in range(k + 1)
    ]
    assert got in candidates
    assert _value(got, confidences, cost) == pytest.approx(
        max(_value(c, confidences, cost) for c in candidates)
    )
    assert (
        _value(got, confidences, cost)
        <= _value(dspark_lengths(confidences, budget, cost), confidences, cost) + 1e-12
    )
