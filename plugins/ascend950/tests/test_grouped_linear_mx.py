"""``grouped_linear`` with FP8 block-scaled weights as one MXFP8 x MXFP8 grouped matmul
(``npu_dynamic_mx_quant`` + ``npu_grouped_matmul``, through the operator emulator) against the
reference."""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend950 import grouped_linear_mx, quant_mx

from deepinfer_core.ops._cases import randn_fp8
from deepinfer_core.ops.linear import grouped_linear

pytestmark = pytest.mark.usefixtures("npu_emulator")


@pytest.fixture
def mx_on(monkeypatch):
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")


def _mx_exact(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Activations MXFP8 holds exactly: integers in [-8, 8] with an 8 in every block of 32."""
    x = torch.randint(-8, 9, shape, generator=g).float()
    x[..., ::32] = 8.0
    return x.to(dtype)


@pytest.mark.slow  # the first MX call of a session pays the emulator's warm-up (~0.6 s)
@pytest.mark.usefixtures("mx_on")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_activations_give_each_groups_dequantised_product(dtype):
    """With activations MXFP8 holds exactly, every group's slice times its block of the
    dequantised weight is the reference's (128x128 blocks, groups smaller than a block, 32x32
    blocks): an error in the group-major layout, the scale views or the group list would show."""
    g = torch.Generator().manual_seed(0)
    for (x0, weight), _ in grouped_linear_mx.grouped_cases(g, dtype):
        x = _mx_exact(g, tuple(x0.shape), dtype)
        assert grouped_linear_mx.supports(x, weight) is True
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        got = grouped_linear_mx.grouped_linear(x, weight)
        assert got.shape == (x.shape[0], x.shape[1], weight.shape[0] // x.shape[1])
        torch.testing.assert_close(got, grouped_linear(x, weight), atol=tol, rtol=tol)


@pytest.mark.usefixtures("mx_on")
def test_general_activations_stay_within_the_mxfp8_quantisation_bound():
    """Each activation is off by at most ``2**-4`` of itself, so every group's output is within
    ``2**-4 |x_g| @ |W_g|.T`` of the reference."""
    g = torch.Generator().manual_seed(3)
    for (x, weight), _ in grouped_linear_mx.grouped_cases(g, torch.float32):
        y, ref = grouped_linear_mx.grouped_linear(x, weight), grouped_linear(x, weight)
        bound = 2**-4 * grouped_linear(x.abs(), weight.dequantize().abs()) + 1e-6
        assert ((y - ref).abs() <= bound).all()
        assert (y - ref).abs().max() > 0  # the activations were quantised


def test_the_mx_path_is_opt_in_and_refuses_what_it_cannot_read(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 2, 256), randn_fp8(g, 256, 256, scale_dtype="ue8m0")
    monkeypatch.delenv(quant_mx.MX_ACTIVATIONS_ENV, raising=False)
    assert grouped_linear_mx.supports(x, w) == quant_mx.MX_OFF_REASON
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")
    assert grouped_linear_mx.supports(x, w) is True
    assert "E8M0" in grouped_linear_mx.supports(x, randn_fp8(g, 256, 256))  # float32 block scales
    assert "QuantizedTensor" in grouped_linear_mx.supports(x, torch.randn(256, 256))
    assert "not [G*N, K]" in grouped_linear_mx.supports(torch.randn(3, 3, 256), w)
    assert "[T, G, K]" in grouped_linear_mx.supports(torch.randn(3, 256), w)
