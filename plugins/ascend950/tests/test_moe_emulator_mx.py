"""The EMULATOR's MX quantisation against values worked out by hand from the documents (CANN's
aclnnDynamicMxQuant formula, the OCP MX specification)."""

from __future__ import annotations

import torch
from npu_emulator import moe_mx


def test_fp8_scale_is_floor_log2_amax_minus_8_and_values_saturate():
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1] = 300.0, -1.0  # block 0: floor(log2 300) = 8 -> scale 2**0
    x[0, 32] = 511.0  # block 1: floor(log2 511) = 8 -> 511 clamps to e4m3's 448
    x[1, 40] = 0.75  # row 1 block 0 all zero: byte 0; block 1: floor(log2 .75) = -1 -> 2**-9
    y, s = moe_mx.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn)
    assert s.dtype == torch.uint8 and s.shape == (2, 1, 2)
    assert s[0, 0].tolist() == [127, 127] and s[1, 0].tolist() == [0, 118]
    assert y.dtype == torch.float8_e4m3fn
    assert y[0, 0].float() == 288.0  # 300 rounds to e4m3's 288 (step 32 in [256, 448])
    assert y[0, 1].float() == -1.0 and y[0, 32].float() == 448.0
    assert y[1, 40].float() == 384.0  # 0.75 * 2**9


def test_fp4_rounds_half_to_even_and_packs_the_even_element_low():
    v = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0] + [0.0] * 24])
    y, s = moe_mx.npu_dynamic_mx_quant(v, dst_type=moe_mx.FLOAT4_E2M1FN_X2)
    assert s[0, 0, 0] == 127 - 0  # floor(log2 6) = 2, emax 2 -> 2**0
    codes = moe_mx.unpack_fp4_last(y)[0, :8]
    # ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert moe_mx.decode_e2m1(codes).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0]
    assert y[0, 0] == (codes[0] | (codes[1] << 4))


def test_odd_block_counts_pair_with_a_spare_byte():
    y, s = moe_mx.npu_dynamic_mx_quant(torch.ones(3, 96), dst_type=torch.float8_e4m3fn)
    assert s.shape == (3, 2, 2) and s[:, 1, 1].tolist() == [0, 0, 0]
    assert moe_mx.mx_group_scales(s, 3).tolist() == [[2.0**-8] * 3] * 3
