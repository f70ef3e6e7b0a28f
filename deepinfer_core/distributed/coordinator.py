"""The lockstep protocol of a distributed run: rank 0 drives, every rank steps.

Each global step the driver (rank 0, where ``LLM`` lives) broadcasts one :class:`StepMessage`
over the gloo ``cpu_group``: the new requests, each assigned to a data-parallel replica (the one
with the fewest outstanding requests, ties to the lower replica), the aborts, or shutdown.
Every rank of the replica's context-parallel group adds the same requests (the followers mirror
their leader: same requests, same deterministic scheduler), every rank calls
``engine.step()`` once, and the replies (finished outputs of the CP leaders, whether the rank
has unfinished work, its metrics, an error if its step failed) are gathered to rank 0.  Steps
continue while any rank has unfinished work.  With expert parallelism every ``step()`` runs one
forward (a dummy one when the rank has nothing scheduled), so the MoE collectives line up.

A worker that dies (the driver polls its processes every step), a collective that fails or
exceeds ``distributed_timeout_s``, or a worker whose engine fails to start ends the run with one
:class:`~deepinfer_core.errors.DistributedError` naming the rank and its log file.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import DistributedError

from .diagnosis import death_message, diagnose
from .init import (
    BackgroundCall,
    check_parallel_config,
    destroy_parallel,
    init_parallel,
    launched_by_torchrun,
    listening_store,
)
from .metrics import merge_metrics
from .processes import (
    WorkerProcess,
    new_log_dir,
    release_log_dir,
    spawn_workers,
    stop_workers,
    torchrun_log_dir,
)
from .protocol import AddRequest, StepMessage, broadcast, gather
from .serve import build_engine, handle_message

if TYPE_CHECKING:
    from deepinfer_core.engine.resolved import ResolvedConfig
    from deepinfer_core.outputs import RequestOutput
    from deepinfer_core.sampling.params import SamplingParams

logger = logging.getLogger("deepinfer.distributed")


# ---- driver side --------------------------------------------------------------------------------
class Coordinator:
    """Rank 0's side of the protocol: an :class:`~deepinfer_core.engine.client.EngineClient`,
    the interface ``LLM`` drives (requests go to the replicas; the configuration, tokenizer and
    parameter checks are rank 0's engine's).

    Build it with :meth:`start`; end it with :meth:`shutdown` (also at interpreter exit).

    Attributes:
        engine: rank 0's own engine (replica 0; also the tokenizer and parameter checks).
        parallel: rank 0's :class:`ParallelState`.
        log_dir: the directory of the workers' ``rank<k>.log`` files.
    """

    def __init__(
        self,
        engine: LLMEngine,
        parallel: ParallelState,
        procs: dict[int, WorkerProcess],
        logs: dict[int, str],
        log_dir: str,
        capacities: list[int],
        run_id: str = "",
    ):
        self.engine = engine
        self.run_id = run_id  # names this run's keys in the rendezvous store
        self.parallel = parallel
        self.procs = procs
        self.logs = logs
        self.log_dir = log_dir
        self.capacities = capacities
        self._dp = parallel.dp_size
        self._outstanding = [0] * self._dp  # requests sent to each replica and not finished
        self._owner: dict[str, int] = {}  # request id -> replica
        self._pending: list[tuple[int, AddRequest]] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._unfinished = [False] * parallel.world_size
        self._rank_metrics: list[dict[str, Any]] = [engine.get_metrics()] * parallel.world_size
        self._generated = [0] * parallel.world_size  # each rank's generated tokens, every step
        self._num_added = 0
        self._rounds = 0  # step messages sent (the workers count the same)
        self._broken: str | None = None  # why the protocol cannot continue
        self._closed = False
        _LIVE.add(self)  # shut down at interpreter exit (shutdown_all) unless it is first

    @property
    def config(self) -> ResolvedConfig:
        """Rank 0's engine's resolved configuration."""
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (rank 0's engine's)."""
        return self.engine.tokenizer

    def check_params(self, params: SamplingParams) -> None:
        """:meth:`LLMEngine.check_params` (the model and tokenizer are the same on every rank)."""
        self.engine.check_params(params)

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt (rank 0's tokenizer)."""
        return self.engine.encode(text)

    @property
    def metrics(self) -> _MergedTokens:
        """What ``LLM``'s progress bar reads: the generated tokens summed over the replicas (a
        view made on each access, so that the coordinator holds no reference to itself)."""
        return _MergedTokens(self)

    # ---- start -------------------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig) -> Coordinator:
        """Start (or, under torchrun, join) the world of ``config.world_size`` ranks as rank 0,
        build every rank's engine and check they all started.

        Raises:
            ConfigError: bad parallel options or rendezvous variables.
            DistributedError: a worker died or its engine failed to start (naming the rank).
        """
        check_parallel_config(config)
        procs: dict[int, WorkerProcess] = {}
        store = None
        if launched_by_torchrun():
            env, log_dir = dict(os.environ), torchrun_log_dir()
        else:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                raise DistributedError(
                    "torch.distributed is already initialized in this process (another LLM's distributed "
                    "run?); call its shutdown() first, or launch with torchrun"
                )
            log_dir = new_log_dir()
            store = listening_store(config.world_size, config.distributed_timeout_s)
            env, procs = spawn_workers(config, log_dir, port=store.port)
            logger.info(
                "distributed run: %d ranks on this host, worker logs in %s", config.world_size, log_dir
            )
        logs = {k: str(Path(log_dir) / f"rank{k}.log") for k in range(1, config.world_size)}
        try:
            parallel = _init_watching(config, env, procs, logs, store)
        except BaseException:
            stop_workers(procs)
            raise
        try:
            return cls._build(config, parallel, procs, logs, log_dir)
        except BaseException:
            stop_workers(procs)
            destroy_parallel()
            raise

    @classmethod
    def _build(
        cls,
        config: EngineConfig,
        parallel: ParallelState,
        procs: dict[int, WorkerProcess],
        logs: dict[int, str],
        log_dir: str,
    ) -> Coordinator:
        run_id = uuid.uuid4().hex[:12]
        broadcast((config.model_dump_json(), run_id), parallel)
        engine, own_error = None, None
        try:
            engine = build_engine(config, parallel)
        except Exception as e:
            own_error = e
        hello = {"rank": 0, "error": None, "log": "", "capacity": 0}
        if engine is not None:
            hello["capacity"] = engine.runner.capacity_tokens
        try:
            hellos = gather(hello, parallel)
        except Exception as e:
            raise diagnose(e, procs, logs, parallel, "while the engines started", run_id) from None
        assert hellos is not None
        for h in hellos[1:]:
            if h.get("log"):
                logs[h["rank"]] = h["log"]
        failed = [h for h in hellos[1:] if h["error"]]
        if own_error is not None or failed:
            with contextlib.suppress(Exception):
                broadcast(StepMessage(shutdown=True), parallel)
            if own_error is not None:
                raise own_error
            h = failed[0]
            raise DistributedError(
                f"rank {h['rank']}: the engine failed to start: {h['error']} "
                f"(log: {logs.get(h['rank'], '?')})"
            )
        assert engine is not None
        return cls(engine, parallel, procs, logs, log_dir, [h["capacity"] for h in hellos], run_id)

    # ---- the engine interface ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        sample_index: int = 0,
    ) -> None:
        """Queue a request for the next step, assigned to the replica with the fewest
        outstanding requests (ties to the lower replica)."""
        self._check_usable()
        replica = min(range(self._dp), key=lambda r: (self._outstanding[r], r))
        self._outstanding[replica] += 1
        self._owner[request_id] = replica
        req = AddRequest(request_id, list(prompt_token_ids), params, prompt, sample_index, self._num_added)
        self._num_added += 1
        self._pending.append((replica, req))

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests at the next step, on whichever rank holds them (thread-safe)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            self._aborts.extend(ids)

    def has_unfinished(self) -> bool:
        """Whether any request is queued here or unfinished on any rank."""
        return bool(self._pending) or any(self._outstanding) or any(self._unfinished)

    def step(self) -> list[RequestOutput]:
        """One global step; the outputs of the requests that finished on any replica."""
        self._check_usable()
        with self._lock:
            aborts, self._aborts = self._aborts, []
        pending, self._pending = self._pending, []
        return self._round(StepMessage(adds=pending, aborts=aborts))

    def abort_all(self, reason: str) -> list[RequestOutput]:
        """Finish every request on every rank with ``finish_reason="error"`` (no step runs)."""
        self._pending, self._aborts = [], []
        if self._broken is not None or self._closed:
            return []
        outputs = self._round(StepMessage(abort_all=reason))
        self._outstanding = [0] * self._dp
        self._owner.clear()
        return outputs

    def reset_metrics(self) -> None:
        """Zero every rank's metrics (:meth:`LLMEngine.reset_metrics`; no step runs, requests
        not yet sent stay pending)."""
        self._check_usable()
        self._round(StepMessage(reset_metrics=True))

    def _round(self, msg: StepMessage) -> list[RequestOutput]:
        """Broadcast ``msg``, handle it here, gather the replies; raise the first error."""
        done = False
        self._rounds += 1
        try:
            broadcast(msg, self.parallel)
            reply = handle_message(self.engine, self.parallel, msg)
            own_exception = reply.pop("exception", None)  # raised after the gather, kept out of it
            replies = gather(reply, self.parallel)
            done = True
        except Exception as e:
            when = f"in step {self._rounds}"
            diagnosis = diagnose(e, self.procs, self.logs, self.parallel, when, self.run_id, self._rounds)
            raise self._fail(diagnosis) from None
        finally:
            if not done and self._broken is None:  # interrupted mid-protocol (KeyboardInterrupt)
                self._broken = "a step was interrupted"
                self.shutdown()
        assert replies is not None
        outputs: list[RequestOutput] = []
        for rep in replies:
            rank = rep["rank"]
            self._unfinished[rank] = rep["unfinished"]
            if "metrics" in rep:
                self._rank_metrics[rank] = rep["metrics"]
            if "generated" in rep:
                self._generated[rank] = rep["generated"]
            outputs += rep["outputs"]
        for out in outputs:
            replica = self._owner.pop(out.request_id, None)
            if replica is not None:
                self._outstanding[replica] -= 1
        for rep in replies:
            if rep["error"]:
                if rep["rank"] == 0 and own_exception is not None:
                    raise own_exception
                raise DistributedError(
                    f"rank {rep['rank']}: its step failed: {rep['error']} "
                    f"(log: {self.logs.get(rep['rank'], '?')})"
                )
        return outputs

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise DistributedError(f"the distributed run has ended ({self._broken}); create a new LLM")
        if self._closed:
            raise DistributedError("the distributed run was shut down (LLM.shutdown()); create a new LLM")
        self._check_alive()

    def _check_alive(self) -> None:
        """Raise (and end the run) when a worker process has exited."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise self._fail(DistributedError(death_message(rank, code, self.logs)))

    def _fail(self, error: DistributedError) -> DistributedError:
        self._broken = str(error)
        self.shutdown()
        return error

    # ---- metrics -------------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, Any]:
        """The run's metrics: counters summed over the replicas (the CP leaders), rates from the
        summed counters over the longest rank's step time, the peak cache use of any rank, and
        ``per_rank``: every rank's own ``get_metrics()`` dict (as of the last step)."""
        return merge_metrics(self._rank_metrics, self.parallel.cp_size)

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Token positions of the replicas' caches together."""
        return sum(self.capacities[:: self.parallel.cp_size])

    # ---- end -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Tell the workers to exit, stop the ones that do not within a few seconds, and leave
        the world; a temporary log directory goes too when every worker exited cleanly
        (:func:`~.processes.release_log_dir`).  Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        if self._broken is None:
            try:
                broadcast(StepMessage(shutdown=True), self.parallel)
            except Exception as e:
                logger.debug("shutdown message not delivered: %s", e)
            # the workers release theirs and leave the world meanwhile (a communicator's
            # teardown may wait for its peers' own)
            self.engine.runner.release_graphs()
            destroy_parallel()
            stop_workers(self.procs)
        else:  # the workers wait in a collective that will not complete: stop them now
            stop_workers(self.procs, wait_s=0.5, warn=False)
            destroy_parallel()
        release_log_dir(self.log_dir, self.procs)
        self.engine.shutdown()


def shutdown_all() -> None:
    """Shut down every coordinator of this process that is still running."""
    for coordinator in list(_LIVE):
        coordinator.shutdown()


_LIVE: weakref.WeakSet[Coordinator] = weakref.WeakSet()
"""The running coordinators, held weakly: a coordinator nothing else refers to is not kept
alive for the exit hook (``LLM`` shuts its own down when it is released)."""
atexit.register(shutdown_all)


class _MergedTokens:
    """The one figure ``LLM``'s progress bar reads from ``metrics``: generated tokens, summed."""

    def __init__(self, coordinator: Coordinator):
        self._c = coordinator

    @property
    def num_generated_tokens(self) -> int:
        cp = self._c.parallel.cp_size
        return sum(self._c._generated[::cp])


def _init_watching(
    config: EngineConfig,
    env: dict[str, str],
    procs: dict[int, WorkerProcess],
    logs: dict[int, str],
    store: Any = None,
) -> ParallelState:
    """``init_parallel`` for rank 0, in a thread, while this one watches the workers: one that
    exits before joining ends the start with its error instead of a wait for the timeout."""
    call = BackgroundCall(lambda: init_parallel(config, env, store), "deepinfer-init")
    while not call.wait(0.1):
        for rank, proc in procs.items():
            code = proc.poll()
            if code is not None:
                raise DistributedError(death_message(rank, code, logs) + " (before joining the world)")
    err = call.error
    if err is not None:
        if isinstance(err, RuntimeError) and not isinstance(err, DistributedError):
            raise diagnose(err, procs, logs, None, "while joining the world") from None
        raise err
    return call.result
