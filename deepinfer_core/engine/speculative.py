"""Speculative decoding in the engine step: draft, schedule the verify, sample every verified
position, accept.

Per step (the engine runs steps synchronously while speculating: the drafts of step N+1 need
step N's tokens on the host):

1. :meth:`SpeculativeDecoder.propose` asks the drafter for the decoding requests' drafts and
   lets the policy (``fixed`` / ``dspark``, :mod:`deepinfer_core.speculative.policy`) choose
   how many each verifies; they go to ``Request.draft_token_ids``, and the scheduler emits
   ``[last token, drafts...]`` as one chunk (``SeqChunk.num_draft``), cut to the token budget
   and the free pages (drafts never preempt anyone).
2. The forward returns the logits of every verified position.
3. :meth:`SpeculativeDecoder.sample` processes row ``i`` of a chunk as plain decoding would
   after ``d1 .. di``: penalties and ``min_tokens`` count them, grammar matchers advance over
   them (then roll back), logits processors get them (then roll back); the sampler draws
   the target's token at each row with the usual counter-based keys; then
   :mod:`deepinfer_core.speculative.verify` accepts (``match`` or ``rejection``).
4. :meth:`~deepinfer_core.engine.scheduler.Scheduler.complete_tokens` appends the emitted
   tokens and sets ``num_computed_tokens`` back to the accepted end (the caches keep room for
   the drafts, so rejected ones leave no trace: ``EngineConfig.num_spec_tokens``).
5. :meth:`SpeculativeDecoder.observe` tells a drafter that follows the target (the ``mtp``
   drafter, whose MTP layer reads the target's hidden states) which positions were kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.engine.request import RequestStatus
from deepinfer_core.errors import ConfigError
from deepinfer_core.sampling.batch import SamplingBatch
from deepinfer_core.sampling.logprobs import top_logprobs
from deepinfer_core.sampling.penalties import bitmask_words
from deepinfer_core.sampling.random import row_keys
from deepinfer_core.speculative.drafter import ComputedChunk, Draft, DraftContext, Drafter, RowView
from deepinfer_core.speculative.policy import (
    CERTAIN_GAIN,
    EMA,
    MAX_REUSE_STEPS,
    SETTLED_GAIN,
    SETTLED_STEPS,
    UNSETTLED_STEPS,
    ProbeSchedule,
    cumulative,
    drafting_gain,
    dspark_lengths,
    fixed_lengths,
    uniform_lengths,
)
from deepinfer_core.speculative.stats import (
    REQUEST_DECAY,
    AcceptanceStats,
    ConfidenceCalibration,
    SpeculativeMetrics,
)
from deepinfer_core.speculative.step_cost import StepCost
from deepinfer_core.speculative.verify import (
    accept_match,
    accept_rejection,
    acceptance_uniform,
    residual_draws,
)

if TYPE_CHECKING:
    from deepinfer_core.config import SpeculativeConfig
    from deepinfer_core.contract.batch import SeqChunk
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.engine.request import Request
    from deepinfer_core.engine.scheduler import SchedulerOutput

logger = logging.getLogger("deepinfer.engine")


@dataclass
class VerifyResult:
    """Per sampling chunk, the tokens it emits and their logprobs (``None`` entries when not
    asked for)."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float] | None]]
    num_accepted: int = 0  # draft tokens accepted over the step's chunks


class SpeculativeDecoder:
    """The engine's speculative decoding (see the module docstring).

    Args:
        engine: the engine (its config's ``speculative``, plugins, scheduler, sampler, runner).
    """

    def __init__(self, engine: LLMEngine, drafter_cls: type[Drafter] | None = None) -> None:
        cfg = engine.config.speculative
        assert cfg is not None
        self.engine = engine
        self.config = cfg
        if drafter_cls is None:
            drafter_cls = drafter_class(cfg, engine.plugins)
        self.drafter = drafter_cls(cfg, engine.model_config.vocab_size)
        self.drafter.bind(engine.runner)
        self.metrics = SpeculativeMetrics(cfg.max_draft_tokens)
        self.global_stats = AcceptanceStats(cfg.max_draft_tokens)
        self._stats: dict[str, AcceptanceStats] = {}
        self._proposed: dict[str, int] = {}
        self._draft_probs: dict[str, torch.Tensor | None] = {}
        self._draft_conf: dict[str, list[float]] = {}  # the drafter's own confidences, by request
        self.calibration = ConfidenceCalibration(cfg.max_draft_tokens)
        self.cost: StepCost | None = None
        self.draft_seconds = 0.0  # the drafter's time per propose call (EMA)
        self._step_draft_seconds = 0.0  # this step's, kept out of the cost model's overhead
        self._probes = ProbeSchedule()  # dspark: when to draft (or not) against the estimate
        k = self.config.max_draft_tokens
        self._halves, self._ones = [0.5] * k, [1.0] * k  # the engine-wide rates' priors
        self._pays = False  # dspark: the last weighed decision ...
        self._certain = False  # ... whether it pays beyond CERTAIN_GAIN (no plain probes) ...
        self._settled = 0  # ... reused for this many more steps (it was clear)
        self._reuse = 0  # ... for how many the last time it was weighed
        self._drafting = False  # this step asks the drafter (:meth:`wants_drafts`)
        self._cands: list[tuple[Request, int]] | None = None  # wants_drafts' candidates, if still valid
        self._estimates: list[list[float]] | None = None  # and their confidences (dspark)
        self.drafter_observes = type(self.drafter).observe is not Drafter.observe
        if cfg.method == "dspark":
            self.cost = self._profile_cost()

    def metrics_dict(self) -> dict[str, Any]:
        """``LLM.get_metrics()["speculative"]``: the totals
        (:meth:`~deepinfer_core.speculative.stats.SpeculativeMetrics.as_dict`) and, for
        ``dspark``, ``cost_model``: what the policy currently believes — the profiled forward
        per ``"B x t"`` and the fitted host overheads in ms (a plain step's as ``[intercept,
        per request]``), the drafter's time per call, the
        engine-wide acceptance rate per draft position (shrunk towards 0.5), the drafter's
        reach, the probe intervals and the latest observed steps (kind, batch, rows, ms)."""
        out = self.metrics.as_dict()
        cost = self.cost
        if cost is not None:
            out["cost_model"] = {
                "forward_ms": {f"{b}x{t}": 1e3 * v for (b, t), v in sorted(cost.table.items())},
                "step_overhead_ms": 1e3 * cost.step_overhead,
                "request_overhead_ms": 1e3 * cost.request_overhead,
                "row_overhead_ms": 1e3 * cost.row_overhead,
                "plain_overhead_ms": None
                if cost.plain_overhead is None
                else [1e3 * v for v in cost.plain_overhead],
                "draft_ms": 1e3 * self.draft_seconds,
                "acceptance_estimate": self._global_rates(),
                "proposal_estimate": self._global_reach(),
                "probe_intervals": [self._probes.draft_interval, self._probes.plain_interval],
                "confidence_calibration": [
                    self.calibration.ratio(i) for i in range(self.config.max_draft_tokens)
                ],
                "recent_steps": [[kind, b, rows, 1e3 * sec] for kind, b, rows, sec in cost.recent],
            }
        return out

    # ---- set-up ------------------------------------------------------------------------------
    def _profile_cost(self) -> StepCost:
        """Time steps of ``B`` requests x ``t`` tokens (``t`` = 1, the middle, ``1 + k``) for a
        few batch sizes up to ``max_num_seqs`` — the cost curve DSpark weighs drafts against."""
        runner, k = self.engine.runner, self.config.max_draft_tokens
        budget = self.engine.config.max_num_batched_tokens
        batches = sorted(
            {b for b in (1, 4, 16, 64, runner.kv_cache.num_slots) if b <= runner.kv_cache.num_slots}
        )
        table: dict[tuple[int, int], float] = {}
        t0 = time.perf_counter()
        for b in batches:
            for t in sorted({1, 1 + (k + 1) // 2, 1 + k}):
                if b * t <= budget + runner.kv_cache.num_slots:
                    table[(b, t)] = runner.time_step(b, t)
        logger.info(
            "speculative decoding (%s, drafter %r, up to %d drafts): step cost profiled in %.2f s: %s",
            self.config.method,
            self.config.drafter,
            k,
            time.perf_counter() - t0,
            ", ".join(f"B={b} t={t}: {1e3 * s:.2f} ms" for (b, t), s in sorted(table.items())),
        )
        # verify graphs run every verify step of up to their largest bucket padded to 1 + k tokens
        return StepCost(table, padded_batch=max(runner.verify_graphs, default=0))

    # ---- before the step -------------------------------------------------------------------------
    def _candidates(self, running: Sequence[Request]) -> list[tuple[Request, int]]:
        """The decoding requests that could verify drafts this step, with the most drafts each
        has room for (``max_draft_tokens``, ``max_tokens``, ``max_model_len``)."""
        engine, k = self.engine, self.config.max_draft_tokens
        out = []
        for req in running:
            if req.num_uncomputed_tokens != 1 or req.is_finished:
                continue
            room = min(
                k,
                req.params.max_tokens - len(req.output_token_ids) - req.num_pending - 1,
                engine.max_model_len - req.num_tokens - req.num_pending - 1,
            )
            if room >= 1 and self._can_roll_back(req):
                out.append((req, room))
        return out

    def wants_drafts(self, running: Sequence[Request]) -> bool:
        """Whether this step asks the drafter; called once per step, before :meth:`propose`
        and, with async scheduling, before the step still in flight is processed (a step that
        drafts needs its tokens first; one that does not runs asynchronously like plain
        decoding).  ``False`` when no decoding request has room for a draft, and for ``dspark``
        when drafting is not expected to pay (:meth:`_drafting_pays`)."""
        cands = self._candidates(running)
        # reused by propose() unless a step still in flight (a request has a pending token)
        # may be processed in between
        self._cands = None if any(req.num_pending for req in running) else cands
        self._estimates = None
        self._drafting = bool(cands)
        if cands and self.cost is not None:
            budget = self.engine.config.max_num_batched_tokens - len(cands)
            if not self._drafting_pays(cands, budget):
                self.metrics.num_steps_without_drafting += 1
                self._drafting = False
        return self._drafting

    def propose(self, running: Sequence[Request]) -> None:
        """Set the drafts each decoding request verifies this step (``Request.draft_token_ids``;
        none unless :meth:`wants_drafts` said so)."""
        engine = self.engine
        self._step_draft_seconds = 0.0
        for req in running:
            req.draft_token_ids = []
        if not self._drafting:
            return
        self._drafting = False
        estimates = self._estimates if self._cands is not None else None
        cands = self._cands if self._cands is not None else self._candidates(running)
        if not cands:
            return
        reqs = [req for req, _ in cands]
        contexts = [
            DraftContext(
                req.request_id,
                req.token_slice(0, req.num_tokens),
                req.num_prompt_tokens,
                room,
                seq_slot=-1 if req.seq_slot is None else req.seq_slot,
                window_from=req.window_from,
                params=req.params,
                sampling_seed=req.sampling_seed,
                eos_token_ids=engine.eos_token_ids,
            )
            for req, room in cands
        ]
        budget = engine.config.max_num_batched_tokens - len(reqs)
        t0 = time.perf_counter()
        drafts = self.drafter.propose(contexts)
        self._step_draft_seconds = elapsed = time.perf_counter() - t0
        self.draft_seconds = (
            elapsed if not self.draft_seconds else (1 - EMA) * self.draft_seconds + EMA * elapsed
        )
        if len(drafts) != len(contexts):
            raise RuntimeError(
                f"drafter {self.config.drafter!r} returned {len(drafts)} drafts for {len(contexts)} requests"
            )
        vocab = engine.model_config.vocab_size
        proposed = []
        for ctx, draft in zip(contexts, drafts, strict=True):
            bad = [t for t in draft.token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise RuntimeError(
                    f"drafter {self.config.drafter!r} proposed token ids {bad[:5]} outside the vocabulary "
                    f"[0, {vocab}) for request {ctx.request_id!r}"
                )
            del draft.token_ids[ctx.max_tokens :]
            proposed.append(len(draft.token_ids))
        if self.config.method == "fixed" or self._probes.probing:  # a probe verifies every draft
            lengths = fixed_lengths(proposed, budget)
        else:
            assert self.cost is not None
            confidences = self._confidences(cands, drafts, proposed, estimates)
            # sampled drafts under rejection acceptance: Algorithm 1's early stop keeps it exact
            causal = self.config.acceptance == "rejection" and any(d.probs is not None for d in drafts)
            if self.config.varlen:
                lengths = dspark_lengths(confidences, budget, self.cost, causal=causal)
            else:  # one verify length for every request of the step
                lengths = uniform_lengths(confidences, budget, self.cost, causal=causal)
        for (req, room), draft, n in zip(cands, drafts, lengths, strict=True):
            req.draft_token_ids = list(draft.token_ids[:n])
            self._proposed[req.request_id] = m = len(draft.token_ids)
            if self.cost is not None:  # dspark: the drafter's reach, for _drafting_pays
                self._request_stats(req).record_proposal(room, m)
                self.global_stats.record_proposal(room, m)
        self._draft_probs = {r.request_id: d.probs for r, d in zip(reqs, drafts, strict=True)}
        if self.cost is not None:  # dspark: the drafter's confidences, for their calibration
            self._draft_conf = {
                r.request_id: list(d.confidence) for r, d in zip(reqs, drafts, strict=True) if d.confidence
            }

    def _confidences(
        self,
        cands: list[tuple[Request, int]],
        drafts: list[Draft],
        proposed: list[int],
        estimates: list[list[float]] | None,
    ) -> list[list[float]]:
        """``dspark``: each request's cumulative acceptance probability per proposed draft —
        the drafter's own confidence (calibrated online) where it gives one, else the running
        rates (``estimates`` when :meth:`_drafting_pays` computed them this step; else computed
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
                prior = self._global_rates() if prior is None else prior
                out.append(self._rate_confidence(cands[i][0], n, prior))
        return out

    def _drafting_pays(self, cands: list[tuple[Request, int]], budget: int) -> bool:
        """``dspark``: whether to ask the drafter this step (:func:`drafting_gain` above 1, on
        the requests' running acceptance rates weighted by the drafter's reach, and the
        drafter's measured time, against a step without drafts as such steps run).  A clear
        decision (gain beyond :data:`SETTLED_GAIN` either way) is reused for the next
        :data:`SETTLED_STEPS` steps without weighing (another for :data:`UNSETTLED_STEPS`),
        one that the weighing confirms for twice as many as the last time (up to
        :data:`MAX_REUSE_STEPS`).
        Both sides stay measured: now and then a step drafts although it does not pay (so the
        acceptance rates can recover) or runs without drafts although drafting pays (so the
        cost of a plain step, asynchronous where the engine can, stays known) —
        :class:`~deepinfer_core.speculative.policy.ProbeSchedule`."""
        assert self.cost is not None
        if self._settled > 0:  # the last decision, reused (SETTLED_STEPS / UNSETTLED_STEPS)
            self._settled -= 1
            return self._probes.decide(self._pays, self._certain)
        prior = self._global_rates()
        estimates = [self._rate_confidence(req, room, prior) for req, room in cands]
        if self._cands is not None:
            self._estimates = estimates  # propose() takes the drafts' prefixes of them
        prior_reach = self._global_reach()
        reach = [self._reach(req, room, prior_reach) for req, room in cands]
        gain = drafting_gain(estimates, budget, self.cost, self.draft_seconds, reach)
        pays, self._certain = gain > 1.0, gain > CERTAIN_GAIN
        clear = gain > SETTLED_GAIN or gain * SETTLED_GAIN < 1.0
        base = SETTLED_STEPS if clear else UNSETTLED_STEPS
        confirmed = self._reuse > 0 and pays == self._pays  # the same answer as last time
        self._reuse = min(max(2 * self._reuse, base), MAX_REUSE_STEPS) if confirmed else base
        self._pays, self._settled = pays, self._reuse
        return self._probes.decide(self._pays, self._certain)

    def _reach(self, req: Request, n: int, prior: list[float]) -> list[float]:
        """The probability that the drafter proposes a draft at each of ``req``'s first ``n``
        positions: its running proposal rates shrunk towards the engine's (``prior``), made
        non-increasing."""
        stats = self._stats.get(req.request_id)
        out, acc = [], 1.0
        for r in prior[:n] if stats is None else stats.reaches(prior[:n]):
            acc = min(acc, r)
            out.append(acc)
        return out

    def _request_stats(self, req: Request) -> AcceptanceStats:
        """``req``'s own statistics (recency-weighted: :data:`~.stats.REQUEST_DECAY`)."""
        stats = self._stats.get(req.request_id)
        if stats is None:
            stats = self._stats[req.request_id] = AcceptanceStats(self.config.max_draft_tokens, REQUEST_DECAY)
        return stats

    def _global_rates(self) -> list[float]:
        """The engine-wide acceptance rate per draft position (shrunk towards 0.5)."""
        return self.global_stats.rates(self._halves)

    def _global_reach(self) -> list[float]:
        """The engine-wide probability that the drafter proposes a draft at each position
        (shrunk towards 1)."""
        return self.global_stats.reaches(self._ones)

    def _rate_confidence(self, req: Request, n: int, prior: list[float]) -> list[float]:
        """Cumulative acceptance probabilities of ``n`` draft positions from ``req``'s running
        rates shrunk towards the engine's (``prior``, :meth:`_global_rates`)."""
        stats = self._stats.get(req.request_id)
        return cumulative(prior[:n], clamp=False) if stats is None else stats.cumulative_rates(prior[:n])

    def _can_roll_back(self, req: Request) -> bool:
        """Whether ``req``'s grammar matcher and logits processors can take drafts back."""
        m = req.structured_matcher
        if m is not None and not hasattr(m, "rollback"):
            return False
        return all(self.engine._processors[n].supports_rollback for n in req.logits_processors)

    # ---- after the forward -----------------------------------------------------------------------
    def sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> VerifyResult:
        """The tokens each sampling chunk emits (see the module docstring); ``logits`` has one
        row per verified position of each sampling chunk, in order."""
        engine = self.engine
        reqs = sched.sampling_requests
        chunks = [c for c in sched.chunks if c.sample]
        rows: list[RowView] = []
        positions: list[int] = []
        owner: list[tuple[int, int]] = []  # (chunk index, position in the chunk) per row
        drafts: list[list[int]] = []
        for ci, (req, c) in enumerate(zip(reqs, chunks, strict=True)):
            d = c.token_ids[c.num_tokens - c.num_draft :] if c.num_draft else []
            drafts.append(d)
            for i in range(1 + c.num_draft):
                out = req.output_token_ids + d[:i] if i else req.output_token_ids
                rows.append(RowView(req.params, req.sampling_seed, req.prompt_token_ids, out))
                positions.append(c.end_pos - c.num_draft + i)
                owner.append((ci, i))
        batch = SamplingBatch.from_requests(rows, engine.eos_token_ids, positions)
        if any(r.structured_matcher is not None for r in reqs):
            self._structured_rows(batch, reqs, drafts, owner)
        if any(r.logits_processors for r in reqs):
            logits = self._processor_rows(logits.float(), reqs, drafts, owner)
        sampled = engine.sampler(logits, batch)
        targets = sampled.token_ids.tolist()
        if self.config.acceptance == "rejection" and any(drafts):
            emitted = self._rejection(logits, batch, reqs, rows, positions, owner, drafts, targets)
            logprobs = self._emitted_logprobs(logits, batch, drafts, emitted)
        else:
            emitted, logprobs = [], []
            base = 0
            for d in drafts:
                a = accept_match(targets[base : base + len(d) + 1], d)
                emitted.append(targets[base : base + a + 1])
                logprobs.append([sampled.logprobs[base + i] for i in range(a + 1)])
                base += len(d) + 1
        for req, c, d, e in zip(reqs, chunks, drafts, emitted, strict=True):
            if _is_decode(req, c):
                self._record(req, len(d), len(e) - 1 if d else 0)
        accepted = sum(len(e) - 1 for d, e in zip(drafts, emitted, strict=True) if d)
        return VerifyResult(emitted, logprobs, accepted)

    def _rejection(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        reqs: list[Request],
        rows: list[RowView],
        positions: list[int],
        owner: list[tuple[int, int]],
        drafts: list[list[int]],
        targets: list[int],
    ) -> list[list[int]]:
        """``rejection`` acceptance for every chunk (:mod:`deepinfer_core.speculative.verify`)."""
        device, vocab = logits.device, logits.shape[1]
        probs = self.engine.sampler.distribution(logits.float(), batch.prepare(device, vocab))
        tested = torch.tensor(
            [drafts[ci][i] if i < len(drafts[ci]) else 0 for ci, i in owner], dtype=torch.int64
        ).to(device)
        k1, k2 = row_keys([r.sampling_seed for r in rows], positions)
        key1 = torch.tensor(k1, dtype=torch.int64).to(device)
        key2 = torch.tensor(k2, dtype=torch.int64).to(device)
        q = self._draft_q(reqs, owner, drafts, vocab, device)
        resid = residual_draws(probs, tested, q, key1, key2).tolist()
        p_d = probs.gather(1, tested[:, None]).squeeze(1).tolist()
        q_d = [1.0] * len(owner) if q is None else q.gather(1, tested[:, None]).squeeze(1).tolist()
        emitted: list[list[int]] = []
        base = 0
        for d in drafts:
            k = len(d)
            u = [acceptance_uniform(rows[base + i].sampling_seed, positions[base + i]) for i in range(k)]
            a = accept_rejection(p_d[base : base + k], q_d[base : base + k], u)
            last = resid[base + a] if a < k else targets[base + k]
            emitted.append(list(d[:a]) + [last])
            base += k + 1
        return emitted

    def _draft_q(
        self,
        reqs: list[Request],
        owner: list[tuple[int, int]],
        drafts: list[list[int]],
        vocab: int,
        device: torch.device,
    ) -> torch.Tensor | None:
        """The drafters' distributions ``q`` per row (``[n, V]``), or ``None`` when every draft
        is deterministic (one-hot ``q``)."""
        probs = [self._draft_probs.get(r.request_id) for r in reqs]
        if all(p is None for p in probs):
            return None
        q = torch.zeros(len(owner), vocab, dtype=torch.float64, device=device)
        for row, (ci, i) in enumerate(owner):
            if i < len(drafts[ci]):
                p = probs[ci]
                if p is None:
                    q[row, drafts[ci][i]] = 1.0
                else:
                    q[row] = p[i].to(device, torch.float64)
        return q

    @staticmethod
    def _emitted_logprobs(
        logits: torch.Tensor,
        batch: SamplingBatch,
        drafts: list[list[int]],
        emitted: list[list[int]],
    ) -> list[list[dict[int, float] | None]]:
        """Logprobs of the emitted tokens (rejection acceptance may emit a token other than the
        row's draw), from the raw logits of their rows."""
        n = sum(len(d) + 1 for d in drafts)
        ks = batch.num_logprobs or [None] * n
        pick, tokens, want = [], [], []
        base = 0
        for d, e in zip(drafts, emitted, strict=True):
            for i, t in enumerate(e):
                pick.append(base + i)
                tokens.append(t)
                want.append(ks[base + i])
            base += len(d) + 1
        if not any(k is not None for k in want):
            return [[None] * len(e) for e in emitted]
        index = torch.tensor(pick, dtype=torch.int64).to(logits.device)
        entries = top_logprobs(logits.float().index_select(0, index), torch.tensor(tokens), want)
        out: list[list[dict[int, float] | None]] = []
        j = 0
        for e in emitted:
            out.append([entries[j + i] for i in range(len(e))])
            j += len(e)
        return out

    # ---- grammar masks and logits processors per verified position ----------------------------
    def _structured_rows(
        self, batch: SamplingBatch, reqs: list[Request], drafts: list[list[int]], owner: list[tuple[int, int]]
    ) -> None:
        """The packed token bitmask of every row: a request's matcher is advanced over its
        drafts one at a time (as far as the grammar accepts them) between the rows' fills,
        then rolled back.  Rows after a draft the grammar rejects stay unconstrained: that
        draft cannot be accepted, so their tokens are never used."""
        engine = self.engine
        vocab = engine.model_config.vocab_size
        bitmask = torch.full((len(owner), bitmask_words(vocab)), -1, dtype=torch.int32)
        first_row = _first_rows(owner)
        valid = {}
        for ci, req in enumerate(reqs):
            m = req.structured_matcher
            if m is not None:
                m.consume(req.output_token_ids[m.num_consumed :])
                valid[ci] = m.num_valid(drafts[ci]) if drafts[ci] else 0
        constrained: list[int] = []
        for i in range(1 + max((len(d) for d in drafts), default=0)):
            by_backend: dict[str, list[tuple[Any, int]]] = {}
            for ci, n_valid in valid.items():
                if i <= n_valid and i <= len(drafts[ci]):
                    req = reqs[ci]
                    if i:
                        req.structured_matcher.consume([drafts[ci][i - 1]])
                    row = first_row[ci] + i
                    by_backend.setdefault(req.params.structured_outputs.backend, []).append(
                        (req.structured_matcher, row)
                    )
                    constrained.append(row)
            for name, pairs in by_backend.items():
                engine.structured.backend(name).fill_bitmasks(pairs, bitmask)
        for ci, n_valid in valid.items():
            if n_valid:
                reqs[ci].structured_matcher.rollback(min(n_valid, len(drafts[ci])))
        engine.structured.finish(batch, bitmask, constrained)

    def _processor_rows(
        self, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]], owner: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Logits processors on every row: each gets a request's new output tokens, then per
        verified position ``i`` its draft ``d_i`` and one ``apply`` over the rows at ``i``;
        afterwards the drafts are rolled back (``on_rollback``)."""
        procs = self.engine._processors
        order = self.engine._feed_processors(reqs)
        first_row = _first_rows(owner)
        with torch.inference_mode():
            for i in range(1 + max((len(d) for d in drafts), default=0)):
                for name in order:
                    ids: list[str | None] = [None] * len(owner)
                    any_row = False
                    for ci, req in enumerate(reqs):
                        if name in req.logits_processors and i <= len(drafts[ci]):
                            if i:
                                procs[name].on_tokens(req.request_id, [drafts[ci][i - 1]])
                            ids[first_row[ci] + i] = req.request_id
                            any_row = True
                    if any_row:
                        logits = procs[name].apply(logits, ids)
        for ci, req in enumerate(reqs):
            if drafts[ci]:
                for name in req.logits_processors:
                    procs[name].on_rollback(req.request_id, len(drafts[ci]))
        return logits

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _record(self, req: Request, verified: int, accepted: int) -> None:
        proposed = self._proposed.pop(req.request_id, 0)
        self.metrics.record(proposed, verified, accepted)
        if verified:
            self._request_stats(req).record(verified, accepted)
            self.global_stats.record(verified, accepted)
            conf = self._draft_conf.pop(req.request_id, None)
            if conf is not None:
                self.calibration.record(conf, verified, accepted)

    def record_without_drafts(self, sched: SchedulerOutput) -> None:
        """Count a step that verified no draft (sampled by the engine's plain path): each of
        its decodes verified none."""
        for req, c in zip(sched.sampling_requests, (c for c in sched.chunks if c.sample), strict=True):
            if _is_decode(req, c):
                self._record(req, 0, 0)

    def observe_step(self, sched: SchedulerOutput, seconds: float, overlapped: bool = False) -> None:
        """Refine the cost model with a step that only decoded (``B`` requests, ``t`` tokens
        per request on average; ``seconds`` from its launch to the next step's when it ran
        ``overlapped`` with that launch (async, then without drafts:
        :meth:`StepCost.observe_plain`), else to its outputs (:meth:`StepCost.observe`))."""
        if self.cost is None or not sched.chunks:
            return
        if all(c.num_tokens - c.num_draft == 1 and c.start_pos > 0 for c in sched.chunks):
            b = len(sched.chunks)  # the drafter's time is modelled apart (draft_seconds)
            if overlapped:
                self.cost.observe_plain(b, seconds)
            else:
                self.cost.observe(b, sched.num_tokens / b, seconds - self._step_draft_seconds)

    def observe(self, sched: SchedulerOutput, hidden: torch.Tensor | None = None) -> None:
        """Tell the drafter (when it observes) which positions each running request computed
        and kept in the step just completed (:class:`~deepinfer_core.speculative.ComputedChunk`;
        ``hidden``: that step's hidden rows, ``ModelRunner.last_hidden`` when it ran)."""
        if not self.drafter_observes:
            return
        computed: list[ComputedChunk] = []
        row = 0
        for req, c in zip(sched.requests, sched.chunks, strict=True):
            first, row = row, row + c.num_tokens
            if (
                req.status is not RequestStatus.RUNNING
                or req.block_table[: len(c.block_table)] != c.block_table
            ):
                continue  # finished, or preempted since
            end = min(c.end_pos, req.num_computed_tokens)
            if end <= c.start_pos:
                continue
            assert req.seq_slot is not None
            computed.append(
                ComputedChunk(
                    request_id=req.request_id,
                    start_pos=c.start_pos,
                    token_ids=req.token_slice(c.start_pos + 1, end + 1),
                    hidden_row=first,
                    sampled=c.sample and end == req.num_tokens - 1,
                    seq_slot=req.seq_slot,
                    block_table=list(req.block_table),
                    table_key=(req.request_id, req.table_version),
                    window_from=c.window_from,
                    cached_until=c.cached_until,
                    hidden=hidden,
                )
            )
        self.drafter.observe(computed)

    def release(self, req: Request) -> None:
        """Forget a finished request."""
        self._stats.pop(req.request_id, None)
        self._proposed.pop(req.request_id, None)
        self._draft_conf.pop(req.request_id, None)
        self.drafter.on_finished(req.request_id)


def drafter_class(config: SpeculativeConfig, plugins: Any) -> type[Drafter]:
    """The drafter class ``config.drafter`` names among the registered ones
    (``deepinfer_register_drafters``); a one-line :class:`ConfigError` when it is unknown,
    unavailable or not a :class:`Drafter`."""
    name = config.drafter
    return plugins.component_class("drafters", name, Drafter, f"speculative.drafter={name!r}")


def check_draft_layers(family: Any, drafter: str, kind: str, model_config: Any = None) -> None:
    """A one-line :class:`ConfigError` when drafter ``drafter`` runs draft layers of ``kind``
    (:attr:`Drafter.mtp_kind`) but the checkpoint's cannot be run: the family's
    ``unsupported_draft_layers(model_config)`` gives a reason (e.g. DeepSeek-V4-Flash-0731's
    DSpark stages), or its checkpoints hold another kind (``ModelFamily.mtp_kind``; the message
    names the drafter to use: the core's drafter of each kind has the kind's name)."""
    why = getattr(family, "unsupported_draft_layers", None)
    reason = why(model_config) if why is not None and model_config is not None else None
    if reason is not None:
        raise ConfigError(f"speculative.drafter={drafter!r}: {reason}")
    have = getattr(family, "mtp_kind", "mtp")
    if kind == have or getattr(family, "load_mtp_weights", None) is None:
        return  # the same kind, or no draft layers at all (the model runner says so)
    what = {"mtp": "an MTP layer", "dspark": "DSpark block-drafter layers"}
    raise ConfigError(
        f"speculative.drafter={drafter!r} runs {what.get(kind, kind)}, but model family "
        f"{family.model_type!r} has {what.get(have, have)} (mtp.*): use drafter={have!r}"
    )


def _is_decode(req: Request, c: SeqChunk) -> bool:
    """Whether sampling chunk ``c`` of ``req`` decodes (one known token after the prompt, plus
    any drafts it verifies) rather than ending a prefill."""
    return c.num_tokens - c.num_draft == 1 and c.start_pos >= req.num_prompt_tokens


def _first_rows(owner: list[tuple[int, int]]) -> dict[int, int]:
    """The first logits row of each chunk, from the rows' ``(chunk, position)``."""
    first: dict[int, int] = {}
    for row, (ci, _) in enumerate(owner):
        first.setdefault(ci, row)
    return first
