"""Schedulers are plugins: ``EngineConfig.scheduler`` picks one registered through
``deepinfer_register_schedulers`` (the core registers ``fcfs``), and the engine runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.engine.scheduler import Scheduler
from deepinfer_core.errors import ConfigError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.testing.managers import manager_with_plugin

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Counting(Scheduler):
    """FCFS, counting its steps (a plugin's scheduler would override the admission order)."""

    steps = 0

    def schedule(self):
        Counting.steps += 1
        return super().schedule()


class Plugin:
    @hookimpl
    def deepinfer_register_schedulers(self, register):
        register("counting", lambda: Counting)
        register("not_a_scheduler", lambda: object)
        register("offline", lambda: Counting, is_available=lambda: (False, "needs a cluster"))


def _run(engine: LLMEngine) -> list[list[int]]:
    for i, n in enumerate((5, 17, 30)):
        engine.add_request(f"r{i}", list(range(3, 3 + n)), PARAMS)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return [o.outputs[0].token_ids for o in sorted(outs, key=lambda o: o.request_id)]


def test_the_configured_scheduler_runs_and_fcfs_is_the_default(tiny_dir: Path):
    manager = manager_with_plugin(Plugin(), "sched_test")
    default = LLMEngine(EngineConfig(model=str(tiny_dir)), plugins=manager)
    assert type(default.scheduler) is Scheduler
    Counting.steps = 0
    counting = LLMEngine(EngineConfig(model=str(tiny_dir), scheduler="counting"), plugins=manager)
    assert isinstance(counting.scheduler, Counting)
    assert _run(counting) == _run(default) and Counting.steps > 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", r"scheduler 'nope' is not registered \(known: \['counting', 'fcfs'"),
        ("offline", "scheduler 'offline' is unavailable: needs a cluster"),
        ("not_a_scheduler", "not a subclass of deepinfer_core.engine.scheduler.Scheduler"),
    ],
)
def test_a_bad_scheduler_is_a_one_line_config_error(tiny_dir: Path, name: str, message: str):
    manager = manager_with_plugin(Plugin(), "sched_test")
    with pytest.raises(ConfigError, match=message):
        LLMEngine(EngineConfig(model=str(tiny_dir), scheduler=name), plugins=manager)
