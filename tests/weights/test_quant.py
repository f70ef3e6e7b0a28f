"""FP8 block and FP4 e2m1 formats: checked against transformers' dequantiser and error bounds."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.errors import WeightLoadError
from deepinfer_core.weights.quant import (
    E2M1_MAGNITUDES,
    QuantizedTensor,
    concat_problem,
    concat_quantized,
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


def test_every_e2m1_code_decodes_to_its_table_value_with_the_sign_of_zero() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    got = unpack_fp4(pack_fp4(codes).view(1, -1)).view(-1)
    want = torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)])
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())  # code 8 is -0.0


def test_quantized_tensor_checks_its_shapes_and_dtypes() -> None:
    q, s = quant_fp8(torch.randn(130, 64))
    qt = QuantizedTensor(q, s, "fp8", (128, 128))
    assert qt.shape == (130, 64) and qt.nbytes == 130 * 64 + 2 * 4 and qt.device.type == "cpu"
    with pytest.raises(WeightLoadError, match="scale has shape"):
        QuantizedTensor(q[:64], s, "fp8", (128, 128))
    with pytest.raises(WeightLoadError, match="float8_e4m3fn"):
        QuantizedTensor(q.float(), s, "fp8", (128, 128))
    with pytest.raises(WeightLoadError, match="unknown format"):
        QuantizedTensor(q, s, "int4", (128, 128))
    packed, s4 = quant_fp4(torch.randn(2, 8, 64))
    as_int8 = QuantizedTensor(packed.view(torch.int8), s4, "fp4", (1, 32))
    assert as_int8.data.dtype == torch.uint8 and as_int8.shape == (2, 8, 64)
    with pytest.raises(WeightLoadError, match="block"):
        QuantizedTensor(packed, s4, "fp4", (2, 32))


@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_concatenated_parts_dequantise_to_the_concatenated_weights(scale_dtype: str) -> None:
    torch.manual_seed(6)
    parts = [QuantizedTensor(*quant_fp8(torch.randn(n, 200), (128, 128), scale_dtype), "fp8", (128, 128))
             for n in (256, 128, 72)]  # fmt: skip
    assert concat_problem(parts) is None  # only the last part ends in a partial tile
    fused = concat_quantized(parts)
    assert fused.shape == (456, 200) and fused.scale.dtype == parts[0].scale.dtype
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert "not multiples of the FP8 block rows 128" in concat_problem(parts[::-1])
    other = QuantizedTensor(*quant_fp8(torch.randn(128, 200), (64, 64)), "fp8", (64, 64))
    assert "formats differ" in concat_problem([parts[0], other])
    with pytest.raises(ValueError, match="cannot concatenate"):
        concat_quantized([parts[2], parts[0]])


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_index_select_takes_whole_experts(fmt: str) -> None:
    torch.manual_seed(7)
    w = torch.randn(6, 40, 64)
    if fmt == "fp8":
        qt = QuantizedTensor(*quant_fp8(w, (16, 32), "ue8m0"), "fp8", (16, 32))
    else:
        qt = QuantizedTensor(*quant_fp4(w, 32, "ue8m0"), "fp4", (1, 32))
    idx = torch.tensor([4, 0, 4])
    assert torch.equal(qt.index_select(idx).dequantize(), qt.dequantize()[idx])


@pytest.mark.parametrize(("fmt", "shape"), [("fp8", (300, 96)), ("fp8", (5, 40, 64)), ("fp4", (7, 24, 64))])
def test_dequantising_in_slices_is_bitwise_the_whole(monkeypatch, fmt: str, shape: tuple[int, ...]) -> None:
    """Large weights dequantise slice by slice (whole FP8 block rows for 2-D): same bits."""
    from deepinfer_core.weights import quant

    torch.manual_seed(8)
    w = torch.randn(shape)
    if fmt == "fp8":
        qt = QuantizedTensor(*quant_fp8(w, (64, 32), "ue8m0"), "fp8", (64, 32))
    else:
        qt = QuantizedTensor(*quant_fp4(w, 32), "fp4", (1, 32))
    whole = qt.dequantize(torch.bfloat16)
    monkeypatch.setattr(quant, "DEQUANT_CHUNK_ELEMENTS", 100)  # a slice of one row / expert / block
    assert torch.equal(qt.dequantize(torch.bfloat16), whole)
