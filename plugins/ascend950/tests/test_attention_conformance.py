"""The attention-side ops of the ascend950 backend against the reference, run on CPU through the
operator EMULATOR (``tests/npu_emulator``): the conformance suite over the op's own cases and
the backend's cases at the operators' shapes, in bfloat16 (the operators' dtype) and float32
(the row-wise operators take it too)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend950 import backend, ops_attention

from deepinfer_core.backends import BackendSpec
from deepinfer_core.ops import all_ops
from deepinfer_core.testing import conformance_cases

SPEC = BackendSpec(
    name="ascend950_emulated",
    device_type="cpu",
    ops=lambda: {name: impl for name, impl in backend.load_ops().items() if name in ops_attention.OPS},
    description="EMULATOR: the ascend950 attention ops on CPU (tests only)",
)
CASES = conformance_cases(SPEC, dtypes=(torch.bfloat16, torch.float32))
FAST = {"rms_norm", "apply_rope", "cache_write", "hc_post"}


def _marks(case) -> list:
    return [] if case.op in FAST else [pytest.mark.slow]


@pytest.mark.parametrize("case", [pytest.param(c, marks=_marks(c), id=str(c)) for c in CASES])
def test_conformance(case, npu_emulator):
    case.check()


def test_every_attention_op_has_a_case_the_operator_takes():
    """No op is covered only by skipped cases (the suite's own coverage rule, asserted here)."""
    assert not [c for c in CASES if c.op != "*" and c.failure is not None]
    # and the fused ops left to their decomposition, run on these ops (hc_post_pre on the mHC
    # operators and rms_norm)
    decomposed = {name for name, op in all_ops().items() if op.decomposition is not None}
    assert {c.op for c in CASES} == set(ops_attention.OPS) | decomposed
