"""The packed FP8 KV-cache format (``kv_cache_dtype="fp8"``): layout, quantisation error bounds,
and the ops that take it (``cache_write``, ``sparse_attention``), with no host sync and with
batch invariance."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepinfer_core.ops.attention import PagedIndex, sparse_attention
from deepinfer_core.ops.cache import cache_write
from deepinfer_core.ops.kv_format import (
    FP8_MAX,
    SCALE_GROUP,
    Fp8KVPool,
    dequantize_fp8_rows,
    fp8_row_bytes,
    fp8_row_layout,
    quantize_fp8_rows,
)
from deepinfer_core.ops.modes import batch_invariant_mode
from tests.ops.sync_check import record_host_syncs


def _values(seed: int, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows whose scale groups span many magnitudes, with an all-zero group and outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g)
    x *= 10.0 ** torch.randint(-8, 5, (rows, 1), generator=g)  # per-row magnitude
    x[0, :SCALE_GROUP] = 0.0
    x[1, 3] = 1e4  # one outlier sets its group's scale
    return x.to(dtype)


def test_v4_flash_row_is_592_bytes_laid_out_as_flashmla():
    lay = fp8_row_layout(512, 64)
    assert fp8_row_bytes(512, 64) == lay.row_bytes == 592  # against 1024 in bfloat16
    assert (lay.nope, lay.rope_offset, lay.scale_offset, lay.groups) == (448, 448, 576, 7)
    # nope + rope + scales, padded to 16 bytes; the narrow tiny model row (32 = 24 nope + 8 rope)
    assert fp8_row_bytes(32, 8) == 48 and fp8_row_layout(32, 8).groups == 1
    assert fp8_row_layout(33, 8).rope_offset == 26  # bf16 rope values stay 2-byte aligned
    assert fp8_row_bytes(128, 0) == 128 + 16 and fp8_row_bytes(64, 64) == 128
    pool = Fp8KVPool.zeros(5, 512, 64)
    assert pool.data.shape == (5, 592) and pool.data.dtype == torch.uint8 and pool.shape == (5, 512)
    assert torch.equal(pool.dequantize(), torch.zeros(5, 512))
    with pytest.raises(ValueError, match="uint8"):
        Fp8KVPool(torch.zeros(5, 583, dtype=torch.uint8), 512, 64)


def test_packed_bytes_are_e4m3_nope_then_bf16_rope_then_ue8m0_scales():
    x = _values(0, 6, 512)
    packed = quantize_fp8_rows(x, 64)
    assert packed.shape == (6, 592) and packed.dtype == torch.uint8
    for r in range(6):
        for grp in range(7):
            chunk = x[r, grp * 64 : (grp + 1) * 64].double()
            amax = float(chunk.abs().max())
            e = -126 if amax == 0 else max(-126, math.ceil(math.log2(amax / FP8_MAX)))
            if amax > 0 and amax > FP8_MAX * 2.0**e:  # log2 rounded down at a boundary
                e += 1
            assert packed[r, 576 + grp] == e + 127 or amax == 0, (r, grp)
            want = (chunk * 2.0**-e).float().to(torch.float8_e4m3fn).view(torch.uint8)
            if amax > 0:
                assert torch.equal(packed[r, grp * 64 : (grp + 1) * 64], want), (r, grp)
        assert torch.equal(packed[r, 448:576].view(torch.bfloat16), x[r, 448:].bfloat16())
        assert packed[r, 583] == 0  # padding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_e4m3_precision_at_the_power_of_two_scale(dtype):
    d, r = 512, 64
    x = _values(1, 40, d, dtype)
    pool = Fp8KVPool.from_values(x, r)
    back = pool.dequantize()
    xf = x.float()
    # scales: the smallest power of two that brings the group's amax within e4m3's range
    scale = pool.scales().float()  # [N, 7]
    amax = xf[:, : d - r].view(40, 7, 64).abs().amax(-1)
    nonzero = amax > 0
    assert torch.all(amax <= FP8_MAX * scale)
    assert torch.all((amax > FP8_MAX * scale / 2)[nonzero])
    assert torch.all(scale == torch.exp2(torch.round(torch.log2(scale))))  # powers of two
    # nope: relative 2**-4 (3 mantissa bits), absolute half the subnormal step 2**-10 * scale
    s = scale.repeat_interleave(64, dim=1)
    err = (back[:, : d - r] - xf[:, : d - r]).abs()
    bound = torch.maximum(xf[:, : d - r].abs() * 2**-4, s * 2**-10)
    assert torch.all(err <= bound)
    assert torch.all(err <= amax.repeat_interleave(64, dim=1) / 16)  # the same, per group
    # rope: bfloat16
    assert torch.equal(back[:, d - r :], xf[:, d - r :].bfloat16().float())
    # dequantised values are fixed points (re-quantising them gives the same values back)
    assert torch.equal(Fp8KVPool.from_values(back, r).dequantize(), back)
    # in the model dtype: exact (an e4m3 value times a power of two fits bf16 and fp16 here)
    assert torch.equal(pool.dequantize(dtype).float(), back)


def test_boundary_amax_takes_the_smaller_scale_and_never_saturates_wrongly():
    x = torch.zeros(4, 128)
    x[0, 0] = 448.0  # exactly 448 * 2**0: scale 1, stored exactly
    x[1, 0] = 448.0 * (1 + 2**-20)  # just above: scale 2
    x[2, 0] = 2.0**-140  # far below the smallest scale: clamped exponent, value flushes to 0
    x[3, :64] = torch.linspace(-3, 3, 64)
    pool = Fp8KVPool.from_values(x, 64)
    s = pool.scales().float()[:, 0]
    assert s[0] == 1.0 and s[1] == 2.0 and s[2] == 2.0**-126
    back = pool.dequantize()
    assert back[0, 0] == 448.0 and back[1, 0] == 448.0 and back[2, 0] == 0.0
    assert torch.isfinite(back).all()


def test_dequantize_rows_gathers_any_index_shape():
    x = _values(2, 10, 40)
    pool = Fp8KVPool.from_values(x, 8)
    rows = torch.tensor([[3, 3, 0], [9, 1, 2]])
    got = pool.dequantize_rows(rows, torch.bfloat16)
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    assert torch.equal(got.float(), pool.dequantize()[rows])
    assert pool.dequantize_rows(torch.zeros(0, 5, dtype=torch.int64)).shape == (0, 5, 40)
    assert torch.equal(dequantize_fp8_rows(pool.data[rows], 40, 8), pool.dequantize()[rows])


def test_cache_write_quantises_only_the_given_rows_in_place():
    pool = Fp8KVPool.from_values(_values(3, 12, 512), 64)
    before = pool.data.clone()
    rows = torch.tensor([7, 0, 11])
    vals = _values(4, 3, 512, torch.bfloat16)
    with record_host_syncs() as syncs:
        out = cache_write(pool, rows, vals)
    assert not syncs, syncs
    assert out is pool
    assert torch.equal(pool.data[rows], quantize_fp8_rows(vals, 64))
    keep = torch.ones(12, dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(pool.data[keep], before[keep])


def attention_case(
    seed: int,
    ring: Callable[[torch.Tensor], Any],
    ckv: Callable[[torch.Tensor], Any],
    chunk: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    t: int = 7,
    h: int = 4,
    d: int = 32,
):
    """``sparse_attention`` arguments over a window ring of 20 rows, this step's ``t`` rows and
    12 paged entries: ``ring`` / ``ckv`` build the two pools from their values (packed, for
    the tests of a KV format), ``chunk`` maps this step's rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    pools = [ring(torch.randn(20, d, generator=g) * 2), chunk(torch.randn(t, d, generator=g))]
    pools.append(ckv(torch.randn(12, d, generator=g)))
    idx_ring = torch.randint(-1, 20, (t, 6), generator=g)
    idx_ring[:, 0] = torch.randint(0, 20, (t,), generator=g)
    idx_chunk = torch.randint(-1, t, (t, 3), generator=g)
    table = torch.randperm(3, generator=g).view(1, -1).repeat(2, 1)
    paged = PagedIndex(
        table, torch.randint(0, 2, (t,), generator=g), torch.randint(0, 13, (t,), generator=g), 4, 12
    )
    return q, pools, [idx_ring, idx_chunk, paged], torch.randn(h, generator=g), d**-0.5


def _attention_case(seed: int, t: int = 7):
    """FP8 ring and entry pools (rope_dim 8)."""

    def fp8(x: torch.Tensor) -> Fp8KVPool:
        return Fp8KVPool.from_values(x, 8)

    return attention_case(seed, fp8, fp8, t=t)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_reads_fp8_pools_as_their_dequantised_rows(invariant, dtype):
    q, pools, idx, sinks, scale = _attention_case(0)
    q = q.to(dtype)
    pools[1] = pools[1].to(dtype)
    plain = [p.dequantize(dtype) if isinstance(p, Fp8KVPool) else p for p in pools]
    with batch_invariant_mode(invariant):
        with record_host_syncs() as syncs:
            got = sparse_attention(q, pools, idx, sinks, scale)
        want = sparse_attention(q, plain, idx, sinks, scale)
    assert not syncs, syncs
    assert got.dtype == dtype and torch.equal(got, want)


def test_sparse_attention_with_fp8_pools_is_batch_invariant():
    q, pools, idx, sinks, scale = _attention_case(1, t=70)
    with batch_invariant_mode():
        full = sparse_attention(q, pools, idx, sinks, scale)
        for i in (0, 5, 69):
            rows = torch.tensor([i])
            alone_idx = [
                x.select(rows)
                if isinstance(x, PagedIndex)
                else torch.cat([x[i : i + 1], torch.full((1, 3), -1)], 1)
                for x in idx
            ]
            alone = sparse_attention(q[i : i + 1], pools, alone_idx, sinks, scale)
            assert torch.equal(alone, full[i : i + 1]), i
        for b in (1, 3, 17, 64, 65):
            sub = [x.select(torch.arange(b)) if isinstance(x, PagedIndex) else x[:b] for x in idx]
            assert torch.equal(sparse_attention(q[:b], pools, sub, sinks, scale), full[:b]), b


def test_quantise_and_dequantise_make_no_host_sync():
    x = _values(5, 9, 512)
    with record_host_syncs() as syncs:
        packed = quantize_fp8_rows(x, 64)
        dequantize_fp8_rows(packed, 512, 64)
    assert not syncs, syncs
