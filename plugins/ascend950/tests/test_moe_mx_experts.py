"""``moe_experts`` with FP4 experts as MXFP4 x MXFP8 grouped matmuls (``npu_dynamic_mx_quant`` +
``npu_grouped_matmul``, through the operator emulator) against the reference."""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend950 import moe_mx_experts, quant_mx

from deepinfer_core.ops._cases import randn_fp4
from deepinfer_core.ops.moe import moe_experts

pytestmark = pytest.mark.usefixtures("npu_emulator")


@pytest.fixture
def mx_on(monkeypatch):
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")


def test_grouped_matmul_of_exact_rows_is_each_experts_dequantised_product(npu_emulator):
    """Rows MXFP8 holds exactly (integers in [-8, 8], an 8 in every block of 32), sorted by
    expert with some experts empty: each row times its expert's dequantised FP4 weight, exactly
    (the transposed packed bytes, the paired scales and the cumulative group ends all show)."""
    g = torch.Generator().manual_seed(0)
    stack = randn_fp4(g, 5, 96, 64, scale=0.3, scale_dtype="ue8m0")
    experts = torch.tensor([0, 0, 2, 2, 2, 4])
    rows = torch.randint(-8, 9, (6, 64), generator=g).float()
    rows[:, ::32] = 8.0
    ends = torch.searchsorted(experts, torch.arange(5), right=True)
    got = moe_mx_experts._grouped(npu_emulator, rows, stack, ends, torch.float32)
    dense = stack.dequantize()
    want = torch.stack([dense[e] @ r for e, r in zip(experts.tolist(), rows, strict=True)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("mx_on")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_follow_the_reference_within_the_activation_quantisation(dtype):
    """Decode, a block with a duplicate expert and the shared add, expert-parallel padding ids, a
    clamp that bites, odd group counts: within 10% of the reference's norm (MXFP8 activations
    cost about 5% here; a wrong expert, scale or combine order costs the whole output)."""
    g = torch.Generator().manual_seed(3)
    for args, kwargs in moe_mx_experts.experts_cases(g, dtype):
        assert moe_mx_experts.supports(*args, **kwargs) is True
        got, want = moe_mx_experts.moe_experts(*args, **kwargs), moe_experts(*args, **kwargs)
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want.float()).norm() <= 0.1 * want.float().norm()


def test_padding_ids_contribute_nothing(mx_on):
    """Rows whose every id is outside [0, E) get exactly the shared expert's output."""
    g = torch.Generator().manual_seed(4)
    (x, ids, w, gu, dn, lim), _ = moe_mx_experts.experts_cases(g, torch.float32)[0]
    ids = torch.tensor([[-1, 8, -1]])
    shared = torch.randn(1, x.shape[1], generator=g)
    out = moe_mx_experts.moe_experts(x, ids, w, gu, dn, lim, shared=shared)
    assert torch.equal(out, shared)


def test_the_mx_path_is_opt_in_and_refuses_plain_or_fp32_scaled_stacks(monkeypatch):
    g = torch.Generator().manual_seed(0)
    (x, ids, w, gu, dn, lim), _ = moe_mx_experts.experts_cases(g, torch.float32)[0]
    monkeypatch.delenv(quant_mx.MX_ACTIVATIONS_ENV, raising=False)
    assert moe_mx_experts.supports(x, ids, w, gu, dn, lim) == quant_mx.MX_OFF_REASON
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")
    assert moe_mx_experts.supports(x, ids, w, gu, dn, lim) is True
    fp32_scaled = randn_fp4(g, 8, 64, 64)
    assert "E8M0" in moe_mx_experts.supports(x, ids, w, fp32_scaled, dn, lim)
    assert "QuantizedTensor" in moe_mx_experts.supports(x, ids, w, gu.dequantize(), dn, lim)
