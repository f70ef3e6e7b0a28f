"""The step cost DSpark weighs drafts against, profiled at start (:func:`profile_step_cost`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

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
                table[(b, t)] = runner.time_step(b, t)
    logger.info(
        "speculative decoding (%s, drafter %r, up to %d drafts): step cost profiled in %.2f s: %s",
        config.method,
        config.drafter,
        k,
        time.perf_counter() - t0,
        ", ".join(f"B={b} t={t}: {1e3 * s:.2f} ms" for (b, t), s in sorted(table.items())),
    )
    # verify graphs run every verify step of up to their largest bucket padded to 1 + k tokens
    return StepCost(table, padded_batch=max(runner.verify_graphs, default=0))
