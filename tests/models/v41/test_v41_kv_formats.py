"""The block-scaled packed KV formats of DeepSeek-V4.1's release (``kv_cache_dtype="fp8"``):
byte layout and sizes, quantisation bit for bit ``kv_qdq``'s (random and adversarial values),
the ops that store and read the pools, and the cache allocator."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.models.cache_spec import HybridCache, PagedSpec, RingSpec, SlotStateSpec, spec_bytes
from deepinfer_core.models.deepseek_v41.ops import candidate_blocks, kv_qdq
from deepinfer_core.ops.attention import PagedIndex, indexer_topk, sparse_attention
from deepinfer_core.ops.cache import cache_write
from deepinfer_core.ops.kv_blockscaled import (
    BLOCK_FORMATS,
    BlockScaledKVPool,
    block_row_bytes,
    dequantize_block_rows,
    packs,
    quantize_block_rows,
)
from deepinfer_core.ops.kv_format import PackedKVPool
from deepinfer_core.ops.modes import batch_invariant_mode
from tests.ops.sync_check import record_host_syncs
from tests.ops.test_kv_format import attention_case

FORMATS = sorted(BLOCK_FORMATS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bit patterns (so ``-0.0`` differs from ``0.0``)."""
    return x.contiguous().view(_INT_VIEW[x.dtype])


def _assert_round_trip_is_kv_qdq(x: torch.Tensor, fmt: str) -> None:
    """Packing ``x`` and dequantising gives bit for bit ``kv_qdq(x)`` (in ``x``'s dtype)."""
    block = BLOCK_FORMATS[fmt].block
    want = kv_qdq(x, fmt, block)
    got = BlockScaledKVPool.from_values(x, fmt).dequantize(x.dtype)
    assert torch.equal(_bits(got), _bits(want)), (fmt, x.dtype, int((_bits(got) != _bits(want)).sum()))


def _random(seed: int, rows: int, dim: int, block: int) -> torch.Tensor:
    """Rows whose blocks span magnitudes from 1e-30 to 1e20, with zero and outlier blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = dim // block
    x = torch.randn(rows, nb, block, generator=g)
    x = (x * 10.0 ** torch.randint(-30, 21, (rows, nb, 1), generator=g).float()).view(rows, dim)
    x[0, :block] = 0.0
    x[1, 3] = 1e4 * x[1, :block].abs().max()  # one outlier sets its block's scale
    return x


def _ties(fmt: str, dim: int) -> torch.Tensor:
    """Rows whose values, divided by their block's scale, are exactly the midpoints the element
    rounding must break toward the even code (and ``±0``, and values rounding to ``-0``)."""
    block = BLOCK_FORMATS[fmt].block
    if fmt == "fp8_ue8m0":  # e4m3 midpoints: normal and subnormal, ties to the even mantissa
        ties = [1.0625, 1.1875, 17.0, 19.0, 0.5 * 2**-9, 1.5 * 2**-9, 2.5 * 2**-9, 7.5 * 2**-9, 232.0, 440.0]
        top, scales = 300.0, [2.0**-20, 2.0**-3, 1.0, 2.0**40]  # amax 300 s: the block's scale is s
    else:  # e2m1 midpoints (0.25 and 5 go down, 0.75 / 1.75 / 3.5 up), below the smallest step
        ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.1, 5.5]
        if fmt == "fp4_ue8m0":
            top, scales = 5.9, [2.0**-100, 2.0**-6, 1.0, 2.0**60]  # amax 5.9 s: scale s
        else:
            top, scales = 6.0, [1.0, 0.875, 2.0**-6, 448.0]  # amax 6 s: scale e4m3(s) = s
    rows = []
    for s in scales:
        for sign in (1.0, -1.0):
            vals = [top] + [sign * t for t in ties] + [-0.0, 0.0, -1e-3 * 2**-9]
            vals = (vals * block)[:block]
            rows.append(torch.tensor(vals * (dim // block)) * s)
    return torch.stack(rows)


def test_release_row_widths_are_528_288_and_68_bytes():
    assert block_row_bytes("fp8_ue8m0", 512) == 512 + 16 == 528  # window records
    assert block_row_bytes("fp4_e4m3", 512) == 256 + 32 == 288  # compressed entries
    assert block_row_bytes("fp4_ue8m0", 128) == 64 + 4 == 68  # indexer keys
    pool = BlockScaledKVPool.zeros(5, 512, "fp4_e4m3")
    assert isinstance(pool, PackedKVPool)
    assert pool.data.shape == (5, 288) and pool.data.dtype == torch.uint8 and pool.shape == (5, 512)
    assert pool.nbytes == 5 * 288 and pool.row_bytes == 288 and pool.block == 16
    assert torch.equal(pool.dequantize(), torch.zeros(5, 512))
    assert not packs("fp8_ue8m0", 24) and not packs("fp4_e4m3", 24) and packs("fp4_e4m3", 32)
    with pytest.raises(ValueError, match="not a whole number of 32-value blocks"):
        block_row_bytes("fp8_ue8m0", 48)
    with pytest.raises(ValueError, match="uint8"):
        BlockScaledKVPool(torch.zeros(5, 287, dtype=torch.uint8), 512, "fp4_e4m3")
    with pytest.raises(ValueError, match="unknown block-scaled KV format"):
        BlockScaledKVPool.zeros(5, 512, "fp6")


def test_bytes_are_elements_then_one_scale_byte_per_block():
    """A row of 64 values in each format: the element bytes (e4m3, or e2m1 codes with the even
    value in the low nibble), then the scale bytes (UE8M0 exponent + 127, or the e4m3 scale)."""
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, -0.5, 1.0  # block 0 (of 32): amax 3
    x[0, 40] = 1.0  # the second 32-block (and the third 16-block)
    fp8 = quantize_block_rows(x, "fp8_ue8m0")[0]
    # 2**ceil(log2(3/448)) = 2**-7; 3 / 2**-7 = 384 = e4m3 0x7C; block 1: 2**-8, 1 / 2**-8 = 256 = 0x78
    assert fp8.shape == (66,) and fp8[0] == 0x7C and fp8[64] == 127 - 7 and fp8[65] == 127 - 8
    assert fp8[1] == 0xE8  # -0.5 / 2**-7 = -64 = e4m3 0xE8 (sign, exponent 6 + 7)
    mx = quantize_block_rows(x, "fp4_ue8m0")[0]
    # 2**ceil(log2(3/6)) = 2**-1: 3 -> 6 (code 7), -0.5 -> -1 (code 8|2), 1 -> 2 (code 4)
    assert (
        mx.shape == (34,)
        and mx[0] == 0x7 | (0xA << 4)
        and mx[1] == 0x4
        and mx[32:].tolist() == [126, 127 - 2]
    )
    nv = quantize_block_rows(x, "fp4_e4m3")[0]
    # e4m3(3/6) = 0.5 (0x30): the same codes; e4m3(1/6) = 1.375 * 2**-3 (0x23); blocks 1 and 3
    # are zero: the clamped scale e4m3(2**-9) = 0x01
    assert nv.shape == (36,) and nv[0] == mx[0] and nv[32:].tolist() == [0x30, 0x01, 0x23, 0x01]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_rows_dequantise_to_kv_qdq_bitwise(fmt, dtype):
    block = BLOCK_FORMATS[fmt].block
    x = _random(0, 64, 8 * block, block)
    if dtype != torch.float32:  # keep the model dtype's finite range
        x = x.clamp(-1e4, 1e4)
    _assert_round_trip_is_kv_qdq(x.to(dtype), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_adversarial_rows_dequantise_to_kv_qdq_bitwise(fmt):
    """Exact rounding ties, ``±0``, all-zero blocks, magnitudes at and beyond the clamps (tiny,
    fp32 subnormal, huge: an ``fp4_e4m3`` scale past e4m3's range), a lone outlier per block,
    scales whose rounding depends on the exact fp32 arithmetic of ``kv_qdq``."""
    block = BLOCK_FORMATS[fmt].block
    dim = 4 * block
    _assert_round_trip_is_kv_qdq(_ties(fmt, dim), fmt)
    special = torch.zeros(12, dim)
    special[1] = -0.0
    special[2, ::3] = 1e-45  # fp32 subnormals
    special[3] = torch.linspace(-1e-38, 1e-38, dim)
    special[4] = torch.linspace(-3e38, 3e38, dim)  # a huge amax
    special[5] = torch.linspace(-2688.0, 2688.0, dim)  # fp4_e4m3: scale 448, the largest e4m3
    special[6] = torch.linspace(-5000.0, 5000.0, dim)  # past it
    special[7, 0] = 1e-4 * 0.999  # below fp8_ue8m0's amax clamp
    special[8, 0] = 9 * 2.0**-9  # fp4_e4m3: an e4m3 subnormal scale rounded up (see below)
    special[9] = -special[8]
    # fp4_e4m3: amax / 6 one fp32 step below an e4m3 midpoint (amax * fp32(1/6) would reach it)
    special[10, 0], special[11, 0] = 1.7812498807907104, -0.1113281175494194
    _assert_round_trip_is_kv_qdq(special, fmt)


def test_a_second_fp4_e4m3_quantisation_is_not_a_no_op():
    """Why the model hands a packed pool unquantised values: ``kv_qdq`` twice differs from once
    for an ``fp4_e4m3`` block whose e4m3 scale rounds up (amax 9 * 2**-9: scale 2**-8, the
    amax stored as 4 * 2**-8, re-scaled by 2**-9 and clamped to 6 * 2**-9); the FP8 and MXFP4
    formats are idempotent."""
    x = torch.zeros(1, 16)
    x[0, 0] = 9 * 2.0**-9
    once = kv_qdq(x, "fp4_e4m3", 16)
    assert once[0, 0] == 2.0**-6 and kv_qdq(once, "fp4_e4m3", 16)[0, 0] == 6 * 2.0**-9
    assert torch.equal(BlockScaledKVPool.from_values(x, "fp4_e4m3").dequantize(), once)
    for fmt in ("fp8_ue8m0", "fp4_ue8m0"):
        y = kv_qdq(_random(1, 32, 128, 32), fmt, 32)
        assert torch.equal(kv_qdq(y, fmt, 32), y)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_write_packs_only_the_given_rows_without_host_syncs(fmt):
    block = BLOCK_FORMATS[fmt].block
    pool = BlockScaledKVPool.from_values(_random(2, 12, 4 * block, block), fmt)
    before = pool.data.clone()
    rows = torch.tensor([7, 0, 11])
    vals = _random(3, 3, 4 * block, block).to(torch.bfloat16)
    with record_host_syncs() as syncs:
        out = cache_write(pool, rows, vals)
        got = pool.dequantize_rows(rows.view(3, 1), torch.bfloat16)
    assert not syncs, syncs
    assert out is pool
    assert torch.equal(pool.data[rows], quantize_block_rows(vals, fmt))
    assert torch.equal(got.view(3, -1), kv_qdq(vals, fmt, block))
    keep = torch.ones(12, dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(pool.data[keep], before[keep])
    assert torch.equal(dequantize_block_rows(pool.data[rows], fmt, 4 * block), pool.dequantize()[rows])
    with pytest.raises(ValueError, match="channels"):
        pool.quantize(torch.zeros(2, 8 * block))


def _attention_case(seed: int):
    """The release's formats: an ``fp8_ue8m0`` ring, ``fp4_e4m3`` entries, this step's rows
    quantise-dequantised as the window records are."""
    return attention_case(
        seed,
        lambda x: BlockScaledKVPool.from_values(x, "fp8_ue8m0"),
        lambda x: BlockScaledKVPool.from_values(x, "fp4_e4m3"),
        lambda x: kv_qdq(x, "fp8_ue8m0", 32),
        t=9,
        d=64,
    )


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sparse_attention_reads_block_scaled_pools_as_their_dequantised_rows(invariant, dtype):
    q, pools, idx, sinks, scale = _attention_case(0)
    q, pools[1] = q.to(dtype), pools[1].to(dtype)
    plain = [p.dequantize(dtype) if isinstance(p, PackedKVPool) else p for p in pools]
    with batch_invariant_mode(invariant), record_host_syncs() as syncs:
        got = sparse_attention(q, pools, idx, sinks, scale)
    assert not syncs, syncs
    with batch_invariant_mode(invariant):
        want = sparse_attention(q, plain, idx, sinks, scale)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("invariant", [False, True])
def test_indexer_and_candidate_blocks_read_mxfp4_keys_as_their_dequantised_rows(invariant):
    g = torch.Generator().manual_seed(4)
    t, h, d, n = 6, 4, 64, 24
    q, w = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g)
    keys = BlockScaledKVPool.from_values(torch.randn(n, d, generator=g), "fp4_ue8m0")
    plain = keys.dequantize()
    table = torch.randperm(6, generator=g).view(1, -1)
    entries = PagedIndex(
        table, torch.zeros(t, dtype=torch.int64), torch.randint(1, n + 1, (t,), generator=g), 4, n
    )
    with batch_invariant_mode(invariant), record_host_syncs() as syncs:
        picks = indexer_topk(q, w, keys, entries, 5, d**-0.5)
        blocks = candidate_blocks(q, w, keys, entries, 2, 4, d**-0.5)
    assert not syncs, syncs
    with batch_invariant_mode(invariant):
        assert torch.equal(picks, indexer_topk(q, w, plain, entries, 5, d**-0.5))
        assert torch.equal(blocks, candidate_blocks(q, w, plain, entries, 2, 4, d**-0.5))


def test_the_allocator_holds_block_scaled_pools_and_counts_their_bytes():
    specs = [
        [
            RingSpec("window", 8, 64, kv_format="fp8_ue8m0", spare=2),
            PagedSpec("ckv", 2, 64, kv_format="fp4_e4m3"),
            PagedSpec("ikv", 2, 32, kv_format="fp4_ue8m0"),
            SlotStateSpec("buf", (4, 64)),
        ],
        [PagedSpec("ckv", 2, 64, alias_of=(0, "ckv"), kv_format="fp4_e4m3")],
    ]
    dt = torch.float32
    assert spec_bytes(specs[0][0], 16, dt) == (0, 10 * 66)
    assert spec_bytes(specs[0][1], 16, dt) == (8 * 36, 0)
    assert spec_bytes(specs[0][2], 16, dt) == (8 * 17, 0)
    assert spec_bytes(specs[1][0], 16, dt) == (0, 0)
    cache = HybridCache(specs, num_pages=3, page_size=16, num_slots=2, dtype=dt)
    ring, ckv, ikv = (cache.get(0, n) for n in ("window", "ckv", "ikv"))
    assert isinstance(ring, BlockScaledKVPool) and ring.fmt == "fp8_ue8m0" and ring.shape == (3 * 10, 64)
    assert isinstance(ckv, BlockScaledKVPool) and ckv.shape == (4 * 8, 64) and cache.get(1, "ckv") is ckv
    assert isinstance(ikv, BlockScaledKVPool) and ikv.data.shape == (4 * 8, 17)
    assert cache.nbytes == 30 * 66 + 32 * 36 + 32 * 17 + 3 * 4 * 64 * 4
    with pytest.raises(ValueError, match="'ckv'.*not a whole number of 16-value blocks"):
        spec_bytes(PagedSpec("ckv", 2, 24, kv_format="fp4_e4m3"), 16, dt)
    with pytest.raises(ValueError, match="unknown kv_format"):
        spec_bytes(PagedSpec("ckv", 2, 24, kv_format="fp6"), 16, dt)  # type: ignore[arg-type]
