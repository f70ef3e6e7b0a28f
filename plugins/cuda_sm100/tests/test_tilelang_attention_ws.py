"""The warp-specialised ("seesaw") TileLang attention kernel (``tl/sparse_attention_ws.py``):
what it takes, that precompile and the dispatcher know it, its lowering (where TileLang
imports), and on a GPU its result against the reference op and under CUDA-graph replay."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
from cuda_sm100_checks import loops_containing, lowered_sm90, replayed
from deepinfer_cuda_sm100.attention_dispatch import available_languages
from deepinfer_cuda_sm100.tl import sparse_attention as tla
from deepinfer_cuda_sm100.tl import sparse_attention_ws as tlw
from deepinfer_cuda_sm100.tl import tilelang_problem

from deepinfer_core.ops.kv_format import Fp8KVPool


def _pools(packed: bool, rope_dim: int = 64):
    rows = [torch.randn(8, 512).to(torch.bfloat16) for _ in range(3)]
    return [Fp8KVPool.from_values(r, rope_dim) for r in rows] if packed else rows


def test_it_takes_plain_and_v4_packed_pools_and_names_what_it_refuses():
    q = torch.randn(2, 64, 512).to(torch.bfloat16)
    assert tlw.supports(q, _pools(False)) is True
    assert tlw.supports(q, _pools(True)) is True  # V4: 448 nope bytes, 64 bf16 rope values
    reason = tlw.supports(q, _pools(True, rope_dim=16))  # 496 nope bytes: 62 words, not 4k
    assert isinstance(reason, str) and "FP8 row geometry" in reason


def test_the_dispatcher_offers_it_for_the_pools_it_takes():
    q = torch.randn(2, 64, 512).to(torch.bfloat16)
    assert available_languages(q, _pools(False)) == {"triton", "tilelang", "tilelang_ws"}
    assert available_languages(q, _pools(True)) == {"triton", "tilelang", "tilelang_ws"}
    assert available_languages(q, _pools(True, rope_dim=16)) == {"triton", "tilelang"}


def _fp8_geometry(rope_dim: int = 64):
    return tla.fp8_geometry(_pools(True, rope_dim))


def test_precompile_covers_every_configuration_a_call_makes():
    from deepinfer_cuda_sm100.tl import precompile

    a = precompile.parse_args(["--gemm-shapes", "4096x1024", "--grouped-shapes", ""])
    jobs = {c for module, c in precompile.jobs(a) if module == "sparse_attention_ws"}
    pdl = precompile.tl_pdl_enabled()
    assert jobs == {
        (paged, split, 64, 512, "bfloat16", fp8, pdl)
        for paged in (False, True)
        for split in (False, True)
        for fp8 in (None, _fp8_geometry())
    }


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_it_lowers_to_a_producer_and_two_independent_consumers(paged, split, packed):
    """Lowered for sm_90: the producer drops to its register share and the consumers rise to
    theirs, each consumer runs its own ``64 x 32`` logits GEMM and ``64 x 256`` value GEMMs
    (no reduction across warpgroups), and no loop waits at a block barrier.  Packed: the
    producer dequantises every word it fetches (14 nope and 4 rope words a thread, each 8
    bytes of a row) and fences its stores before it marks a slot full."""
    fp8 = _fp8_geometry() if packed else None
    src = lowered_sm90(tlw.build_attention_ws(paged, split, 64, 512, "bfloat16", fp8), tlw.pass_configs(fp8))
    producer, consumer = tlw.registers(fp8)
    assert producer + 2 * consumer <= 3 * (65536 // tlw.THREADS // 8 * 8)  # the registers launched with
    assert f"warpgroup_reg_dealloc<{producer}>" in src
    assert src.count(f"warpgroup_reg_alloc<{consumer}>") == 2
    assert f"64, {tlw.BNW}, 16" in src and "64, 256, 16" in src
    assert "AllReduce<tl::MaxOp, 256" not in src and "AllReduce<tl::SumOp, 256" not in src
    assert all("__syncthreads" not in body for body in loops_containing(src, "wgmma_ss<"))
    gather = "deepinfer_e4m3x8_store(" if packed else "cp_async_gs"
    assert loops_containing(src, gather)
    assert all("__syncthreads" not in body for body in loops_containing(src, gather))
    if packed:  # the loop's two blocks: 14 conversions and 4 rope stores each, then the fence
        (body,) = set(loops_containing(src, gather))
        assert body.count("deepinfer_e4m3x8_store(") == 28 and body.count("deepinfer_store8(") == 8
        assert body.count("fence_proxy_async") == 2


def test_schedule_variants_cover_each_option_and_fit_the_registers():
    """``variants`` offers the default first and each option where it applies (the producer's
    options on packed pools only), each within the CTA's registers."""
    plain, packed = tlw.variants(False), tlw.variants(True)
    assert plain[0] == packed[0] == tlw.DEFAULT and len(set(packed)) == len(packed)
    assert {s.lazy_rescale for s in plain} == {False, True} == {s.lazy_rescale for s in packed}
    assert {s.staged_store for s in plain} == {False, True} == {s.staged_store for s in packed}
    assert {s.prefetch(False) for s in plain} == {0, 1, 2} and {s.prefetch(True) for s in packed} == {0, 1, 2}
    assert tlw.DEFAULT.prefetch(False) == 0 and tlw.DEFAULT.prefetch(True) == 1  # measured on packed pools
    assert {s.next_queries for s in plain} == {False, True} == {s.next_queries for s in packed}
    assert all(s.words_in_flight == tlw.DEFAULT.words_in_flight and not s.one_multiply for s in plain)
    assert {s.words_in_flight for s in packed} == {1, 2} and {s.one_multiply for s in packed} == {False, True}
    assert {s.vector_words for s in packed} == {False, True} and not any(s.vector_words for s in plain)
    for schedule in packed:
        producer, consumer = tlw.registers(_fp8_geometry(), schedule)
        assert producer + 2 * consumer <= 3 * (65536 // tlw.THREADS // 8 * 8)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("index", range(1, len(tlw.variants(True))))
def test_each_schedule_variant_lowers_to_what_it_names(index):
    """Lowered for sm_90 (paged, split-KV, packed): the variant's registers, the fused
    dequantisation where it multiplies once, the consumers' rescale behind a flag where it is
    lazy, and still no block barrier in a loop."""
    schedule, fp8 = tlw.variants(True)[index], _fp8_geometry()
    src = lowered_sm90(
        tlw.build_attention_ws(True, True, 64, 512, "bfloat16", fp8, schedule=schedule), tlw.pass_configs(fp8)
    )
    producer, consumer = tlw.registers(fp8, schedule)
    assert f"warpgroup_reg_dealloc<{producer}>" in src and src.count(f"warpgroup_reg_alloc<{consumer}>") == 2
    assert ("deepinfer_e4m3x8_store_fused((" in src) == schedule.one_multiply
    assert (src.count("if (grew") == 2) == schedule.lazy_rescale
    for needle in ("wgmma_ss<", "deepinfer_e4m3x8_store"):
        assert all("__syncthreads" not in body for body in loops_containing(src, needle))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("packed", [False, True])
def test_the_staged_store_writes_rows_in_16_byte_segments_behind_warpgroup_barriers(packed):
    """Lowered for sm_90 (direct, paged): with ``staged_store`` (the default) each consumer
    writes its half of the output into shared memory and out in 16-byte stores (16 a thread,
    against 64 4-byte ones from registers), ordered by a barrier of its own 128 threads; the
    block barrier stays the single one after the mbarriers' set-up (a block barrier here would
    wait for the exited producer)."""
    fp8 = _fp8_geometry() if packed else None

    def lowered(schedule):
        func = tlw.build_attention_ws(True, False, 64, 512, "bfloat16", fp8, schedule=schedule)
        return lowered_sm90(func, tlw.pass_configs(fp8))

    assert tlw.DEFAULT.staged_store
    direct, staged = lowered(tlw.Schedule(staged_store=False)), lowered(tlw.DEFAULT)
    assert "*(uint4*)(out + " not in direct and direct.count("*(uint1*)(out + ") == 2
    assert staged.count("*(uint4*)(out + ") == 2 * 16 and "*(uint1*)(out + " not in staged
    assert staged.count("__syncthreads") == direct.count("__syncthreads") == 1
    first = staged.index("warpgroup_reg_alloc")
    second = staged.index("warpgroup_reg_alloc", first + 1)
    for consumer in (staged[first:second], staged[second:]):  # its stores, after its own barrier
        before = consumer[: consumer.index("*(uint4*)(out + ")]
        assert consumer.count("*(uint4*)(out + ") == 16
        assert re.search(r"__sync_thread_partial\(\d+, 128\);\s*$", before)


@pytest.mark.parametrize("tokens", [1, 8, 16, 32, 63, 64, 100, 128, 131, 132, 500])
@pytest.mark.parametrize("keys", [128, 288, 383, 384, 640, 768, 8192])
def test_the_plan_caps_the_ctas_and_splits_short_lists_less(tokens, keys):
    """The seesaw kernel's plan: the other kernel's, capped at :data:`SPLIT_CTAS` CTAs (64 on
    plain pools, 128 on packed ones; one split from there on); from 16 CTAs on, key lists
    shorter than :data:`FEW_KEYS` run unsplit on plain pools and to 64 CTAs on packed ones.
    At V4-Flash's 64 heads and 768 keys: the measured 4 / 2 / 1 splits (plain) and 6 / 4 / 2
    (packed) at 16 / 32 / 64 tokens; at 288 keys 1 / 1 / 1 and 4 / 2 / 1."""
    for heads in (64, 128):  # one CTA a token and head block of 64
        other = tla.plan_splits(tokens, heads, keys, 132)
        ctas = tokens * heads // 64
        few = keys < tlw.FEW_KEYS and ctas >= 16
        for packed, cap in ((False, 64), (True, 128)):
            got = tlw.plan_splits(tokens, heads, keys, 132, packed=packed)
            if few:
                cap = 0 if not packed else 64
            assert got == max(1, min(other, cap // ctas)), (packed, heads)
            assert got * ctas <= max(cap, ctas) and 1 <= got <= other
    assert [tlw.plan_splits(t, 64, 768, 132) for t in (16, 32, 64)] == [4, 2, 1]
    assert [tlw.plan_splits(t, 64, 768, 132, packed=True) for t in (16, 32, 64)] == [6, 4, 2]
    assert [tlw.plan_splits(t, 64, 288, 132) for t in (16, 32, 64)] == [1, 1, 1]
    assert [tlw.plan_splits(t, 64, 288, 132, packed=True) for t in (16, 32, 64)] == [4, 2, 1]


def _fake_call(monkeypatch, tokens: int, packed: bool = False):
    """A call of ``tokens`` queries (640 keys each) on CPU tensors whose compiled kernels only
    record their launches: ``(call, launches, combines)``, a launch as ``(config, args)``."""
    launches, combines = [], []

    def compiled(*config, **options):
        if config[0] == "combine":
            return lambda *args: combines.append(args)
        return lambda *args: launches.append((config + tuple(options.values()), args))

    monkeypatch.setattr(tla, "_kernel", compiled)
    monkeypatch.setattr(tlw, "_kernel", compiled)
    monkeypatch.setattr(tla, "num_sms", lambda device: 132)
    nvalid = torch.full((tokens, 4), 7, dtype=torch.int32)
    compact = torch.zeros(tokens, 640, dtype=torch.int32)
    monkeypatch.setattr(tla, "compact_sources", lambda indices: (nvalid, compact))
    q = torch.randn(tokens, 64, 512).to(torch.bfloat16)
    indices = [torch.zeros(tokens, 128, dtype=torch.int64), torch.zeros(tokens, 512, dtype=torch.int64)]
    return (q, _pools(packed), indices, torch.zeros(64), 0.1), launches, combines


def test_vector_words_take_packed_rows_on_16_bytes_and_refuse_others(monkeypatch):
    """``vector_words`` launches on packed pools whose rows start on 16 bytes (every
    :class:`Fp8KVPool` row: 592 bytes at V4-Flash's widths) and refuses, naming the rows, a pool
    whose rows do not (a view one 8-byte word in)."""
    call, launches, _ = _fake_call(monkeypatch, 64, True)
    schedule = tlw.Schedule(vector_words=True)
    tlw.sparse_attention(*call, schedule=schedule)
    assert launches[-1][0][-1] == schedule
    q, pools, indices, sinks, scale = call
    shifted = Fp8KVPool(torch.zeros(9, 600, dtype=torch.uint8)[:, 8:], 512, 64)
    with pytest.raises(ValueError, match="start on 16 bytes"):
        tlw.sparse_attention(q, [shifted, *pools[1:]], indices, sinks, scale, schedule=schedule)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
def test_vector_words_fetch_a_rows_words_in_16_byte_loads():
    """Lowered for sm_90 (packed, paged, split): with ``vector_words`` the producer's word
    loads of a row are nine 16-byte loads a block of words (chunks ``4k + quarter``, two words
    each) and the scales' word, where the default has 18 8-byte word loads; each block's
    conversion is the same 28 nope stores a thread-pair of words and 2 16-byte rope stores."""
    fp8 = _fp8_geometry()
    build = functools.partial(tlw.build_attention_ws, True, True, 64, 512, "bfloat16", fp8, True)
    src = lowered_sm90(build(tlw.Schedule(vector_words=True)), tlw.pass_configs(fp8))
    (body,) = set(loops_containing(src, "deepinfer_e4m3x8_store(("))
    assert body.count("deepinfer_load16(") == 2 * 9 and "deepinfer_store8(" not in body
    assert body.count("deepinfer_e4m3x8_store(") == 28 and body.count("deepinfer_store16(") == 4
    default = lowered_sm90(build(tlw.DEFAULT), tlw.pass_configs(fp8))
    assert "deepinfer_load16(" not in default.split("__global__")[-1]
    with pytest.raises(ValueError, match="64-byte multiples"):
        tlw.build_attention_ws(True, True, 64, 512, "bfloat16", tla.Fp8Geometry(480, 480, 544, 8), True,
                               tlw.Schedule(vector_words=True))  # fmt: skip


@pytest.mark.parametrize("packed", [False, True])
def test_a_64_token_call_launches_as_its_kernels_plan_says(monkeypatch, packed):
    """At 64 tokens (64 CTAs on 132 SMs) the host side launches the seesaw kernel on plain pools
    unsplit, with no combine, and on packed pools with two splits and the combine, as the other
    kernel always does there."""
    call, launches, combines = _fake_call(monkeypatch, 64, packed)
    assert tlw.sparse_attention(*call).shape == call[0].shape
    assert launches[-1][0][1] == packed and len(combines) == int(packed)
    tla.sparse_attention(*call)
    assert launches[-1][0][2] is True and len(combines) == int(packed) + 1


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("paged", [False, True])
def test_the_l2_prefetch_reads_rows_ahead_of_the_slot_waits(paged, ahead):
    """Lowered for sm_90 (plain pools, split): with :attr:`Schedule.l2_prefetch` each iteration
    of the producer prefetches four rows a thread into L2, each thread its own 128-byte line of
    a row (64 bf16 values times its place among the row's eight threads), before it waits for
    the iteration's first slot, and only then computes the addresses its copies take (at 1 the
    same rows, computed before the prefetch; at 2 the next iteration's rows, from a second set
    of index loads, so the copies' addresses are computed again after the wait); without it,
    no prefetch."""
    build = functools.partial(tlw.build_attention_ws, paged, True, 64, 512, "bfloat16", None, True)
    src = lowered_sm90(build(tlw.Schedule(l2_prefetch=ahead)), tlw.pass_configs(None))
    (loop,) = set(loops_containing(src, "deepinfer_prefetch_l2(("))
    line = "((((int64_t)((int)threadIdx.x)) & (int64_t)7) * (int64_t)64)"
    prefetches = [
        loop.index(f"deepinfer_prefetch_l2((&(flat[({line} + (offs[{k}] * (int64_t)8))])));")
        for k in range(4)
    ]
    wait = loop.index("bar_free[((it & 1) * 2)].wait(")
    assert max(prefetches) < wait and loop.count("deepinfer_prefetch_l2(") == 4
    assert ("offs[0] = " in loop[wait:]) == (ahead == 2)
    assert "deepinfer_prefetch_l2" not in lowered_sm90(build(tlw.DEFAULT), tlw.pass_configs(None))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("packed", [False, True])
def test_next_queries_prefetches_the_next_waves_queries_after_its_own(packed):
    """Lowered for sm_90 (direct, explicit): with :attr:`Schedule.next_queries` the producer,
    once its own queries' copies are issued, prefetches four 128-byte lines a thread of the
    queries of the CTA an SM count (``%nsmid``) later in launch order, where that CTA exists;
    without it, no prefetch."""
    fp8 = _fp8_geometry() if packed else None
    build = functools.partial(tlw.build_attention_ws, False, False, 64, 512, "bfloat16", fp8, True)
    src = lowered_sm90(build(tlw.Schedule(next_queries=True)), tlw.pass_configs(fp8))
    body = src[src.index("__global__ void __launch_bounds__") :]
    arrive, later = body.index("mbarrier_cp_async_arrive_noinc(bar_q"), body.index("deepinfer_sm_count()")
    prefetches = [m.start() for m in re.finditer(r"deepinfer_prefetch_l2\(\(&\(q\[", body)]
    assert len(prefetches) == 4 and arrive < later < min(prefetches)
    assert "mov.u32 %0, %%nsmid;" in src
    assert "deepinfer_sm_count" not in lowered_sm90(build(tlw.DEFAULT), tlw.pass_configs(fp8))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("ahead", [1, 2])
def test_the_l2_prefetch_on_packed_pools_reads_rows_before_the_slot_waits(ahead):
    """Lowered for sm_90 (packed pools, paged, split): with :attr:`Schedule.l2_prefetch` each
    iteration of the producer prefetches, before its first slot wait, the lines of two rows
    (its own line of each, 16 words a line, and on two of a row's four threads one more): at
    1 the rows whose words it loads after the waits; at 2 the next iteration's, from a second
    set of index loads in the loop, and in the first iteration also its own."""
    fp8 = _fp8_geometry()
    src = lowered_sm90(
        tlw.build_attention_ws(True, True, 64, 512, "bfloat16", fp8, True, tlw.Schedule(l2_prefetch=ahead)),
        tlw.pass_configs(fp8),
    )
    (loop,) = set(loops_containing(src, "deepinfer_prefetch_l2(("))
    wait = loop.index("bar_free[((it & 1) * 2)].wait(")
    assert loop.count("deepinfer_prefetch_l2(") == 4 * ahead and loop.rindex("deepinfer_prefetch_l2(") < wait
    assert ("if (it == 0)" in loop[:wait]) == (ahead == 2)
    assert loop.count("= compact[") == 2 * ahead  # the index loads: once, or twice at 2
    assert "(((int64_t)((int)threadIdx.x)) & (int64_t)3) * (int64_t)16)" in loop


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(("tokens", "counts"), [(64, [1, 2]), (16, [1, 2, 4, 5])])
def test_the_split_tuning_times_split_counts_with_the_combine(monkeypatch, packed, tokens, counts):
    """``bench_attention.py --tune``'s seesaw split rows: a launch at each of one, two and four
    splits below the other kernel's plan (two at 64 tokens, five at 16) and at that plan, each
    split count with the combine, beside the count the kernel's own plan takes; the plan's
    constants left as they were."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import attention_tilelang

    call, launches, combines = _fake_call(monkeypatch, tokens, packed)
    kept = tla.MIN_SPLIT_BLOCKS, dict(tlw.SPLIT_CTAS), tlw.FEW_KEYS
    planned = tlw.plan_splits(tokens, 64, 640, 132, packed)
    rows = attention_tilelang.tune_seesaw_splits(call, lambda fn: (fn(), 0.5)[1])
    assert [r["seesaw_splits"] for r in rows] == counts
    assert {r["planned"] for r in rows} == {planned}
    assert [config[1] for config, _ in launches] == [s > 1 for s in counts]
    assert all(len(config) == 7 for config, _ in launches)  # the default schedule's kernel
    assert [args[0].shape[1] for args in combines] == [s for s in counts if s > 1]
    assert kept == (tla.MIN_SPLIT_BLOCKS, tlw.SPLIT_CTAS, tlw.FEW_KEYS)


@pytest.mark.parametrize("tokens", [1, 256])  # split-KV with the combine / direct
def test_both_kernels_launch_through_one_host_side(monkeypatch, tokens):
    """The seesaw kernel and the two-consumer one share the host side (``tla.launch``): the same
    kernel arguments, the same configuration, and the combine exactly when the plan splits."""
    call, launches, combines = _fake_call(monkeypatch, tokens)
    q = call[0]
    assert tla.sparse_attention(*call).shape == q.shape
    assert tlw.sparse_attention(*call).shape == q.shape
    (config_a, args_a), (config_b, args_b) = launches
    split = tla.plan_splits(tokens, 64, 640, 132) > 1
    assert split == (tokens == 1) and len(combines) == 2 * split
    assert config_a == ("attention", False, split, 64, 512, "bfloat16", None, tla.tl_pdl_enabled())
    assert config_b == config_a[1:]
    assert len(args_a) == len(args_b)
    for a, b in zip(args_a, args_b, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype
        else:
            assert a == b


def _needs_gpu_and_tilelang() -> None:
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")


def _cases(kv: str = "plain"):
    from test_tilelang_attention import _v4_cases

    return [args for args in _v4_cases(kv) if tlw.supports(args[0], args[1]) is True]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["plain", "fp8"])
def test_gpu_it_matches_the_reference_at_v4_flash_shapes(kv):
    _needs_gpu_and_tilelang()
    from deepinfer_core.ops.attention import sparse_attention as reference

    cases = _cases(kv)
    assert len(cases) >= 6
    kinds = set()
    for args in cases:
        packed, sms = isinstance(args[1][0], Fp8KVPool), tla.num_sms(args[0].device)
        splits = tlw.plan_splits(args[0].shape[0], 64, tla.max_keys(args[2]), sms, packed)
        kinds.add((tla.third_kind(args[2]), splits > 1))
        want = reference(*args).float()
        torch.testing.assert_close(tlw.sparse_attention(*args).float(), want, atol=2e-2, rtol=2e-2)
    assert kinds >= {(None, False), ("rows", True), ("rows", False), ("paged", True), ("paged", False)}


@pytest.mark.gpu
def test_gpu_it_replays_in_a_cuda_graph_bitwise():
    _needs_gpu_and_tilelang()
    for args in _cases()[:3] + _cases("fp8")[:3]:
        eager = tlw.sparse_attention(*args)
        assert torch.equal(replayed(lambda args=args: tlw.sparse_attention(*args)), eager)


def _assert_replays_bitwise(call, want: torch.Tensor, times: int = 3) -> None:
    """``call`` (warm) captured in one CUDA graph, its output zeroed and the graph replayed
    ``times`` times, each replay giving ``want``'s bits."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(times):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_gpu_packed_pools_equal_their_dequantised_rows_bitwise():
    """The producer's dequantisation is exact (what ``dequantize_fp8_rows`` computes, rounded to
    bfloat16) and the kernel's schedule does not depend on the pools' format: on packed pools
    the op returns, bit for bit, what the kernel returns on the same rows dequantised into plain
    pools under the packed pools' split plan (the plans differ by format, :data:`SPLIT_CTAS`)."""
    _needs_gpu_and_tilelang()
    cases = _cases("fp8")
    assert len(cases) >= 6
    packed_plan = functools.partial(tlw.plan_splits, packed=True)
    differing = 0
    for q, pools, indices, sinks, scale in cases:
        plain = [pool.dequantize(torch.bfloat16) for pool in pools]
        got = tlw.sparse_attention(q, pools, indices, sinks, scale)
        want = tla.launch(q, plain, indices, sinks, scale, tlw._kernel, packed_plan)
        assert torch.equal(got, want)
        shape = (q.shape[0], q.shape[1], tla.max_keys(indices), tla.num_sms(q.device))
        differing += tlw.plan_splits(*shape, packed=True) != tlw.plan_splits(*shape)
    assert differing  # a case whose own plain plan would split differently


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kv", "index"),
    [("plain", i) for i in range(1, len(tlw.variants(False)))]
    + [("fp8", i) for i in range(1, len(tlw.variants(True)))],
)  # one item a variant: each compiles its four call kinds, and xdist spreads the items
def test_gpu_schedule_variants_equal_the_default_bitwise(kv, index):
    """Every :class:`Schedule` variant promises the default schedule's bits."""
    _needs_gpu_and_tilelang()
    schedule = tlw.variants(kv == "fp8")[index]
    for args in _cases(kv):
        assert torch.equal(tlw.sparse_attention(*args, schedule=schedule), tlw.sparse_attention(*args)), (
            schedule
        )
