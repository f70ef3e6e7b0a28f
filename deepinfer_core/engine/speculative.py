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

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.engine.spec_observe import computed_chunks
from deepinfer_core.engine.spec_profile import profile_step_cost
from deepinfer_core.engine.spec_rows import processor_rows, structured_rows
from deepinfer_core.engine.spec_verify import emitted_logprobs, rejection
from deepinfer_core.errors import ConfigError
from deepinfer_core.plugins.lookup import ComponentLookup, subclass_of
from deepinfer_core.sampling.batch import SamplingBatch
from deepinfer_core.sampling.transfer import HostCopy
from deepinfer_core.speculative.drafter import DraftContext, Drafter, RowView
from deepinfer_core.speculative.estimates import AcceptanceEstimates
from deepinfer_core.speculative.policy import (
    CERTAIN_GAIN,
    EMA,
    MAX_REUSE_STEPS,
    SETTLED_GAIN,
    SETTLED_STEPS,
    UNSETTLED_STEPS,
    ProbeSchedule,
    drafting_gain,
    fixed_lengths,
)
from deepinfer_core.speculative.stats import (
    SpeculativeMetrics,
)
from deepinfer_core.speculative.step_cost import StepCost
from deepinfer_core.speculative.verify import accept_match
from deepinfer_core.speculative.verify_policy import VerifyPolicy

if TYPE_CHECKING:
    from deepinfer_core.config import SpeculativeConfig
    from deepinfer_core.contract.batch import SeqChunk
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.engine.request import Request
    from deepinfer_core.engine.scheduler import SchedulerOutput


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
        self.estimates = AcceptanceEstimates(cfg.max_draft_tokens)
        self._proposed: dict[str, int] = {}
        self._draft_probs: dict[str, torch.Tensor | None] = {}
        self._draft_conf: dict[str, list[float]] = {}  # the drafter's own confidences, by request
        self.cost: StepCost | None = None
        self.draft_seconds = 0.0  # the drafter's time per propose call (EMA)
        self._step_draft_seconds = 0.0  # this step's, kept out of the cost model's overhead
        self._probes = ProbeSchedule()  # dspark: when to draft (or not) against the estimate
        self._pays = False  # dspark: the last weighed decision ...
        self._certain = False  # ... whether it pays beyond CERTAIN_GAIN (no plain probes) ...
        self._settled = 0  # ... reused for this many more steps (it was clear)
        self._reuse = 0  # ... for how many the last time it was weighed
        self._drafting = False  # this step asks the drafter (:meth:`wants_drafts`)
        self._cands: list[tuple[Request, int]] | None = None  # wants_drafts' candidates, if still valid
        self._estimates: list[list[float]] | None = None  # and their confidences (dspark)
        self.drafter_observes = type(self.drafter).observe is not Drafter.observe
        self.policy = verify_policy(cfg, engine.plugins)(cfg)
        if self.policy.uses_step_cost:
            self.cost = profile_step_cost(engine.runner, cfg, engine.config.max_num_batched_tokens)

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
                "acceptance_estimate": self.estimates.global_rates(),
                "proposal_estimate": self.estimates.global_reach(),
                "probe_intervals": [self._probes.draft_interval, self._probes.plain_interval],
                "confidence_calibration": [
                    self.estimates.calibration.ratio(i) for i in range(self.config.max_draft_tokens)
                ],
                "recent_steps": [[kind, b, rows, 1e3 * sec] for kind, b, rows, sec in cost.recent],
            }
        return out

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
        if self._probes.probing:  # a probe verifies every draft
            lengths = fixed_lengths(proposed, budget)
        else:
            confidences = None
            if self.cost is not None:
                ids = [r.request_id for r, _ in cands]
                confidences = self.estimates.confidences(ids, drafts, proposed, estimates)
            # sampled drafts under rejection acceptance: Algorithm 1's early stop keeps it exact
            causal = self.config.acceptance == "rejection" and any(d.probs is not None for d in drafts)
            lengths = self.policy.lengths(proposed, budget, confidences, self.cost, causal)
        for (req, room), draft, n in zip(cands, drafts, lengths, strict=True):
            req.draft_token_ids = list(draft.token_ids[:n])
            self._proposed[req.request_id] = m = len(draft.token_ids)
            if self.cost is not None:  # dspark: the drafter's reach, for _drafting_pays
                self.estimates.request_stats(req.request_id).record_proposal(room, m)
                self.estimates.global_stats.record_proposal(room, m)
        self._draft_probs = {r.request_id: d.probs for r, d in zip(reqs, drafts, strict=True)}
        if self.cost is not None:  # dspark: the drafter's confidences, for their calibration
            self._draft_conf = {
                r.request_id: list(d.confidence) for r, d in zip(reqs, drafts, strict=True) if d.confidence
            }

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
        prior = self.estimates.global_rates()
        estimates = [self.estimates.rate_confidence(req.request_id, room, prior) for req, room in cands]
        if self._cands is not None:
            self._estimates = estimates  # propose() takes the drafts' prefixes of them
        prior_reach = self.estimates.global_reach()
        reach = [self.estimates.reach(req.request_id, room, prior_reach) for req, room in cands]
        gain = drafting_gain(estimates, budget, self.cost, self.draft_seconds, reach)
        pays, self._certain = gain > 1.0, gain > CERTAIN_GAIN
        clear = gain > SETTLED_GAIN or gain * SETTLED_GAIN < 1.0
        base = SETTLED_STEPS if clear else UNSETTLED_STEPS
        confirmed = self._reuse > 0 and pays == self._pays  # the same answer as last time
        self._reuse = min(max(2 * self._reuse, base), MAX_REUSE_STEPS) if confirmed else base
        self._pays, self._settled = pays, self._reuse
        return self._probes.decide(self._pays, self._certain)

    def _can_roll_back(self, req: Request) -> bool:
        """Whether ``req``'s grammar matcher and logits processors can take drafts back."""
        m = req.structured_matcher
        if m is not None and not hasattr(m, "rollback"):
            return False
        return self.engine.processors.can_roll_back(req)

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
            structured_rows(engine.structured, engine.model_config.vocab_size, batch, reqs, drafts, owner)
        if any(r.logits_processors for r in reqs):
            logits = processor_rows(engine.processors, logits.float(), reqs, drafts, owner)
        sampled = engine.sampler(logits, batch)
        targets = HostCopy(sampled.token_ids, engine.config.device_timeout_s).get().tolist()
        if self.config.acceptance == "rejection" and any(drafts):
            emitted = rejection(
                engine.sampler,
                self._draft_probs,
                logits,
                batch,
                reqs,
                rows,
                positions,
                owner,
                drafts,
                targets,
            )
            logprobs = emitted_logprobs(logits, batch, drafts, emitted)
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

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _record(self, req: Request, verified: int, accepted: int) -> None:
        proposed = self._proposed.pop(req.request_id, 0)
        self.metrics.record(proposed, verified, accepted)
        if verified:
            self.estimates.request_stats(req.request_id).record(verified, accepted)
            self.estimates.global_stats.record(verified, accepted)
            conf = self._draft_conf.pop(req.request_id, None)
            if conf is not None:
                self.estimates.calibration.record(conf, verified, accepted)

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
        computed = computed_chunks(sched, hidden)
        self.drafter.observe(computed)

    def release(self, req: Request) -> None:
        """Forget a finished request."""
        self.estimates.forget(req.request_id)
        self._proposed.pop(req.request_id, None)
        self._draft_conf.pop(req.request_id, None)
        self.drafter.on_finished(req.request_id)


def drafter_class(config: SpeculativeConfig, plugins: Any) -> type[Drafter]:
    """The drafter class ``config.drafter`` names among the registered ones
    (``deepinfer_register_drafters``); a one-line :class:`ConfigError` when it is unknown,
    unavailable or not a :class:`Drafter`."""
    lookup = ComponentLookup(plugins, "drafters", "speculative.drafter={}", check=subclass_of(Drafter))
    return lookup.get(config.drafter)


def verify_policy(config: SpeculativeConfig, plugins: Any) -> type[VerifyPolicy]:
    """The verify-length policy class ``config.method`` names among the registered ones
    (``deepinfer_register_verify_policies``); a one-line :class:`ConfigError` when it is unknown
    (listing the registered names), unavailable or not a :class:`VerifyPolicy`."""
    lookup = ComponentLookup(
        plugins, "verify_policies", "speculative.method={}", check=subclass_of(VerifyPolicy)
    )
    return lookup.get(config.method)


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
