"""Worker processes of a distributed run, and their logs.

``LLM(..., data_parallel_size=N)`` on one host (no torchrun variables in the environment)
starts ranks ``1 .. world_size-1`` itself as ``python -m deepinfer_core.distributed.worker``
processes (:func:`spawn_workers`): the rendezvous variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port) and the engine configuration
as JSON (``DEEPINFER_WORKER_CONFIG``) in their environment, their stdout and stderr in
``<log_dir>/rank<k>.log``.  Every line a worker writes is prefixed ``[rank k]``.  A worker
whose parent disappears exits by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, NoReturn

from deepinfer_core.config import EngineConfig
from deepinfer_core.errors import DeepInferError

from .init import client_store

logger = logging.getLogger("deepinfer.distributed")

CONFIG_ENV = "DEEPINFER_WORKER_CONFIG"
"""The engine configuration (``EngineConfig`` as JSON) of a worker ``LLM`` started."""
LOG_DIR_ENV = "DEEPINFER_LOG_DIR"
"""Directory of the per-rank log files (default: a new temporary directory per run)."""
_STOP_WAIT_S = 5.0

WorkerProcess = subprocess.Popen


def new_log_dir() -> str:
    """The log directory of a run ``LLM`` starts: ``$DEEPINFER_LOG_DIR`` or a new temp dir."""
    configured = os.environ.get(LOG_DIR_ENV)
    if configured:
        Path(configured).mkdir(parents=True, exist_ok=True)
        return configured
    return tempfile.mkdtemp(prefix="deepinfer-ranks-")


def torchrun_log_dir() -> str:
    """The log directory of a torchrun world on this host: ``$DEEPINFER_LOG_DIR`` or
    ``<tmp>/deepinfer-<run id or master port>`` (the same for every local rank)."""
    configured = os.environ.get(LOG_DIR_ENV)
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "run")
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / f"deepinfer-{run}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous port of a local run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(
    config: EngineConfig, log_dir: str, port: int | None = None
) -> tuple[dict[str, str], dict[int, WorkerProcess]]:
    """Start ranks ``1 .. world_size-1`` of ``config`` on this host, meeting at ``port``
    (rank 0's listening store; ``None`` = a port free now).

    Returns rank 0's rendezvous environment and the worker processes by rank.
    """
    world = config.world_size
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port() if port is None else port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
    }
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding deepinfer_core
    path = os.environ.get("PYTHONPATH", "")
    procs: dict[int, WorkerProcess] = {}
    config_json = config.model_dump_json()
    try:
        for rank in range(1, world):
            env = {
                **os.environ,
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                CONFIG_ENV: config_json,
                LOG_DIR_ENV: log_dir,
                "PYTHONPATH": package_root + (os.pathsep + path if path else ""),
            }
            env.setdefault("OMP_NUM_THREADS", "1")
            with open(Path(log_dir) / f"rank{rank}.log", "wb") as log:
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "deepinfer_core.distributed.worker"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
    except BaseException:
        stop_workers(procs)
        raise
    return {**base, "RANK": "0", "LOCAL_RANK": "0"}, procs


def stop_workers(procs: dict[int, WorkerProcess], wait_s: float = _STOP_WAIT_S, warn: bool = True) -> None:
    """Wait up to ``wait_s`` for the workers to exit, then kill the rest (and reap them);
    ``warn``: log a warning for each one killed."""
    deadline = time.monotonic() + wait_s
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for rank, proc in procs.items():
        if proc.poll() is None:
            (logger.warning if warn else logger.debug)(
                "rank %d did not exit; killing it (pid %d)", rank, proc.pid
            )
            proc.kill()
            proc.wait()


class _PrefixWriter:
    """A text stream that prefixes every line with ``[rank k] `` and writes it to each target."""

    def __init__(self, prefix: str, targets: list[IO[str]]):
        self._prefix = prefix
        self._targets = targets
        self._at_line_start = True
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            out = []
            for line in text.splitlines(keepends=True):
                if self._at_line_start:
                    out.append(self._prefix)
                out.append(line)
                self._at_line_start = line.endswith("\n")
            data = "".join(out)
            for t in self._targets:
                try:
                    t.write(data)
                    t.flush()
                except (OSError, ValueError):
                    pass
        return len(text)

    def flush(self) -> None:
        for t in self._targets:
            with contextlib.suppress(OSError, ValueError):
                t.flush()

    def isatty(self) -> bool:
        return False


def setup_rank_logging(rank: int, level: str, log_file: str | None = None) -> None:
    """Prefix this process's stdout, stderr and ``deepinfer`` log lines with ``[rank k]``.

    Without ``log_file`` (a worker ``LLM`` started: its streams are its log file) the logger
    runs at ``level``.  With ``log_file`` (a torchrun rank: its streams are the console) the
    lines also go to that file, and the file gets ``info`` records even when the console's
    ``level`` is higher."""
    import faulthandler

    prefix = f"[rank {rank}] "
    console_err = _PrefixWriter(prefix, [sys.__stderr__])  # type: ignore[list-item]
    handlers: list[tuple[Any, str]] = [(console_err, level)]
    if log_file is not None:
        f = open(log_file, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives as long as the process
        to_file = _PrefixWriter(prefix, [f])
        handlers.append((to_file, worker_level(level)))
        faulthandler.enable(file=f)
        sys.stderr = _PrefixWriter(prefix, [sys.__stderr__, f])  # type: ignore[list-item,assignment]
        sys.stdout = _PrefixWriter(prefix, [sys.__stdout__, f])  # type: ignore[list-item,assignment]
    else:
        faulthandler.enable(file=sys.__stderr__)
        sys.stderr = console_err  # type: ignore[assignment]
        sys.stdout = _PrefixWriter(prefix, [sys.__stdout__])  # type: ignore[list-item,assignment]
    log = logging.getLogger("deepinfer")
    for h in list(log.handlers):
        log.removeHandler(h)
    levels = ["DEBUG", "INFO", "WARNING", "ERROR"]
    log.setLevel(min((lv.upper() for _, lv in handlers), key=levels.index))
    for stream, lv in handlers:
        handler = logging.StreamHandler(stream)
        handler.setLevel(lv.upper())
        handler.set_name("deepinfer-default")  # configure_logging() then adds no handler of its own
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.propagate = False


def _watch_parent() -> None:
    """Exit when the process that started this worker is gone (it was killed: nobody will
    send the shutdown message)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="deepinfer-parent-watch", daemon=True).start()


def worker_level(configured: str) -> str:
    """A worker's log level: the configured one, but at least ``info`` (its own log file)."""
    order = ["debug", "info", "warning", "error"]
    return order[min(order.index(configured), 1)]


def serve_rank(config: EngineConfig) -> int:
    """Serve as rank ``$RANK >= 1`` of a launched (torchrun) world until rank 0 shuts it down;
    returns the exit status (0 on a clean shutdown, 1 after an error, printed as one line).
    The rank's lines go to the console and to ``<log_dir>/rank<k>.log``, prefixed ``[rank k]``."""
    rank = int(os.environ.get("RANK", "0"))
    log_path = str(Path(torchrun_log_dir()) / f"rank{rank}.log")
    setup_rank_logging(rank, config.log_level, log_file=log_path)
    logger.info("rank %d serving (pid %d), log %s", rank, os.getpid(), log_path)
    from .coordinator import run_worker

    try:
        return run_worker(config, log_path)
    except DeepInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # rank 0 reports the run's error; this rank says why it stopped
        logger.debug("rank %d stopped", rank, exc_info=True)
        print(
            f"error: rank {rank} stopped: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}",
            file=sys.stderr,
        )
        return 1


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank's process after its run: every coordinator of the process shut down
    (the workers told to exit), the streams flushed, and the process left without the
    interpreter's teardown (measured: torch's static destructors sometimes abort with
    "terminate called without an active exception" right after a torchrun rank's process
    groups were torn down, turning a finished run into a failure that torchrun reports)."""
    from .coordinator import shutdown_all

    try:
        shutdown_all()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)


def main() -> int:
    """Entry point of ``python -m deepinfer_core.distributed.worker`` (a rank ``LLM`` started)."""
    import json

    rank = int(os.environ.get("RANK", "-1"))
    raw = os.environ.get(CONFIG_ENV)
    if rank < 1 or raw is None:
        print(
            "error: deepinfer_core.distributed.worker is started by LLM(...) with RANK >= 1 and "
            f"{CONFIG_ENV}; use torchrun -m deepinfer_core.launch to launch ranks yourself",
            file=sys.stderr,
        )
        return 2
    config = EngineConfig(**json.loads(raw))
    setup_rank_logging(rank, worker_level(config.log_level))
    _watch_parent()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    log_path = str(Path(os.environ.get(LOG_DIR_ENV, ".")) / f"rank{rank}.log")
    logger.info("worker of rank %d started (pid %d), log %s", rank, os.getpid(), log_path)
    from .coordinator import run_worker

    try:
        store = client_store(os.environ, config.world_size, config.distributed_timeout_s)
        return run_worker(config, log_path, store=store)
    except BaseException as e:
        logger.error("worker failed: %s: %s", type(e).__name__, e, exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
