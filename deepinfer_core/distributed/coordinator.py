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
import json
import logging
import os
import pickle
import threading
import time
import traceback
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import DistributedError

from .init import (
    BackgroundCall,
    check_parallel_config,
    default_store,
    destroy_parallel,
    init_parallel,
    launched_by_torchrun,
    listening_store,
)

if TYPE_CHECKING:
    from deepinfer_core.engine.resolved import ResolvedConfig
    from deepinfer_core.outputs import RequestOutput
    from deepinfer_core.sampling.params import SamplingParams

    from .worker import WorkerProcess

logger = logging.getLogger("deepinfer.distributed")

# keys in the rendezvous store, under deepinfer/<run id>/ (a torchrun store outlives one run):
ERROR_KEY = "error/"  # + rank: a rank's last words
STEP_KEY = "step/"  # + rank: the last step message the rank handled
FAULT_ENV = "DEEPINFER_TEST_WORKER_EXIT_AT_STEP"
"""Test-only fault injector: ``RANK:STEP`` makes that worker exit (status 17, no goodbye) on
receiving its STEP-th step message, as a crashed or killed worker would; ``RANK:STEP:hang``
makes it hang there instead (alive, never answering); ``RANK:0`` makes its engine fail to
start."""
_EXIT_POLL_S = 5.0  # after a failed collective: how long to wait for a dead worker's exit status


@dataclass
class AddRequest:
    """One request (one sample) for a replica, with the arguments of ``LLMEngine.add_request``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    sample_index: int
    seed_index: int


@dataclass
class StepMessage:
    """What rank 0 broadcasts each global step."""

    adds: list[tuple[int, AddRequest]] = field(default_factory=list)  # (replica, request)
    aborts: list[str] = field(default_factory=list)
    abort_all: str | None = None  # finish every request with this reason instead of stepping
    reset_metrics: bool = False  # zero every rank's metrics instead of stepping
    shutdown: bool = False


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
FAST_BYTES = 8192
"""Messages and replies up to this many pickled bytes travel in one fixed-size ``uint8``
collective (a step message without requests, a reply without finished outputs); larger ones
take a second collective.  The object collectives of ``torch.distributed`` exchange sizes
first: two to four gloo round trips where one does (~1.1 ms a step on a 2-core CPU before)."""
_HEADER = 8  # the payload's length, little-endian


def _frame(obj: Any) -> tuple[torch.Tensor, bytes]:
    """A ``FAST_BYTES + 8`` frame: the pickled ``obj``'s length, then the pickle when it fits
    (else only the length); and the pickle."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    frame = torch.zeros(_HEADER + FAST_BYTES, dtype=torch.uint8)
    body = len(payload).to_bytes(_HEADER, "little") + (payload if len(payload) <= FAST_BYTES else b"")
    frame[: len(body)] = _tensor_of(body)
    return frame, payload


def _tensor_of(data: bytes) -> torch.Tensor:
    """``data`` as a ``uint8`` tensor (a copy: gloo may write into what it is given)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _length(frame: torch.Tensor) -> int:
    """The payload length a frame's header gives."""
    return int.from_bytes(frame[:_HEADER].numpy().tobytes(), "little")


def _unpickle(data: torch.Tensor) -> Any:
    """The object a ``uint8`` tensor holds pickled."""
    return pickle.loads(data.numpy().tobytes())


def broadcast(msg: Any, parallel: ParallelState) -> Any:
    """Rank 0's ``msg`` on every rank (over the gloo ``cpu_group``; one collective when it
    pickles to at most :data:`FAST_BYTES`)."""
    import torch.distributed as dist

    group = parallel.cpu_group
    if parallel.is_driver:
        frame, payload = _frame(msg)
    else:
        frame, payload = torch.zeros(_HEADER + FAST_BYTES, dtype=torch.uint8), b""
    dist.broadcast(frame, src=0, group=group)
    n = _length(frame)
    if n <= FAST_BYTES:
        return msg if parallel.is_driver else _unpickle(frame[_HEADER : _HEADER + n])
    big = _tensor_of(payload) if parallel.is_driver else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(big, src=0, group=group)
    return msg if parallel.is_driver else _unpickle(big)


def gather(obj: Any, parallel: ParallelState) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order), ``None`` elsewhere (one all-gather of
    fixed-size frames; a second, padded to the largest, when any pickles to more than
    :data:`FAST_BYTES`)."""
    import torch.distributed as dist

    group = parallel.cpu_group
    frame, payload = _frame(obj)
    frames = [torch.empty_like(frame) for _ in range(parallel.world_size)]
    dist.all_gather(frames, frame, group=group)
    lengths = [_length(f) for f in frames]
    longest = max(lengths)
    bigs: list[torch.Tensor] = []
    if longest > FAST_BYTES:  # every rank sees the lengths: all take the second round
        mine = torch.zeros(longest, dtype=torch.uint8)
        if len(payload) > FAST_BYTES:
            mine[: len(payload)] = _tensor_of(payload)
        bigs = [torch.empty_like(mine) for _ in range(parallel.world_size)]
        dist.all_gather(bigs, mine, group=group)
    if not parallel.is_driver:
        return None
    out = []
    for k, (f, n) in enumerate(zip(frames, lengths, strict=True)):
        data = f[_HEADER : _HEADER + n] if n <= FAST_BYTES else bigs[k][:n]
        out.append(obj if k == parallel.rank else _unpickle(data))
    return out


def store_key(run_id: str, what: str, rank: int) -> str:
    """The rendezvous-store key of ``what`` (:data:`ERROR_KEY`, :data:`STEP_KEY`) of ``rank``."""
    return f"deepinfer/{run_id}/{what}{rank}"


def report_error(parallel: ParallelState | None, text: str, run_id: str) -> None:
    """Leave ``text`` in the rendezvous store for rank 0 (best effort): the cause it names
    when a collective with this rank fails."""
    store = default_store()
    if store is None or parallel is None:
        return
    with contextlib.suppress(Exception):
        store.set(store_key(run_id, ERROR_KEY, parallel.rank), text[-2000:])


# ---- worker side --------------------------------------------------------------------------------
def run_worker(
    config: EngineConfig, log_path: str = "", env: dict[str, str] | None = None, store: Any = None
) -> int:
    """A non-driver rank: join the world (through ``store`` when given), build the engine from
    rank 0's configuration, serve step messages until rank 0 shuts down.  Returns the exit
    status (0 on a clean shutdown)."""
    parallel = init_parallel(config, env, store)
    fault_at, hang = _fault_step(parallel.rank) or (None, False)
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


def _fault_step(rank: int) -> tuple[int, bool] | None:
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
        from . import worker as worker_mod

        check_parallel_config(config)
        procs: dict[int, WorkerProcess] = {}
        store = None
        if launched_by_torchrun():
            env, log_dir = dict(os.environ), worker_mod.torchrun_log_dir()
        else:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                raise DistributedError(
                    "torch.distributed is already initialized in this process (another LLM's distributed "
                    "run?); call its shutdown() first, or launch with torchrun"
                )
            log_dir = worker_mod.new_log_dir()
            store = listening_store(config.world_size, config.distributed_timeout_s)
            env, procs = worker_mod.spawn_workers(config, log_dir, port=store.port)
            logger.info(
                "distributed run: %d ranks on this host, worker logs in %s", config.world_size, log_dir
            )
        logs = {k: str(Path(log_dir) / f"rank{k}.log") for k in range(1, config.world_size)}
        try:
            parallel = _init_watching(config, env, procs, logs, store)
        except BaseException:
            worker_mod.stop_workers(procs)
            raise
        try:
            return cls._build(config, parallel, procs, logs, log_dir)
        except BaseException:
            worker_mod.stop_workers(procs)
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
            raise _diagnose(e, procs, logs, parallel, "while the engines started", run_id) from None
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
            diagnosis = _diagnose(e, self.procs, self.logs, self.parallel, when, self.run_id, self._rounds)
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
                raise self._fail(DistributedError(_death_message(rank, code, self.logs)))

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
        the world.  Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        from .worker import stop_workers

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


_MAX_KEYS = ("peak_cache_usage", "num_steps")


def merge_metrics(per_rank: list[dict[str, Any]], cp_size: int = 1) -> dict[str, Any]:
    """One ``get_metrics()`` dict from every rank's: integer counters summed over the CP
    leaders (the followers repeat their leader's work), ``elapsed_s`` and ``num_steps`` the
    largest, tokens/s from the sums, ``cache_usage`` the mean, ``peak_cache_usage`` the
    largest, ``last_step`` and ``eplb`` rank 0's (EPLB's loads are the same on every EP rank);
    ``per_rank`` holds the ranks' own dicts."""
    leaders = per_rank[::cp_size]
    merged: dict[str, Any] = {}
    for key, value in leaders[0].items():
        if key in ("last_step", "speculative", "eplb"):
            continue
        values = [m[key] for m in leaders]
        if key in _MAX_KEYS or key == "elapsed_s":
            merged[key] = max(values)
        elif key == "cache_usage":
            merged[key] = sum(values) / len(values)
        elif isinstance(value, int) and not isinstance(value, bool):
            merged[key] = sum(values)
    elapsed = merged.get("elapsed_s", 0.0)
    merged["generation_tokens_per_s"] = merged["num_generated_tokens"] / elapsed if elapsed > 0 else 0.0
    merged["tokens_per_s"] = merged["num_scheduled_tokens"] / elapsed if elapsed > 0 else 0.0
    merged["last_step"] = per_rank[0].get("last_step")
    if "eplb" in per_rank[0]:
        merged["eplb"] = per_rank[0]["eplb"]
    if "speculative" in leaders[0]:
        merged["speculative"] = _merge_speculative([m["speculative"] for m in leaders])
    merged["per_rank"] = per_rank
    return merged


def _merge_speculative(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sum(p[k] for p in parts) for k in parts[0] if k.startswith("num_")}
    drafts = out.get("num_drafts", 0)
    out["acceptance_rate"] = (
        out["num_accepted_tokens"] / out["num_draft_tokens"] if out["num_draft_tokens"] else 0.0
    )

    def weighted(key: str) -> float:
        return sum(p[key] * p["num_drafts"] for p in parts) / drafts if drafts else 0.0

    out["mean_acceptance_length"] = weighted("mean_acceptance_length")
    width = len(parts[0]["acceptance_per_position"])
    out["acceptance_per_position"] = [
        sum(p["acceptance_per_position"][i] * p["num_drafts"] for p in parts) / drafts if drafts else 0.0
        for i in range(width)
    ]
    out["verify_length_histogram"] = [
        sum(x) for x in zip(*(p["verify_length_histogram"] for p in parts), strict=False)
    ]
    return out


# ---- diagnosis ----------------------------------------------------------------------------------
def _death_message(rank: int, code: int, logs: dict[int, str]) -> str:
    log = logs.get(rank, "?")
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    last = _last_line(log)
    return f"rank {rank} {how}; its log: {log}" + (f" (last line: {last})" if last else "")


def _last_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""
    except OSError:
        return ""


def _diagnose(
    error: BaseException,
    procs: dict[int, WorkerProcess],
    logs: dict[int, str],
    parallel: ParallelState | None,
    when: str,
    run_id: str = "",
    round_no: int | None = None,
) -> DistributedError:
    """The one error of a failed collective: a worker that exited (waiting up to a few seconds
    for its status), else a rank's report in the store, else a rank that did not finish step
    ``round_no`` (hung), else the collective's own error."""
    timeout = "timed out" in str(error).lower() or "timeout" in str(error).lower()
    # a closed connection: the peer probably died; give its exit status a moment to show
    deadline = time.monotonic() + (_EXIT_POLL_S if procs and not timeout else 0.0)
    while True:
        dead = [(rank, p.poll()) for rank, p in procs.items() if p.poll() is not None]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if dead:
        rank, code = dead[0]
        return DistributedError(_death_message(rank, code, logs) + f" ({when})")  # type: ignore[arg-type]
    store = default_store()
    if store is not None and parallel is not None:
        for rank in range(1, parallel.world_size):
            key = store_key(run_id, ERROR_KEY, rank)
            try:
                if store.check([key]):
                    text = store.get(key).decode(errors="replace")
                    return DistributedError(f"rank {rank} failed {when}: {text} (log: {logs.get(rank, '?')})")
            except Exception:
                break
    what = "timed out (distributed_timeout_s)" if timeout else "failed"
    if store is not None and parallel is not None and round_no:
        for rank in range(1, parallel.world_size):
            key = store_key(run_id, STEP_KEY, rank)
            try:
                last = int(store.get(key)) if store.check([key]) else 0
            except Exception:
                break
            if last < round_no:
                return DistributedError(
                    f"rank {rank} did not finish step {round_no} (the last it finished: {last}); "
                    f"a collective on rank 0 {what}; its log: {logs.get(rank, '?')}"
                )
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return DistributedError(
        f"a collective on rank 0 {what} {when}: {first}; a rank died or hung — see the worker logs "
        f"{', '.join(f'rank {k}: {v}' for k, v in sorted(logs.items()))}"
    )


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
                raise DistributedError(_death_message(rank, code, logs) + " (before joining the world)")
    err = call.error
    if err is not None:
        if isinstance(err, RuntimeError) and not isinstance(err, DistributedError):
            raise _diagnose(err, procs, logs, None, "while joining the world") from None
        raise err
    return call.result
