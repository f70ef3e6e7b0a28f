"""The per-tile FP8 KV format (``fp8_tile128``, the rows Ascend's quantised sparse attention
operator reads): layout, quantisation against a float64 oracle, error bounds, the ops that take
it (``cache_write``, ``sparse_attention``), and the format registry backends name it through."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_core.backends import BackendSpec
from deepinfer_core.errors import PluginError
from deepinfer_core.models.cache_spec import HybridCache, PagedSpec, RingSpec, spec_bytes, with_kv_formats
from deepinfer_core.ops.attention import PagedIndex, sparse_attention
from deepinfer_core.ops.cache import cache_write
from deepinfer_core.ops.kv_blockscaled import BlockScaledKVPool
from deepinfer_core.ops.kv_format import FP8_MAX, Fp8KVPool
from deepinfer_core.ops.kv_registry import PACKED_KV_FORMATS, check_substitutes
from deepinfer_core.ops.kv_tile import (
    TILE,
    TileFp8KVPool,
    dequantize_tile_rows,
    quantize_tile_rows,
    tile_row_bytes,
    tile_row_layout,
)
from tests.ops.sync_check import record_host_syncs


def _values(seed: int, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows whose tiles span many magnitudes, with an all-zero tile and an outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g)
    x *= 10.0 ** torch.randint(-8, 5, (rows, 1), generator=g)
    x[0, :TILE] = 0.0
    x[1, 3] = 1e4
    return x.to(dtype)


def test_512_wide_row_is_the_operators_656_bytes():
    lay = tile_row_layout(512)
    assert tile_row_bytes(512) == lay.row_bytes == 656 == 512 + 64 * 2 + 4 * 4
    assert (lay.padded, lay.rope_offset, lay.scale_offset, lay.tiles) == (512, 512, 640, 4)
    assert tile_row_bytes(32) == 128 + 128 + 4 and tile_row_bytes(129) == 256 + 128 + 8
    pool = TileFp8KVPool.zeros(5, 512)
    assert pool.data.shape == (5, 656) and pool.shape == (5, 512)
    assert torch.equal(pool.dequantize(), torch.zeros(5, 512))
    with pytest.raises(ValueError, match=r"uint8 \[N, 656\]"):
        TileFp8KVPool(torch.zeros(5, 592, dtype=torch.uint8), 512)


def test_bytes_are_e4m3_values_then_a_zero_rope_operand_then_float32_power_of_two_scales():
    x = _values(0, 6, 500)  # a partial last tile: zero padded
    packed = quantize_tile_rows(x)
    assert packed.shape == (6, 656)
    xp = torch.cat([x, torch.zeros(6, 12)], dim=1).double()
    for r in range(6):
        scales = packed[r, 640:].contiguous().view(torch.float32)
        for t in range(4):
            chunk = xp[r, t * TILE : (t + 1) * TILE]
            amax = float(chunk.abs().max())
            e = -9 if amax == 0 else max(-126, math.ceil(math.log2(amax / FP8_MAX)))  # zero: 2**-9
            if amax > FP8_MAX * 2.0**e:  # log2 rounded down at a boundary
                e += 1
            assert float(scales[t]) == 2.0**e, (r, t)
            want = (chunk * 2.0**-e).float().to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(packed[r, t * TILE : (t + 1) * TILE], want), (r, t)
        assert not packed[r, 500:640].any()  # padding values and the rope operand are zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_e4m3_precision_at_the_tile_scale(dtype):
    x = _values(1, 40, 512, dtype)
    pool = TileFp8KVPool.from_values(x)
    back, xf = pool.dequantize(), x.float()
    scale = pool.scales()
    amax = xf.view(40, 4, TILE).abs().amax(-1)
    assert torch.all(amax <= FP8_MAX * scale)
    assert torch.all((amax > FP8_MAX * scale / 2)[amax > 0])
    s = scale.repeat_interleave(TILE, dim=1)
    assert torch.all((back - xf).abs() <= torch.maximum(xf.abs() * 2**-4, s * 2**-10))
    assert torch.equal(TileFp8KVPool.from_values(back).dequantize(), back)  # fixed points
    assert torch.equal(pool.dequantize(dtype).float(), back)  # exact in the model dtype


def test_dequantize_rows_and_cache_write_use_only_the_given_rows_without_host_sync():
    pool = TileFp8KVPool.from_values(_values(2, 12, 40))
    rows = torch.tensor([[3, 3, 0], [9, 1, 2]])
    got = pool.dequantize_rows(rows, torch.bfloat16)
    assert got.shape == (2, 3, 40) and torch.equal(got.float(), pool.dequantize()[rows])
    assert torch.equal(dequantize_tile_rows(pool.data[rows], 40), pool.dequantize()[rows])
    before = pool.data.clone()
    dest, vals = torch.tensor([7, 0, 11]), _values(3, 3, 40, torch.bfloat16)
    with record_host_syncs() as syncs:
        assert cache_write(pool, dest, vals) is pool
    assert not syncs, syncs
    assert torch.equal(pool.data[dest], quantize_tile_rows(vals))
    keep = torch.ones(12, dtype=torch.bool)
    keep[dest] = False
    assert torch.equal(pool.data[keep], before[keep])


def test_sparse_attention_reads_tile_pools_as_their_dequantised_rows():
    g = torch.Generator().manual_seed(4)
    t, h, d = 5, 4, 256
    ring = TileFp8KVPool.from_values(torch.randn(20, d, generator=g))
    ckv = TileFp8KVPool.from_values(torch.randn(12, d, generator=g) * 3)
    chunk = torch.randn(7, d, generator=g).bfloat16()
    idx = [torch.randint(-1, 20, (t, 6), generator=g), torch.randint(-1, 7, (t, 3), generator=g)]
    paged = PagedIndex(
        torch.tensor([[2, 0, 1]]), torch.zeros(t, dtype=torch.int64), torch.tensor([3, 12, 0, 7, 9]), 4, 12
    )
    q, sinks = torch.randn(t, h, d, generator=g).bfloat16(), torch.randn(h, generator=g)
    got = sparse_attention(q, [ring, chunk, ckv], [*idx, paged], sinks, d**-0.5)
    plain = [ring.dequantize(torch.bfloat16), chunk, ckv.dequantize(torch.bfloat16)]
    assert torch.equal(got, sparse_attention(q, plain, [*idx, paged], sinks, d**-0.5))


def test_empty_rows_makes_a_pool_of_any_format_that_cache_write_fills():
    from deepinfer_core.ops.cache import cache_write

    for pool in (
        Fp8KVPool.from_values(torch.randn(3, 40), 8),
        TileFp8KVPool.from_values(torch.randn(3, 40)),
        BlockScaledKVPool.from_values(torch.randn(3, 64), "fp4_e4m3"),
    ):
        fresh = pool.empty_rows(5)
        assert type(fresh) is type(pool) and fresh.shape == (5, pool.dim)
        assert fresh.row_bytes == pool.row_bytes and fresh.data.device == pool.data.device
        values = torch.randn(5, pool.dim)
        cache_write(fresh, torch.arange(5), values)  # every byte written: the rows are the values'
        assert torch.equal(fresh.data, pool.quantize(values))


def test_a_backends_substitute_reaches_the_cache_specs_and_the_cache():
    specs = [[RingSpec("window", 4, 512, kv_format="fp8", rope_dim=64), PagedSpec("ikv", 4, 128)]]
    moved = with_kv_formats(specs, {"fp8": "fp8_tile128"})
    assert moved[0][0].kv_format == "fp8_tile128" and moved[0][1] == specs[0][1]
    assert with_kv_formats(specs, {}) is specs
    assert spec_bytes(moved[0][0], 64, torch.bfloat16) == (0, 4 * 656)
    cache = HybridCache(moved, num_pages=2, page_size=64, num_slots=2, dtype=torch.bfloat16)
    ring = cache.get(0, "window")
    assert isinstance(ring, TileFp8KVPool) and ring.shape == (3 * 4, 512)
    assert sorted(PACKED_KV_FORMATS) == ["fp4_e4m3", "fp4_ue8m0", "fp8", "fp8_tile128", "fp8_ue8m0"]


def test_backend_kv_formats_are_validated_in_one_line():
    assert BackendSpec("b", "cpu", kv_formats={"fp8": "fp8_tile128"}).kv_formats == {"fp8": "fp8_tile128"}
    assert check_substitutes({}) is None
    for bad, msg in (
        ({"fp8": "fp9"}, "unknown kv_format 'fp9'"),
        ({"plain": "fp8"}, "unknown kv_format 'plain'"),
        ({"fp8": "fp8"}, "maps 'fp8' to itself"),
        (["fp8"], "must be a mapping"),
    ):
        with pytest.raises(PluginError, match=msg) as err:
            BackendSpec("b", "cpu", kv_formats=bad)
        assert "\n" not in str(err.value)
