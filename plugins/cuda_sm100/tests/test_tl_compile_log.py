""":func:`deepinfer_cuda_sm100.tl.compile_log.logged_compile`: a TileLang kernel build slow enough
to be a compile (not a disk-cache load) is logged once with its configuration; a load is not.
The builders here are real functions that take the time a load or a compile would (TileLang
itself runs only on the GPU machines)."""

from __future__ import annotations

import functools
import logging
import time

import pytest
from deepinfer_cuda_sm100.tl import compile_log


@pytest.fixture
def fast_threshold(monkeypatch):
    monkeypatch.setattr(compile_log, "COMPILE_S", 0.05)


def _builder(seconds: float):
    calls = []

    @functools.cache
    @compile_log.logged_compile("moe")
    def _kernel(kind: str, hidden: int, stages: int = 2):
        calls.append((kind, hidden, stages))
        time.sleep(seconds)
        return f"kernel:{kind}:{hidden}:{stages}"

    return _kernel, calls


def test_a_compile_is_logged_once_with_its_configuration(fast_threshold, caplog):
    build, calls = _builder(0.12)
    with caplog.at_level(logging.WARNING, logger=compile_log.logger.name):
        assert build("gate_up", 4096, stages=3) == "kernel:gate_up:4096:3"
        assert build("gate_up", 4096, stages=3) == "kernel:gate_up:4096:3"  # cached: no second build
    assert calls == [("gate_up", 4096, 3)]
    [record] = caplog.records
    message = record.getMessage()
    assert "moe('gate_up', 4096, stages=3)" in message and "not in the disk cache" in message
    assert "deepinfer_cuda_sm100.tl.precompile" in message
    assert float(message.split(" in ")[1].split(" s")[0]) >= 0.1  # the time, to a tenth of a second


def test_a_disk_cache_load_is_not_logged(fast_threshold, caplog):
    build, _ = _builder(0.0)
    with caplog.at_level(logging.WARNING, logger=compile_log.logger.name):
        assert build("down", 2048) == "kernel:down:2048:2"
    assert not caplog.records
