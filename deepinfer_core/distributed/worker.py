"""A worker rank's process: its entry points and its logs.

A rank ``LLM`` started runs ``python -m deepinfer_core.distributed.worker`` (:func:`main`,
spawned by :mod:`.processes`); a torchrun rank serves through :func:`serve_rank` and ends with
:func:`exit_rank`.  Both run the serve loop of :mod:`.serve`.  Every line a worker writes is
prefixed ``[rank k]``.  A worker whose parent disappears exits by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, NoReturn

from deepinfer_core.config import EngineConfig
from deepinfer_core.errors import DeepInferError

from .coordinator import shutdown_all
from .init import client_store
from .processes import CONFIG_ENV, LOG_DIR_ENV, torchrun_log_dir
from .serve import run_worker

logger = logging.getLogger("deepinfer.distributed")


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
    try:
        store = client_store(os.environ, config.world_size, config.distributed_timeout_s)
        return run_worker(config, log_path, store=store)
    except BaseException as e:
        logger.error("worker failed: %s: %s", type(e).__name__, e, exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
