"""A backend brings the device-graph runtime of its device type (``BackendSpec.graph_runtime``):
the engine captures its fixed-shape steps through it and replays them, with the tokens of an
eager engine; a runtime that has no graph here leaves the engine eager, saying why."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from deepinfer_core import SamplingParams
from deepinfer_core.backends import BackendSpec
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.graphs import EmulatedGraph
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.testing.managers import manager_with_plugin


class CountingGraph(EmulatedGraph):
    """An emulated graph that counts its captures and replays."""

    captures = 0
    replays = 0

    def capture(self, fn):
        CountingGraph.captures += 1
        return super().capture(fn)

    def replay(self):
        CountingGraph.replays += 1
        return super().replay()


def _engine(tiny_dir: Path, runtime, **config) -> LLMEngine:
    class Plugin:
        @hookimpl
        def deepinfer_register_backends(self, register):
            register(
                BackendSpec(
                    name="graphs_here",
                    device_type="cpu",
                    supports_graph_capture=True,
                    graph_runtime=runtime,
                )
            )

    manager = manager_with_plugin(Plugin(), "graphs_here")
    cfg = EngineConfig(model=str(tiny_dir), backend="graphs_here", max_num_seqs=4, **config)
    return LLMEngine(cfg, plugins=manager)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=5)
    for i in range(3):
        engine.add_request(str(i), list(range(5 + i, 20 + 2 * i)), params)
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step()}
    return [done[str(i)] for i in range(3)]


def test_the_engine_captures_and_replays_through_the_backends_graph_runtime(tiny_dir: Path):
    seen = []

    def runtime(device):
        seen.append(device.type)
        return CountingGraph, None, ""

    CountingGraph.captures = CountingGraph.replays = 0
    graphed = _greedy(_engine(tiny_dir, runtime))
    assert seen == ["cpu"] and CountingGraph.captures > 0 and CountingGraph.replays > 0
    eager = _greedy(_engine(tiny_dir, runtime, enforce_eager=True))
    assert graphed == eager


def test_a_runtime_without_graphs_leaves_the_engine_eager_and_says_why(tiny_dir: Path, caplog):
    CountingGraph.captures = 0
    with caplog.at_level(logging.DEBUG, logger="deepinfer.engine"):
        engine = _engine(tiny_dir, lambda device: (None, None, "no graph driver in this test"))
    assert CountingGraph.captures == 0
    assert "no graph driver in this test" in caplog.text
    assert all(len(tokens) == 5 for tokens in _greedy(engine))


class OneStreamGraph(EmulatedGraph):
    """An emulated graph whose capture fails on a step that forks a branch, as a graph runtime
    that cannot take a second stream would."""

    def capture(self, fn):
        from deepinfer_core.ops.overlap import observe_branches

        events: list[str] = []
        with observe_branches(lambda event, branch: events.append(event)):
            out = super().capture(fn)
        if "fork" in events:
            raise RuntimeError("a second stream in the capture")
        return out


def test_a_capture_that_fails_on_two_streams_is_taken_again_on_one(tiny_dir: Path, monkeypatch, caplog):
    """The blocks' chains overlapped (deferred on the CPU, as a GPU runs them on a second stream)
    and a graph runtime that refuses that: the engine turns overlap off, says so once, captures
    every graph on one stream and gives an eager engine's tokens."""
    from deepinfer_core.ops import overlap

    monkeypatch.setenv(overlap.DEFER_ENV, "1")
    monkeypatch.setattr(overlap, "_TURNED_OFF", [])
    with caplog.at_level(logging.WARNING, logger="deepinfer.ops"):
        engine = _engine(tiny_dir, lambda device: (OneStreamGraph, None, ""))
    assert engine.runner.graph_manager.graphs("decode"), "no graph was captured"
    offs = [r.getMessage() for r in caplog.records if "stream overlap off" in r.getMessage()]
    assert (
        len(offs) == 1 and "on two streams failed (RuntimeError: a second stream in the capture)" in offs[0]
    )
    assert not overlap.overlap_applies(torch.zeros(1, 8))  # off for the process, deferral or not
    graphed = _greedy(engine)
    monkeypatch.setattr(overlap, "_TURNED_OFF", [])
    assert graphed == _greedy(
        _engine(tiny_dir, lambda device: (OneStreamGraph, None, ""), enforce_eager=True)
    )


class FailingGraph(EmulatedGraph):
    """An emulated graph whose capture always fails."""

    def capture(self, fn):
        raise RuntimeError("no capture here")


def test_a_capture_that_fails_without_a_second_stream_leaves_overlap_on(tiny_dir: Path, monkeypatch, caplog):
    """No chain overlapped (the CPU, no deferral): a failed capture is not blamed on two streams;
    the engine runs eagerly and overlap stays as it was."""
    from deepinfer_core.ops import overlap

    monkeypatch.delenv(overlap.DEFER_ENV, raising=False)
    monkeypatch.setattr(overlap, "_TURNED_OFF", [])
    with caplog.at_level(logging.WARNING):
        engine = _engine(tiny_dir, lambda device: (FailingGraph, None, ""))
    assert not engine.runner.graph_manager.graphs("decode")
    assert not any("stream overlap off" in r.getMessage() for r in caplog.records)
    assert overlap._TURNED_OFF == []
