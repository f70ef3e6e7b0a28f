"""Engine statistics: one :class:`StepStats` per step, accumulated by :class:`Metrics`.

The engine builds a :class:`StepStats` after every step, feeds it to its :class:`Metrics`
(what :meth:`deepinfer_core.LLM.get_metrics` returns) and, when some plugin implements it,
passes it to the ``deepinfer_step_stats`` hook.

Token counts follow vLLM's counters: a request's prompt tokens are counted once, in the step
that samples its first token (so prefix-cache hits, replays and preemption recomputes do
not inflate them); generated tokens are the tokens sampled.  The work actually done is
``num_tokens`` (every token run through the model, replays and recomputes included).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class StepStats:
    """Statistics of one engine step, passed to the ``deepinfer_step_stats`` hook.

    Attributes:
        step: 1-based step number since the engine started.
        num_seqs: requests scheduled this step.
        num_tokens: tokens run through the model this step (prefill chunks, replays, decodes).
        num_decode_seqs: scheduled requests decoding one token.
        num_preempted: requests preempted while scheduling this step.
        num_finished: requests whose last token this step produced (``num_finished_requests``
            of :class:`Metrics` also counts failed and aborted requests).
        cache_usage: fraction of cache pages in use after the step, in ``[0, 1]``.
        step_time_s: wall time of the step in seconds.
        num_prompt_tokens: prompt lengths of the requests that sampled their first token this step.
        num_generated_tokens: tokens sampled this step.
        num_prefix_hit_tokens: prompt tokens served from the prefix cache instead of computed.
        num_replayed_tokens: tokens recomputed to rebuild sliding windows (SWA bounded replay).
        num_waiting: requests queued (or preempted) after the step.
        num_running: requests holding cache after the step.
        num_draft_tokens: speculative decoding: draft tokens verified this step.
        num_accepted_tokens: speculative decoding: of those, the accepted ones.
        host_wait_s: seconds the host waited for this step's sampled tokens to reach it (on an
            accelerator; 0 elsewhere and for speculative verify steps). With async scheduling a
            wait near 0 step after step means the host, not the device, sets the pace.
    """

    step: int
    num_seqs: int
    num_tokens: int
    num_decode_seqs: int
    num_preempted: int
    num_finished: int
    cache_usage: float
    step_time_s: float
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_replayed_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    host_wait_s: float = 0.0


class Metrics:
    """Running totals over the steps of one engine (see :meth:`as_dict` for the keys).

    Args:
        kv_cache_capacity_tokens: token positions the paged cache holds (reported as is).
    """

    def __init__(self, kv_cache_capacity_tokens: int = 0):
        self.kv_cache_capacity_tokens = kv_cache_capacity_tokens
        self.reset()

    def reset(self) -> None:
        """Zero every total (the capacity is kept), e.g. after a warm-up."""
        self.num_steps = 0
        self.num_finished_requests = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_replayed_tokens = 0
        self.num_preemptions = 0
        self.elapsed_s = 0.0
        self.cache_usage = 0.0
        self.peak_cache_usage = 0.0
        self.last_step: StepStats | None = None

    def update(self, stats: StepStats) -> None:
        """Add one step's statistics."""
        self.num_steps += 1
        self.num_prompt_tokens += stats.num_prompt_tokens
        self.num_generated_tokens += stats.num_generated_tokens
        self.num_scheduled_tokens += stats.num_tokens
        self.num_prefix_hit_tokens += stats.num_prefix_hit_tokens
        self.num_replayed_tokens += stats.num_replayed_tokens
        self.num_preemptions += stats.num_preempted
        self.elapsed_s += stats.step_time_s
        self.cache_usage = stats.cache_usage
        self.peak_cache_usage = max(self.peak_cache_usage, stats.cache_usage)
        self.last_step = stats

    def record_finished(self, num_requests: int) -> None:
        """Count requests returned as finished: completed, failed (also those rejected at
        submission, which never run a step) and aborted."""
        self.num_finished_requests += num_requests

    @property
    def generation_tokens_per_s(self) -> float:
        """Generated tokens per second of step time (0 before the first step)."""
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Tokens run through the model per second of step time (0 before the first step)."""
        return self.num_scheduled_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The totals as a plain dict.

        Keys: ``num_steps``, ``num_finished_requests``, ``num_prompt_tokens``,
        ``num_generated_tokens``, ``num_scheduled_tokens``, ``num_prefix_hit_tokens``,
        ``num_replayed_tokens``, ``num_preemptions``, ``elapsed_s`` (summed step time),
        ``generation_tokens_per_s``, ``tokens_per_s``, ``cache_usage`` (after the last step),
        ``peak_cache_usage``, ``kv_cache_capacity_tokens``, ``last_step`` (the last
        :class:`StepStats` as a dict, or ``None``).
        """
        return {
            "num_steps": self.num_steps,
            "num_finished_requests": self.num_finished_requests,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "num_prefix_hit_tokens": self.num_prefix_hit_tokens,
            "num_replayed_tokens": self.num_replayed_tokens,
            "num_preemptions": self.num_preemptions,
            "elapsed_s": self.elapsed_s,
            "generation_tokens_per_s": self.generation_tokens_per_s,
            "tokens_per_s": self.tokens_per_s,
            "cache_usage": self.cache_usage,
            "peak_cache_usage": self.peak_cache_usage,
            "kv_cache_capacity_tokens": self.kv_cache_capacity_tokens,
            "last_step": None if self.last_step is None else asdict(self.last_step),
        }
