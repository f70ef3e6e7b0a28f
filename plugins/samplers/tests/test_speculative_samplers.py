"""Speculative decoding with the samplers plugin: structured outputs (llguidance matchers
validate, advance over and roll back draft tokens) and the ``no_repeat_ngram`` logits processor
(``on_rollback``) give exactly the tokens of plain decoding.  A test drafter proposes the plain
run's tokens with every third proposal corrupted, so drafts are accepted, rejected by the
target, and rejected by the grammar."""

from __future__ import annotations

import json

import deepinfer_samplers.plugin as samplers_plugin
import pytest

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.hookspecs import hookimpl
from deepinfer_core.speculative import Draft, Drafter
from deepinfer_core.speculative.step_cost import StepCost
from deepinfer_core.testing.managers import manager_with_plugin

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from schema_corpus import SCHEMAS as CORPUS  # noqa: E402

SCHEMAS = dict(CORPUS[10:16])  # objects, arrays, enums: documents of a few dozen tokens


class Oracle(Drafter):
    script: dict[tuple[int, ...], list[int]] = {}

    def propose(self, contexts):
        drafts = []
        for c in contexts:
            out = list(c.token_ids[c.num_prompt_tokens :])
            ref = self.script.get(tuple(c.token_ids[: c.num_prompt_tokens]), [])
            tokens = list(ref[len(out) : len(out) + c.max_tokens]) if ref[: len(out)] == out else []
            if tokens and len(out) % 3 == 0:
                tokens[-1] = (tokens[-1] + 7) % self.vocab_size
            drafts.append(Draft(tokens))
        return drafts


class OraclePlugin:
    @hookimpl
    def deepinfer_register_drafters(self, register):
        register("oracle", lambda: Oracle)


def _llm(speculative=None) -> LLM:
    manager = manager_with_plugin(samplers_plugin, "samplers")
    manager.add_plugin(OraclePlugin(), "oracle_test")
    llm = LLM.from_engine(LLMEngine(EngineConfig(max_num_seqs=8, speculative=speculative), plugins=manager))
    if llm.engine.spec is not None and llm.engine.spec.cost is not None:
        # DSpark weighs drafts against step times measured at start, noise on a busy machine:
        # fixed here (a verified token costs 5 % of a step), as in tests/speculative
        llm.engine.spec.cost = StepCost({(b, t): 1.0 + 0.05 * b * (t - 1) for b in (1, 8) for t in (1, 6)})
    return llm


def _run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def _script(llm_ref, prompts, outs):
    tok = llm_ref.get_tokenizer()
    Oracle.script = {
        tuple(tok.encode(p)): list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)
    }


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_structured_outputs_with_speculation_equal_plain_decoding(greedy):
    names = list(SCHEMAS)
    prompts = [f"JSON {i}:" for i in range(len(names))] + ["free text"]
    temp = {"temperature": 0} if greedy else {"temperature": 1.0}
    params = [
        SamplingParams(
            max_tokens=120, seed=i, structured_outputs=StructuredOutputsParams(json=SCHEMAS[n]), **temp
        )
        for i, n in enumerate(names)
    ] + [SamplingParams(max_tokens=30, seed=99, ignore_eos=True, **temp)]
    ref_llm = _llm()
    ref = _run(ref_llm, prompts, params)
    _script(ref_llm, prompts, ref)
    spec = _llm({"drafter": "oracle", "max_draft_tokens": 4})
    outs = _run(spec, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    for o, n in zip(outs, names, strict=False):
        if o.outputs[0].finish_reason == "stop":
            schema = SCHEMAS[n] if isinstance(SCHEMAS[n], dict) else json.loads(SCHEMAS[n])
            jsonschema.validate(json.loads(o.outputs[0].text), schema)
    m = spec.get_metrics()["speculative"]
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"], m


def test_no_repeat_ngram_with_speculation_equals_plain_decoding():
    prompts = ["a b a b a b", "one two three one two three"]
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=-2.0,
        logits_processors={"no_repeat_ngram": {"size": 2}},
    )  # fmt: skip
    ref_llm = _llm()
    ref = _run(ref_llm, prompts, params)
    _script(ref_llm, prompts, ref)
    spec = _llm({"drafter": "oracle", "max_draft_tokens": 4})
    outs = _run(spec, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert spec.get_metrics()["speculative"]["num_accepted_tokens"] > 0
