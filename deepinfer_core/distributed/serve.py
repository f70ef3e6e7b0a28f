"""A rank's side of the lockstep (see :mod:`.coordinator`): build the rank's engine, apply each
:class:`~.protocol.StepMessage` and reply (:func:`handle_message`, rank 0 included), and the
serve loop of a non-driver rank (:func:`run_worker`)."""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from typing import Any

from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.engine.llm_engine import LLMEngine

from .faults import FAULT_ENV, fault_step
from .init import default_store, destroy_parallel, init_parallel
from .protocol import STEP_KEY, StepMessage, broadcast, gather, report_error, store_key

logger = logging.getLogger("deepinfer.distributed")


def build_engine(config: EngineConfig, parallel: ParallelState) -> LLMEngine:
    """This rank's engine: ``config`` on the rank's device, with its :class:`ParallelState`."""
    return LLMEngine(config.model_copy(update={"device": str(parallel.device)}), parallel=parallel)


def handle_message(engine: LLMEngine, parallel: ParallelState, msg: StepMessage) -> dict[str, Any]:
    """Apply one :class:`StepMessage` on a rank and return its reply (errors as text, so the
    protocol stays in step; rank 0 re-raises its own)."""
    reply: dict[str, Any] = {"rank": parallel.rank, "outputs": [], "error": None}
    try:
        if msg.abort_all is not None:
            outputs = engine.abort_all(msg.abort_all)
        elif msg.reset_metrics:
            engine.reset_metrics()
            outputs = []
        else:
            if msg.aborts:
                engine.abort_request(msg.aborts)
            for replica, req in msg.adds:
                if replica == parallel.dp_rank:
                    engine.add_request(
                        req.request_id,
                        req.prompt_token_ids,
                        req.params,
                        prompt=req.prompt,
                        sample_index=req.sample_index,
                        seed_index=req.seed_index,
                    )
            outputs = engine.step()
        if parallel.is_cp_leader:
            reply["outputs"] = outputs
    except Exception as e:
        reply["error"] = f"{type(e).__name__}: {e}"
        reply["exception"] = e if parallel.is_driver else None
        logger.error("step failed:\n%s", traceback.format_exc())
    reply["unfinished"] = engine.has_unfinished()
    reply["generated"] = engine.metrics.num_generated_tokens  # the progress bar's count, every step
    plain_step = msg.abort_all is None and not msg.reset_metrics
    if (
        not plain_step
        or not reply["unfinished"]
        or reply["outputs"]
        or engine.metrics.num_steps % METRICS_EVERY == 0
    ):
        reply["metrics"] = engine.get_metrics()  # wherever get_metrics() may be asked next
    return reply


METRICS_EVERY = 32
"""A rank's full ``get_metrics()`` dict travels in its reply after every step that finished a
request or left it idle, after an abort or reset, and every this many steps (building and
pickling it every step cost a quarter of a step's protocol time); its generated-token count
travels every step."""


def run_worker(
    config: EngineConfig, log_path: str = "", env: dict[str, str] | None = None, store: Any = None
) -> int:
    """A non-driver rank: join the world (through ``store`` when given), build the engine from
    rank 0's configuration, serve step messages until rank 0 shuts down.  Returns the exit
    status (0 on a clean shutdown)."""
    parallel = init_parallel(config, env, store)
    fault_at, hang = fault_step(parallel.rank) or (None, False)
    status = 1  # until a clean shutdown
    store = default_store()
    run_id = ""
    try:
        config_json, run_id = broadcast(None, parallel)
        config = EngineConfig(**json.loads(config_json))
        engine, error = None, None
        try:
            if fault_at == 0:
                raise RuntimeError(f"engine start failure injected by {FAULT_ENV} (a test)")
            engine = build_engine(config, parallel)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            logger.error("engine failed to start:\n%s", traceback.format_exc())
        hello = {
            "rank": parallel.rank,
            "error": error,
            "log": log_path,
            "pid": os.getpid(),
            "capacity": engine.runner.capacity_tokens if engine is not None else 0,
        }
        gather(hello, parallel)
        steps = 0
        while True:
            msg = broadcast(None, parallel)
            if msg.shutdown:
                if engine is not None:  # before the process group goes (see release_graphs)
                    engine.runner.release_graphs()
                status = 0 if engine is not None else 1
                return status
            steps += 1
            if steps == fault_at:  # the test-only fault injector (FAULT_ENV)
                while hang:
                    time.sleep(1.0)
                os._exit(17)  # die without a word
            if engine is None:  # nothing to step; the driver shuts down after the hello
                gather({"rank": parallel.rank, "error": error, "outputs": [], "unfinished": False}, parallel)
                continue
            reply = handle_message(engine, parallel, msg)
            if store is not None:  # progress for rank 0's diagnosis of a collective that times out
                store.set(store_key(run_id, STEP_KEY, parallel.rank), str(steps))
            gather(reply, parallel)
    except BaseException as e:
        report_error(parallel, f"{type(e).__name__}: {e}", run_id)
        raise
    finally:
        if not destroy_parallel():  # the teardown hung: leave now rather than hang at exit
            logging.shutdown()
            os._exit(status)
