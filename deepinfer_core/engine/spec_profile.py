"""The step cost DSpark weighs drafts against, profiled at start (:func:`profile_step_cost`)."""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

from deepinfer_core.devices import synchronize
from deepinfer_core.speculative.step_cost import StepCost

if TYPE_CHECKING:
    from deepinfer_core.config import SpeculativeConfig
    from deepinfer_core.engine.model_runner import ModelRunner

logger = logging.getLogger("deepinfer.engine")


def profile_step_cost(runner: ModelRunner, config: SpeculativeConfig, budget: int) -> StepCost:
    """Time steps of ``B`` requests x ``t`` tokens (``t`` = 1, the middle, ``1 + k``) for a
    few batch sizes up to ``max_num_seqs`` (at most ``budget`` tokens, plus one per slot) — the
    cost curve DSpark weighs drafts against."""
    k = config.max_draft_tokens
    batches = sorted({b for b in (1, 4, 16, 64, runner.kv_cache.num_slots) if b <= runner.kv_cache.num_slots})
    table: dict[tuple[int, int], float] = {}
    t0 = time.perf_counter()
    for b in batches:
        for t in sorted({1, 1 + (k + 1) // 2, 1 + k}):
            if b * t <= budget + runner.kv_cache.num_slots:
                table[(b, t)] = time_step(runner, b, t)
    logger.info(
        "speculative decoding (%s, drafter %r, up to %d drafts): step cost profiled in %.2f s: %s",
        config.method,
        config.drafter,
        k,
        time.perf_counter() - t0,
        ", ".join(f"B={b} t={t}: {1e3 * s:.2f} ms" for (b, t), s in sorted(table.items())),
    )
    # verify graphs run every verify step of up to their largest bucket padded to 1 + k tokens
    return StepCost(table, padded_batch=max(runner.graph_manager.graphs("verify"), default=0))


def time_step(runner: ModelRunner, batch: int, tokens_per_request: int, repeats: int = 5) -> float:
    """Seconds of one step of ``batch`` requests x ``tokens_per_request`` tokens, every
    row's logits returned (a verify step's shape), measured on padding rows of the trash
    slot (no request's cache is touched): the fastest of ``repeats`` runs after a warm-up
    (the least disturbed by other work on the machine).
    Speculative decoding's DSpark policy weighs drafts against these costs."""
    t = batch * tokens_per_request
    family = "decode" if tokens_per_request == 1 else "verify"
    bucket = runner.graph_manager.bucket(family, batch)
    if bucket is not None and tokens_per_request > 1 + runner.num_spec_tokens:
        bucket = None
    times = []
    for i in range(repeats + 1):
        if bucket is not None:  # the graph this step would replay (padded to its shape)
            n = bucket * (1 if tokens_per_request == 1 else 1 + runner.num_spec_tokens)
            prev = runner.prev_buf if tokens_per_request == 1 else None
            runner.inputs.prepare([], list(range(n)), prev, n, bucket + 1, runner.max_model_len)
            run = functools.partial(runner.graph_manager.replay, family, bucket)
        else:
            inputs = runner.inputs.prepare([], list(range(t)), None, t, 1)
            run = functools.partial(runner.forward, inputs)
        synchronize(runner.device)
        t0 = time.perf_counter()
        run()
        synchronize(runner.device)
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)
