"""FP8 block and FP4 e2m1 formats: checked against transformers' dequantiser and error bounds."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.errors import WeightLoadError
from deepinfer_core.weights.quant import (
    E2M1_MAGNITUDES,
    QuantizedTensor,
    dequant_fp4,
    dequant_fp8,
    encode_e2m1,
    pack_fp4,
    quant_fp4,
    quant_fp8,
    unpack_fp4,
)

fp8_mod = pytest.importorskip("transformers.integrations.finegrained_fp8")


def _hf_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """transformers' own block dequantiser (an independent oracle)."""
    return fp8_mod.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)


@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_fp8_dequant_matches_transformers(scale_dtype: str) -> None:
    torch.manual_seed(1)
    w = torch.randn(256, 384) * torch.logspace(-3, 1, 384)
    q, s = quant_fp8(w, (128, 128), scale_dtype)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    assert torch.equal(dequant_fp8(q, s), _hf_dequant(q, s))


@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_fp4_dequant_matches_transformers(scale_dtype: str) -> None:
    torch.manual_seed(2)
    w = torch.randn(2, 48, 96)
    packed, s = quant_fp4(w, 32, scale_dtype)
    assert packed.shape == (2, 48, 48) and s.shape == (2, 48, 3)
    ours = dequant_fp4(packed, s, 32)
    theirs = torch.stack([_hf_dequant(packed[i].view(torch.int8), s[i]) for i in range(2)])
    assert torch.equal(ours, theirs)


def test_fp4_nibble_order_low_nibble_is_even_element() -> None:
    # byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0) second; 0x97: 7 (6.0) then 9 (-0.5)
    got = unpack_fp4(torch.tensor([[0x21, 0x97]], dtype=torch.uint8))
    assert got.tolist() == [[0.5, 1.0, 6.0, -0.5]]


def test_fp4_pack_unpack_is_identity_on_all_bytes() -> None:
    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_fp4(encode_e2m1(unpack_fp4(every))), every)


def test_fp4_round_trip_exact_on_representable_values() -> None:
    torch.manual_seed(3)
    table = torch.tensor(E2M1_MAGNITUDES)
    values = table[torch.randint(0, 8, (16, 64))] * torch.where(torch.rand(16, 64) < 0.5, -1.0, 1.0)
    values[:, 0] = 6.0  # each 32-group holds ±6 so its scale is exactly its power of two
    values[:, 32] = -6.0
    w = values * torch.exp2(torch.randint(-8, 8, (16, 1)).float()).repeat_interleave(64, dim=1)
    for scale_dtype in ("fp32", "ue8m0"):
        packed, s = quant_fp4(w, 32, scale_dtype)
        assert torch.equal(dequant_fp4(packed, s, 32), w)


@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_fp8_round_trip_error_bound_with_partial_edge_blocks(scale_dtype: str) -> None:
    torch.manual_seed(4)
    w = torch.randn(200, 130) * torch.logspace(-4, 2, 130)  # partial tiles on both edges
    q, s = quant_fp8(w, (128, 128), scale_dtype)
    assert s.shape == (2, 2)
    sf = s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :130]
    err = (dequant_fp8(q, s) - w).abs()
    assert (err <= 2**-4 * w.abs() + 2**-10 * sf).all()
    if scale_dtype == "ue8m0":
        assert torch.equal(torch.exp2(torch.log2(s.float()).round()), s.float())
    else:  # each tile's max maps exactly onto 448
        assert q[:128, :128].float().abs().max() == 448


@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_fp4_round_trip_error_bound(scale_dtype: str) -> None:
    torch.manual_seed(5)
    w = torch.randn(3, 40, 64) * torch.logspace(-3, 1, 64)
    packed, s = quant_fp4(w, 32, scale_dtype)
    sf = s.float().repeat_interleave(32, -1)
    err = (dequant_fp4(packed, s, 32) - w).abs()
    assert (err <= torch.maximum(w.abs(), sf) / 4).all()


def test_zero_blocks_round_trip_to_zero() -> None:
    w = torch.zeros(130, 64)
    q, s = quant_fp8(w)
    assert torch.equal(dequant_fp8(q, s), w)
    packed, s4 = quant_fp4(w)
    assert torch.equal(dequant_fp4(packed, s4), w)


def test_wrong_scale_shape_is_rejected() -> None:
    q, s = quant_fp8(torch.randn(130, 64))
    with pytest.raises(WeightLoadError, match=r"scale has shape \(2, 1\), expected \(1, 1\)"):
        dequant_fp8(q[:64], s)


def test_quantized_tensor_dequantizes_like_the_functions() -> None:
    w = torch.randn(130, 64)
    q, s = quant_fp8(w)
    assert torch.equal(QuantizedTensor(q, s, "fp8", (128, 128)).dequantize(), dequant_fp8(q, s))
    packed, s4 = quant_fp4(w)
    assert torch.equal(
        QuantizedTensor(packed, s4, "fp4", (1, 32)).dequantize(torch.bfloat16),
        dequant_fp4(packed, s4, 32, torch.bfloat16),
    )
