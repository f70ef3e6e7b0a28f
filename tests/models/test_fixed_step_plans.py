"""``deepseek_v4.fixed_step_plans``: a fixed-shape step's plans as an op of the contract.

The model derives a padded step's plans through the op (a backend may provide it) and an
unpadded step's with ``build_metadata`` directly; the op's reference is ``build_metadata``.
Checked on the built-in tiny model with a backend table whose implementation of the op runs
the reference and records its calls (the engine's warm-up forwards are fixed-shape steps)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.contract.batch import SeqChunk
from deepinfer_core.contract.step_inputs import StepInputBuffers
from deepinfer_core.models.deepseek_v4.metadata import build_metadata
from deepinfer_core.models.deepseek_v4.plan_op import NAME, fixed_step_plans, plans_op, sample_steps
from deepinfer_core.ops import OpImpl, OpTable
from deepinfer_core.ops.registry import all_ops
from deepinfer_core.testing.compare import compare


def test_the_op_is_in_the_contract_with_its_cases():
    spec = all_ops()[NAME]
    assert spec.reference is fixed_step_plans and spec.family == "metadata"
    cases = spec.sample_cases(torch.Generator(), torch.float32)
    assert len(cases) == 15
    assert plans_op(OpTable.reference()) is fixed_step_plans


def test_the_reference_is_build_metadata_and_refuses_an_unpadded_step():
    for inputs, spec in sample_steps(16):
        problems: list[str] = []
        want = build_metadata(inputs, 8, [4, 8], 16, 8, 99, spec)
        compare(fixed_step_plans(inputs, 8, (4, 8), 16, 8, 99, spec), want, 0.0, 0.0, "plans", problems)
        assert not problems, problems
    bufs = StepInputBuffers(4, 2, 8, 8, 99, torch.device("cpu"))
    unpadded = bufs.prepare([SeqChunk(0, [5, 6], 0, [1])], [1], None)
    with pytest.raises(ValueError, match="fixed-shape step"):
        fixed_step_plans(unpadded, 8, (4,), 16, 8, 99)


def test_the_model_takes_a_fixed_shape_steps_plans_from_the_op():
    llm = LLM(backend="reference", max_num_seqs=4, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 20)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    calls: list[tuple[int, int]] = []

    def recorded(inputs, *args):
        calls.append((inputs.num_tokens, inputs.num_reqs))
        return fixed_step_plans(inputs, *args)

    model = llm.engine.runner.model
    model.ops = OpTable({NAME: OpImpl(fn=recorded)}, backend="recording")
    counts = llm.engine.runner.warm_up()  # fixed-shape steps of padding rows
    assert calls == [(t, 1) for t in counts]
    calls.clear()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls == []  # eager steps are unpadded: build_metadata, not the op
    assert after == before
