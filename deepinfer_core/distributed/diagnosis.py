"""Rank 0's diagnosis of a failed distributed run: the one :class:`DistributedError` naming the
rank that died (exit status, last log line), reported an error, or hung."""

from __future__ import annotations

import os
import time

from deepinfer_core.contract.parallel import ParallelState
from deepinfer_core.errors import DistributedError

from .init import default_store
from .processes import WorkerProcess
from .protocol import ERROR_KEY, STEP_KEY, store_key

_EXIT_POLL_S = 5.0  # after a failed collective: how long to wait for a dead worker's exit status


def death_message(rank: int, code: int, logs: dict[int, str]) -> str:
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


def diagnose(
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
        return DistributedError(death_message(rank, code, logs) + f" ({when})")  # type: ignore[arg-type]
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
