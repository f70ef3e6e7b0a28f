"""``linear`` with FP8 block-scaled weights as MXFP8 x MXFP8 (``npu_dynamic_mx_quant`` +
``npu_quant_matmul``, through the operator emulator) against the reference."""

from __future__ import annotations

import pytest
import torch
from deepinfer_ascend950 import linear_mx, quant_mx

from deepinfer_core.ops._cases import randn_fp8
from deepinfer_core.ops.linear import linear

pytestmark = pytest.mark.usefixtures("npu_emulator")


@pytest.fixture
def mx_on(monkeypatch):
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")


def _mx_exact(g: torch.Generator, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Activations MXFP8 represents exactly: integers in [-8, 8] with an 8 in every block of 32
    (the block's scale is then 2**-5 and every value times 32 has at most 4 significant bits)."""
    x = torch.randint(-8, 9, (rows, k), generator=g).float()
    x[:, ::32] = 8.0
    return x.to(dtype)


@pytest.mark.usefixtures("mx_on")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_activations_give_the_dequantised_weights_product(dtype):
    """With activations MXFP8 holds exactly, the MX path is the reference's ``x @ W.T`` on the
    dequantised weight (V4's 128x128 blocks with edge tiles, V4.1's 32x32 blocks): any error in
    the scale repetition, pairing or transposition would show."""
    g = torch.Generator().manual_seed(0)
    for _, weight in [case[0] for case in linear_mx.linear_cases(g, dtype)]:
        x = _mx_exact(g, 6, weight.shape[1], dtype)
        assert linear_mx.supports(x, weight) is True
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(linear_mx.linear(x, weight), linear(x, weight), atol=tol, rtol=tol)


@pytest.mark.usefixtures("mx_on")
def test_general_activations_stay_within_the_mxfp8_quantisation_bound():
    """Each activation is off by at most ``2**-4`` of itself (e4m3's half ulp; the tiny absolute
    floor below e4m3's normals is covered by the 1e-6), so ``|y - x @ W.T| <= 2**-4 |x| @ |W|.T``."""
    g = torch.Generator().manual_seed(2)
    for (x, weight), _ in linear_mx.linear_cases(g, torch.float32):
        y, ref = linear_mx.linear(x, weight), linear(x, weight)
        bound = 2**-4 * (x.abs() @ weight.dequantize().abs().t()) + 1e-6
        assert ((y - ref).abs() <= bound).all()
        assert (y - ref).abs().max() > 0  # the activations were quantised


def test_the_mx_path_is_opt_in_and_refuses_what_it_cannot_read(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 256), randn_fp8(g, 128, 256, scale_dtype="ue8m0")
    monkeypatch.delenv(quant_mx.MX_ACTIVATIONS_ENV, raising=False)
    assert linear_mx.supports(x, w) == quant_mx.MX_OFF_REASON
    monkeypatch.setenv(quant_mx.MX_ACTIVATIONS_ENV, "1")
    assert linear_mx.supports(x, w) is True
    assert "E8M0" in linear_mx.supports(x, randn_fp8(g, 128, 256))  # float32 block scales
    assert "QuantizedTensor" in linear_mx.supports(x, torch.randn(128, 256))
    odd = randn_fp8(g, 64, 80, block=(16, 16), scale_dtype="ue8m0")
    assert "multiple of the MX group" in linear_mx.supports(torch.randn(2, 80), odd)


def test_block_scales_are_repeated_not_requantised_and_cached():
    """The per-32 scales are the block scales repeated (one per 32 inputs of each row), paired;
    the same weight reuses them, a scale written in place rebuilds them."""
    g = torch.Generator().manual_seed(0)
    w = randn_fp8(g, 200, 320, scale_dtype="ue8m0")  # partial edge blocks both ways
    paired = quant_mx.mx_weight_scale(w)
    assert paired.shape == (200, 5, 2)
    per_group = paired.reshape(200, 10)
    block = w.scale.view(torch.uint8)
    for r, c in [(0, 0), (127, 3), (128, 4), (199, 9)]:
        assert per_group[r, c] == block[r // 128, c // 4]
    assert quant_mx.mx_weight_scale(w) is paired
    w.scale.view(torch.uint8)[1, 2] += 1
    rebuilt = quant_mx.mx_weight_scale(w)
    assert rebuilt is not paired and rebuilt.reshape(200, 10)[130, 8] == block[1, 2]
