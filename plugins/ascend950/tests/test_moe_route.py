"""``moe_route`` on ``npu_moe_gating_top_k`` (through the operator emulator) against the reference."""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend950 import moe_routing

from deepinfer_core.ops.moe import moe_route
from deepinfer_core.testing import conformance_cases

pytestmark = pytest.mark.usefixtures("npu_emulator")


def _cases(emulated_manager):
    spec = emulated_manager.get_backend("ascend950_emulated")
    return conformance_cases(spec, dtypes=(torch.float32,), ops=["moe_route"])


def test_conformance_of_moe_route_in_float32(emulated_manager):
    """Every case of the op's own and the backend's (V4-Flash's router shape) in float32: the
    operator's float32 scoring is then the reference's, ids exactly, weights within 1e-5."""
    cases = _cases(emulated_manager)
    assert len(cases) >= 9
    for case in cases:
        result = case.run()
        assert result.status == "passed", f"{case}: {result.message}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_route_as_the_contract_evaluated_in_float32(dtype):
    """The operator scores in float32 (its ``norm_out`` is float32) where the reference scores in
    the logits' dtype, so near-ties may pick differently from the reference in bf16; the oracle
    is the contract evaluated on the same logits widened to float32: same ids, weights within
    the dtype's rounding."""
    g = torch.Generator().manual_seed(1)
    for args, kwargs in moe_routing.route_cases(g, dtype):
        assert moe_routing.supports(*args, **kwargs) is True
        weights, ids = moe_routing.moe_route(*args, **kwargs)
        ref_w, ref_ids = moe_route(args[0].float(), *args[1:], **kwargs)
        assert weights.dtype == dtype and torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights.float(), ref_w.to(dtype).float(), atol=0, rtol=0)


def test_supports_names_what_the_operator_does_not_take():
    x = torch.randn(4, 16)
    assert "softmax" in moe_routing.supports(x, None, None, 2, "softmax", 1.0)
    assert "2048" in moe_routing.supports(torch.randn(2, 4096), None, None, 2, "sigmoid", 1.0)
    assert "64" in moe_routing.supports(x, None, torch.zeros(4, 65, dtype=torch.long), 2, "sigmoid", 1.0)
    assert "top_k" in moe_routing.supports(x, None, None, 17, "sigmoid", 1.0)
    assert moe_routing.supports(x, torch.zeros(16), None, 2, "sqrtsoftplus", 1.0) is True
