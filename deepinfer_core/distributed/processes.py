"""Worker processes ``LLM`` starts on one host, and where their logs go.

``LLM(..., data_parallel_size=N)`` on one host (no torchrun variables in the environment)
starts ranks ``1 .. world_size-1`` itself as ``python -m deepinfer_core.distributed.worker``
processes (:func:`spawn_workers`): the rendezvous variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free port) and the engine configuration
as JSON (``DEEPINFER_WORKER_CONFIG``) in their environment, their stdout and stderr in
``<log_dir>/rank<k>.log``; :func:`stop_workers` stops them.  The log directory is
``$DEEPINFER_LOG_DIR`` or a new temporary one, which :func:`release_log_dir` removes after a run
whose workers all exited cleanly (a failed run keeps its logs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepinfer_core.config import EngineConfig

logger = logging.getLogger("deepinfer.distributed")

CONFIG_ENV = "DEEPINFER_WORKER_CONFIG"
"""The engine configuration (``EngineConfig`` as JSON) of a worker ``LLM`` started."""
LOG_DIR_ENV = "DEEPINFER_LOG_DIR"
"""Directory of the per-rank log files (default: a new temporary directory per run)."""
_STOP_WAIT_S = 5.0

WorkerProcess = subprocess.Popen


_TEMPORARY_LOG_DIRS: set[str] = set()
"""The log directories :func:`new_log_dir` created (the ones :func:`release_log_dir` may remove)."""


def new_log_dir() -> str:
    """The log directory of a run ``LLM`` starts: ``$DEEPINFER_LOG_DIR`` or a new temp dir."""
    configured = os.environ.get(LOG_DIR_ENV)
    if configured:
        Path(configured).mkdir(parents=True, exist_ok=True)
        return configured
    path = tempfile.mkdtemp(prefix="deepinfer-ranks-")
    _TEMPORARY_LOG_DIRS.add(path)
    return path


def release_log_dir(log_dir: str, procs: dict[int, WorkerProcess]) -> None:
    """At the end of a run: remove ``log_dir`` if :func:`new_log_dir` created it as a temporary
    directory and every worker exited with status 0; otherwise keep it (a configured
    ``$DEEPINFER_LOG_DIR``, torchrun's, or the logs that explain a failed worker) and say where."""
    clean = all(proc.poll() == 0 for proc in procs.values())
    if clean and log_dir in _TEMPORARY_LOG_DIRS:
        _TEMPORARY_LOG_DIRS.discard(log_dir)
        shutil.rmtree(log_dir, ignore_errors=True)
    elif procs:
        logger.info("worker logs kept in %s", log_dir)


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
