"""Repository-wide pytest hooks (``tests/`` and every plugin's tests).

Tests marked ``gpu`` need a CUDA GPU that the ``cuda_sm100`` backend can run on, with its
kernels compiled (not in Triton's CPU interpreter).  Where that is missing they are skipped
with the reason; ``bash scripts/test_gpu.sh`` runs exactly them (docs/testing.md).  Tests marked
``npu`` need an Ascend NPU that the ``ascend950`` backend runs on (the real ``torch_npu``);
elsewhere they are skipped with the reason; ``bash scripts/test_npu.sh`` runs exactly them.

With ``DEEPINFER_TEST_TIMEOUT_S`` set (``scripts/test_gpu.sh`` sets it), a test still running
after that many seconds dumps every thread's stack and ends its process: a hung kernel then
costs one test (under xdist the worker is replaced and the test reported as crashed), not the
whole run.  With ``DEEPINFER_TEST_FAILURE_LOG`` set to a file, each failing test's report is
appended to it as soon as it fails (by the controlling process under xdist), so a run cut off
by a time limit still says why each failure it reached failed.  With ``DEEPINFER_TEST_SHARD``
set to ``K/N``, only every N-th collected test from the K-th on runs (the others deselected),
so a tier too long for one sitting runs as N commands that together run each test once.
With ``DEEPINFER_TEST_DURATION_LOG`` set to a file, each test's seconds (setup, call and
teardown together), outcome and node id are appended to it as soon as it ends, so a run cut off
by a time limit still says which of the tests it reached took the time.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import sys
from pathlib import Path

import pytest

TIMEOUT_ENV = "DEEPINFER_TEST_TIMEOUT_S"
"""Seconds a test may run before its process is ended with a stack dump (unset: no limit)."""


def gpu_unavailable_reason() -> str | None:
    """``None`` where the ``gpu`` tests can run here, else why not."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels would run in Triton's CPU interpreter"
    from deepinfer_core.testing import backend_unavailable_reason

    return backend_unavailable_reason("cuda_sm100")


def npu_unavailable_reason() -> str | None:
    """``None`` where the ``npu`` tests can run here, else why not (the ``ascend950`` probe)."""
    from deepinfer_core.testing import backend_unavailable_reason

    return backend_unavailable_reason("ascend950")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep this run's :data:`SHARD_ENV` share of the tests; skip the ``gpu`` and ``npu``
    tests, naming the reason, where their backend does not run."""
    _keep_shard(config, items)
    _skip_marked(items, "npu", npu_unavailable_reason)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


SHARD_ENV = "DEEPINFER_TEST_SHARD"
"""``K/N`` (1 <= K <= N): the run keeps the collected tests whose position counts K - 1 modulo N
(every N-th from the K-th, so each file's tests spread over the shards); unset: all of them."""

_SHARD = pytest.StashKey["tuple[int, int] | None"]()
"""The run's :data:`SHARD_ENV` as ``(K, N)``, read once by :func:`pytest_configure`."""


def _test_shard() -> tuple[int, int] | None:
    """:data:`SHARD_ENV` as ``(K, N)``, ``None`` where unset; a ``UsageError`` naming it where it
    is not ``K/N`` with 1 <= K <= N."""
    value = os.environ.get(SHARD_ENV, "").strip()
    if not value:
        return None
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"{SHARD_ENV}={value!r}: give K/N with 1 <= K <= N (e.g. 1/2), or unset it")
    return int(k), int(n)


def _keep_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the items outside the run's :data:`SHARD_ENV` share (in place; every xdist
    worker collects the same items, so each keeps the same share)."""
    shard = config.stash.get(_SHARD, None)
    if shard is None:
        return
    k, n = shard
    kept = [item for i, item in enumerate(items) if i % n == k - 1]
    dropped = [item for i, item in enumerate(items) if i % n != k - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def _skip_marked(items: list[pytest.Item], marker: str, unavailable) -> None:
    """Skip the items marked ``marker`` when ``unavailable()`` gives a reason."""
    marked = [item for item in items if item.get_closest_marker(marker) is not None]
    reason = unavailable() if marked else None
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"{marker} test: {reason}")
    for item in marked:
        item.add_marker(skip)


def _test_timeout() -> float | None:
    """:data:`TIMEOUT_ENV` in seconds, ``None`` where unset; a ``UsageError`` naming it where it
    is not a positive number."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise pytest.UsageError(f"{TIMEOUT_ENV}={value!r}: give a number of seconds above 0, or unset it")
    return seconds


FAILURE_LOG_ENV = "DEEPINFER_TEST_FAILURE_LOG"
"""A file each failing test's report is appended to as it fails (unset: none)."""


class _FailureLog:
    """The :data:`FAILURE_LOG_ENV` plugin: appends each failed report (setup, call or
    teardown) with its node id and its long representation."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.failed:
            return
        with self.path.open("a") as log:
            log.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


DURATION_LOG_ENV = "DEEPINFER_TEST_DURATION_LOG"
"""A file each test's seconds, outcome and node id are appended to as it ends (unset: none)."""


class _DurationLog:
    """The :data:`DURATION_LOG_ENV` plugin: a line ``seconds<TAB>outcome<TAB>node id`` a test,
    written at its teardown report, its phases' durations summed (the outcome: ``failed``
    where any phase failed, else ``skipped`` where one skipped, else ``passed``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.open: dict[str, tuple[float, str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        seconds, outcome = self.open.pop(report.nodeid, (0.0, "passed"))
        seconds += report.duration
        if report.failed or outcome == "failed":
            outcome = "failed"
        elif report.skipped:
            outcome = "skipped"
        if report.when != "teardown":
            self.open[report.nodeid] = (seconds, outcome)
            return
        with self.path.open("a") as log:
            log.write(f"{seconds:.2f}\t{outcome}\t{report.nodeid}\n")


def _log_path(env: str) -> Path | None:
    """The variable ``env`` as a path, ``None`` where unset; a ``UsageError`` naming it where
    its folder does not exist."""
    value = os.environ.get(env, "").strip()
    if not value:
        return None
    path = Path(value)
    if not path.parent.is_dir():
        folder = str(path.parent)
        raise pytest.UsageError(f"{env}={value!r}: its folder {folder!r} does not exist")
    return path


_TIMEOUT = pytest.StashKey["float | None"]()
"""The run's :data:`TIMEOUT_ENV`, read once by :func:`pytest_configure`."""


@functools.cache
def _uncaptured_stderr(config: pytest.Config):
    """The process's stderr as it was before pytest captured it (the dump must survive the
    process's end, which a capture file does not); ``sys.stderr`` where nothing captures it."""
    capture = getattr(config.pluginmanager.getplugin("capturemanager"), "_global_capturing", None)
    saved = getattr(getattr(capture, "err", None), "targetfd_save", None)
    return os.fdopen(os.dup(saved), "w") if isinstance(saved, int) else sys.stderr


def pytest_configure(config: pytest.Config) -> None:
    """Read and check :data:`TIMEOUT_ENV`, :data:`SHARD_ENV`, :data:`FAILURE_LOG_ENV` and
    :data:`DURATION_LOG_ENV` before any test runs; the logs are written by the process that
    reports (not by xdist's workers)."""
    config.stash[_TIMEOUT] = _test_timeout()
    config.stash[_SHARD] = _test_shard()
    failures, durations = _log_path(FAILURE_LOG_ENV), _log_path(DURATION_LOG_ENV)
    if hasattr(config, "workerinput"):
        return
    if failures is not None:
        config.pluginmanager.register(_FailureLog(failures), "deepinfer-failure-log")
    if durations is not None:
        config.pluginmanager.register(_DurationLog(durations), "deepinfer-duration-log")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Run the test under the :data:`TIMEOUT_ENV` watchdog, where that is set: past the limit,
    every thread's stack goes to stderr and the process ends (exit status 1)."""
    seconds = item.config.stash.get(_TIMEOUT, None)
    if seconds is None:
        return (yield)
    faulthandler.dump_traceback_later(seconds, exit=True, file=_uncaptured_stderr(item.config))
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
