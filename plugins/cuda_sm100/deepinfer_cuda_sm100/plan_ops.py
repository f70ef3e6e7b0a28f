"""A fixed-shape step's plans on the ``cuda_sm100`` backend: ``deepseek_v4.fixed_step_plans`` in
a Triton launch for the tokens, one per compress ratio and a gather (kernels in
:mod:`deepinfer_cuda_sm100.kernels.step_plans`), where the reference takes about ninety PyTorch
ops, each a launch of a captured graph.

:func:`plan_ops` returns its :class:`OpImpl` with a ``supports`` predicate (shapes, dtypes and
devices only) and conformance cases of its own: the op's steps (decode, verify and mixed,
padding only) at V4-Flash's geometry on the GPU, a small one in the interpreter.  Importing
this module does not import Triton; :func:`plan_ops` does.
"""

from __future__ import annotations

import torch

from deepinfer_core.contract.step_inputs import REQ_FIELDS
from deepinfer_core.models.deepseek_v4.plan_op import NAME, plan_cases
from deepinfer_core.ops import OpImpl
from deepinfer_cuda_sm100.checks import device_problem, first_problem

PLAN_OPS = (NAME,)
"""The ops :func:`plan_ops` provides."""

V4_FLASH_GEOMETRY = (128, (4, 128), 256)
"""The GPU cases' window, compress ratios and page size (V4-Flash's)."""
SMALL_GEOMETRY = (8, (4, 16), 16)
"""The interpreter cases' window, compress ratios and page size."""


def make_supports(interpreted: bool, max_reqs: int):
    """The ``supports`` predicate of ``deepseek_v4.fixed_step_plans``."""

    def supports(inputs, window, ratios, page_size, num_slots, trash_page, num_spec_tokens=0) -> bool | str:
        fields = inputs.fields()
        prev = inputs.prev_tokens
        named = [("input_ids", inputs.input_ids), ("fields", fields), ("block_tables", inputs.block_tables)]
        if prev is not None:
            named.append(("prev_tokens", prev))
        problem = device_problem(interpreted, named)
        if problem:
            return problem
        tables = inputs.block_tables
        return first_problem(
            (inputs.spans is None, "an unpadded step: its shapes follow the host's values"),
            (inputs.num_reqs <= max_reqs, f"{inputs.num_reqs} requests: the kernels take at most {max_reqs}"),
            (inputs.num_reqs >= 1, "a step without requests"),
            (fields.dtype == torch.int64 and fields.shape[0] == len(REQ_FIELDS), "fields are not int64 rows"),
            (inputs.input_ids.dtype == torch.int64, f"input_ids dtype {inputs.input_ids.dtype} is not int64"),
            (tables.dtype == torch.int64 and tables.dim() == 2, "block_tables is not a 2-D int64 tensor"),
            (tables.stride(1) == 1, "block_tables has a non-unit column stride"),
            (prev is None or (prev.dim() == 1 and not prev.is_floating_point()), "prev_tokens: not ints"),
            (window >= 0 and num_spec_tokens >= 0, "negative window or draft count"),
        )

    return supports


def plan_ops() -> dict[str, OpImpl]:
    """``{op name: OpImpl}`` for :data:`PLAN_OPS` (imports Triton and the kernels); the cases are
    the op's steps at the backend's geometry
    (:func:`~deepinfer_core.models.deepseek_v4.plan_op.plan_cases`)."""
    from deepinfer_cuda_sm100.kernels import _common, step_plans

    interpreted = _common.INTERPRETED
    supports = make_supports(interpreted, step_plans.MAX_REQS)
    cases = plan_cases((SMALL_GEOMETRY if interpreted else V4_FLASH_GEOMETRY,))
    return {NAME: OpImpl(fn=step_plans.fixed_step_plans, supports=supports, sample_cases=cases)}
