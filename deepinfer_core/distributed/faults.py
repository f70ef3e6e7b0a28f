"""The test-only fault injector of a distributed run (:data:`FAULT_ENV`): a worker told to
exit, hang or fail to start at a given step, as a crashed, stuck or broken rank would."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("deepinfer.distributed")

FAULT_ENV = "DEEPINFER_TEST_WORKER_EXIT_AT_STEP"
"""Test-only fault injector: ``RANK:STEP`` makes that worker exit (status 17, no goodbye) on
receiving its STEP-th step message, as a crashed or killed worker would; ``RANK:STEP:hang``
makes it hang there instead (alive, never answering); ``RANK:0`` makes its engine fail to
start."""


def fault_step(rank: int) -> tuple[int, bool] | None:
    """This rank's injected fault (:data:`FAULT_ENV`): the step, and whether to hang there."""
    raw = os.environ.get(FAULT_ENV, "")
    if not raw:
        return None
    parts = raw.split(":")
    try:
        want, step = int(parts[0]), int(parts[1])
        hang = parts[2:] == ["hang"]
        if len(parts) > 3 or (len(parts) == 3 and not hang):
            raise ValueError(raw)
    except (ValueError, IndexError):
        logger.warning("%s=%r ignored: expected RANK:STEP or RANK:STEP:hang", FAULT_ENV, raw)
        return None
    return (step, hang) if want == rank else None
