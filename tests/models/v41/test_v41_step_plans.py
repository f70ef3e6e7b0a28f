"""V4.1's step plans take V4's part of a fixed-shape step from ``deepseek_v4.fixed_step_plans``
(a backend's implementation where it has one), an unpadded step's from ``build_metadata``;
checked with a backend table whose implementation runs the reference and records its calls."""

from __future__ import annotations

from deepinfer_core import SamplingParams
from deepinfer_core.models.deepseek_v4.plan_op import NAME, fixed_step_plans
from deepinfer_core.ops import OpImpl, OpTable
from tests.models.v41.conftest import v41_llm


def test_v41_takes_a_fixed_shape_steps_v4_plans_from_the_op(v41_dir):
    llm = v41_llm(v41_dir, max_num_seqs=2, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 19)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    calls: list[tuple[int, tuple[int, ...]]] = []

    def recorded(inputs, window, ratios, *args):
        calls.append((inputs.num_tokens, ratios))
        return fixed_step_plans(inputs, window, ratios, *args)

    model = llm.engine.runner.model
    model.ops = OpTable({NAME: OpImpl(fn=recorded)}, backend="recording")
    counts = llm.engine.runner.warm_up()  # fixed-shape steps of padding rows
    pooled = tuple(sorted({r for r in model.ratios if r > 1}))
    assert calls == [(t, pooled) for t in counts]
    calls.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before
    assert calls == []  # eager steps are unpadded: build_metadata
