"""Custom logits processors through the ``deepinfer_register_logits_processors`` hook: a third-party
test plugin registers one, requests select it by name, and the engine calls it (arguments and
prompt at submission, accepted tokens, one batched apply per step, release at the end)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deepinfer_core import SamplingParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.errors import SamplingParamsError
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.sampling.logits_processors import LogitsProcessor
from deepinfer_core.testing.managers import manager_with_plugin

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Recorder(LogitsProcessor):
    """Bans ``args["ban"]`` on its rows and records every call."""

    instances: list[Recorder] = []

    def __init__(self, vocab_size, device):
        super().__init__(vocab_size, device)
        self.added: dict[str, tuple[dict, list[int]]] = {}
        self.fed: dict[str, list[int]] = {}
        self.removed: list[str] = []
        self.untouched_rows_equal = True
        Recorder.instances.append(self)

    def add_request(self, request_id, args, prompt_token_ids):
        if not isinstance(args.get("ban", []), list):
            raise ValueError("'ban' must be a list of token ids")
        self.added[request_id] = (args, list(prompt_token_ids))
        self.fed[request_id] = []

    def on_tokens(self, request_id, token_ids):
        self.fed[request_id] += list(token_ids)

    def remove_request(self, request_id):
        self.removed.append(request_id)

    def apply(self, logits, request_ids):
        before = logits.clone()
        for i, rid in enumerate(request_ids):
            if rid is not None:
                ban = self.added[rid][0].get("ban", [])
                logits[i, torch.tensor(ban, dtype=torch.long)] = float("-inf")
        keep = [i for i, rid in enumerate(request_ids) if rid is None]
        self.untouched_rows_equal &= torch.equal(logits[keep], before[keep])
        return logits


class Plugin:
    @hookimpl
    def deepinfer_register_logits_processors(self, register):
        register("recorder", lambda: Recorder, description="test recorder")
        register("broken", lambda: Recorder, is_available=lambda: (False, "needs a unicorn"))


@pytest.fixture
def engine(tiny_dir: Path) -> LLMEngine:
    Recorder.instances.clear()
    manager = manager_with_plugin(Plugin(), "lp_test")
    return LLMEngine(EngineConfig(model=str(tiny_dir), max_num_seqs=8), plugins=manager)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


def _prompt(seed: int, n: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 200, (n,), generator=g).tolist()


def test_selected_requests_are_processed_and_the_others_untouched(engine):
    plain = _run(engine, {"a": (_prompt(1), GREEDY), "b": (_prompt(2), GREEDY)})
    ban = sorted(set(plain["a"].outputs[0].token_ids))[:4]  # tokens the plain run chose
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logits_processors={"recorder": {"ban": ban}}
    )
    outs = _run(engine, {"a": (_prompt(1), params), "b": (_prompt(2), GREEDY)})
    a = outs["a"].outputs[0].token_ids
    assert not set(a) & set(ban) and a != plain["a"].outputs[0].token_ids
    assert outs["b"].outputs[0].token_ids == plain["b"].outputs[0].token_ids
    [rec] = Recorder.instances
    assert rec.added["a"] == ({"ban": ban}, _prompt(1))
    assert rec.fed["a"] == a[:-1]  # every accepted token before the last step's sample
    assert rec.removed == ["a"] and rec.untouched_rows_equal


def test_list_form_and_several_requests_share_one_instance(engine):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logits_processors=["recorder"])
    outs = _run(engine, {f"r{i}": (_prompt(10 + i), params) for i in range(3)})
    assert all(o.outputs[0].finish_reason == "length" for o in outs.values())
    [rec] = Recorder.instances
    assert sorted(rec.removed) == ["r0", "r1", "r2"] and all(args == {} for args, _ in rec.added.values())


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        ({"nope": {}}, "logits processor 'nope' is not registered"),
        ({"broken": {}}, "logits processor 'broken' is unavailable: needs a unicorn"),
        ({"recorder": {"ban": 3}}, "'ban' must be a list of token ids"),
    ],
)
def test_a_bad_selection_fails_its_request_only(engine, selection, message):
    bad = SamplingParams(temperature=0, max_tokens=4, logits_processors=selection)
    outs = _run(engine, {"bad": (_prompt(3), bad), "good": (_prompt(4), GREEDY)})
    assert outs["bad"].outputs[0].finish_reason == "error" and message in outs["bad"].error
    assert outs["good"].outputs[0].finish_reason == "length"


def test_an_aborted_request_is_released(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logits_processors=["recorder"])
    engine.add_request("x", _prompt(5), params)
    engine.step()
    engine.abort_request("x")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"]
    assert Recorder.instances[0].removed == ["x"]


@pytest.mark.parametrize("value", [3, ["", "x"], {"a": 1}, {1: {}}])
def test_bad_params_are_refused_naming_the_field(value):
    with pytest.raises(SamplingParamsError, match="logits_processors"):
        SamplingParams(logits_processors=value)


class OldNamePlugin:
    @hookimpl
    def deepinfer_register_samplers(self, register):
        register("recorder", lambda: Recorder, description="test recorder")


def test_the_deprecated_hook_name_still_registers_and_says_so_once(tiny_dir, caplog):
    """``deepinfer_register_samplers`` (the hook's old name) registers logits processors as the
    new name does, with one deprecation line naming the plugin and the new name."""
    Recorder.instances.clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer.plugins"):
        manager = manager_with_plugin(OldNamePlugin(), "old_lp")
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 1 and "'old_lp'" in lines[0] and "deepinfer_register_logits_processors" in lines[0]
    assert manager.get_component("logits_processors", "recorder").plugin == "old_lp"
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), max_num_seqs=2), plugins=manager)
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logits_processors={"recorder": {"ban": [5]}}
    )
    outs = _run(engine, {"a": (_prompt(7), params)})
    assert 5 not in outs["a"].outputs[0].token_ids and Recorder.instances[0].removed == ["a"]
