"""The grouped TileLang indexer scores (:mod:`deepinfer_cuda_sm100.tl.indexer_grouped`: several
query tokens of one request a CTA) and their place in the dispatch.

**Here** (no GPU): which calls they refuse (with the reason), the block plan, that the table
can pick them for paged candidates only, that ``tl.precompile`` compiles the launches the
dispatcher makes; where TileLang is installed (slow), that the kernel lowers for sm_90 with one
key gather per block shared by the group's GEMMs and no block barrier inside the gather loop.

**GPU** (marked ``gpu``; skipped where TileLang cannot compile): over batches whose groups
span requests (requests of 1-9 tokens, a group cut by the end of the batch), ragged entry counts
(0, past ``max_count``), block tables whose unused pages lie far outside the pool: the scores
equal the one-token TileLang kernel's bit for bit for both group sizes, every blocks-per-CTA choice
one or two warpgroups a CTA, and on
integer data the Triton kernel's (every sum exact); a captured CUDA graph replays them bitwise.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re

import pytest
import torch
from cuda_sm100_checks import loops_containing, lowered_sm90
from deepinfer_cuda_sm100 import indexer_select, kernel_choice
from deepinfer_cuda_sm100.tl import indexer as tli
from deepinfer_cuda_sm100.tl import indexer_grouped as tlg
from deepinfer_cuda_sm100.tl import tilelang_problem

from deepinfer_core.ops.attention import PagedIndex

H, D, EPP = 64, 128, 16
SCALE = 2.0**-4
"""A power of two: on integer data every product and sum is exact, in any order."""


def _paged(lengths, max_count, g, device="cpu", integer=False):
    """Requests of ``lengths`` query tokens over one pool: a random block table per request
    (past the pages its entries need, page ids far out of the pool: never to be read),
    causal-like ragged counts per token."""
    t = sum(lengths)
    pages = -(-max_count // EPP)
    table = torch.full((len(lengths), pages + 1), 1 << 40, dtype=torch.int64)
    perm = torch.randperm(len(lengths) * pages, generator=g)
    rows, counts = [], []
    for r, n in enumerate(lengths):
        total = int(torch.randint(0, max_count + 8, (1,), generator=g))  # past max_count too
        need = min(-(-min(total, max_count) // EPP), pages)
        table[r, :need] = perm[r * pages : r * pages + need]
        for i in range(n):
            rows.append(r)
            counts.append(max(total - (n - 1 - i), 0))
    rows_t, counts_t = torch.tensor(rows, device=device), torch.tensor(counts, device=device)
    index = PagedIndex(table.to(device), rows_t, counts_t, EPP, max_count)
    if integer:
        q = torch.randint(-3, 4, (t, H, D), generator=g).to(torch.bfloat16)
        w = torch.randint(-2, 3, (t, H), generator=g).float()
        keys = torch.randint(-3, 4, (len(lengths) * pages * EPP, D), generator=g).to(torch.bfloat16)
    else:
        q = torch.randn(t, H, D, generator=g).to(torch.bfloat16)
        w = torch.randn(t, H, generator=g) * H**-0.5
        keys = torch.randn(len(lengths) * pages * EPP, D, generator=g).to(torch.bfloat16)
    return q.to(device), w.to(device), keys.to(device), index


def test_the_grouped_scores_refuse_what_they_cannot_run_and_say_why():
    q, w, keys, index = _paged([3, 2], 40, torch.Generator().manual_seed(0))
    assert tlg.supports(q, w, keys, index) is True
    rows = torch.randint(-1, keys.shape[0], (q.shape[0], 10))
    assert "paged candidates only" in tlg.supports(q, w, keys, rows)
    assert "bfloat16 and float16" in tlg.supports(q.float(), w, keys.float(), index)
    with pytest.raises(ValueError, match="group must be one of"):
        tlg.build_grouped_scores(H, D, "bfloat16", 4, group=3)


def test_the_block_plan_counts_a_cta_per_group_of_tokens():
    sms = 132
    for t, c, group in ((8192, 2048, 2), (8192, 2048, 4), (512, 4096, 2), (5, 16384, 2)):
        b = tlg.plan_blocks(t, c, sms, group)
        groups, blocks = math.ceil(t / group), math.ceil(c / tli.BN)
        assert groups * math.ceil(blocks / b) >= tli.MIN_CTAS_PER_SM * sms or b == 1
        if b < tli.BLOCKS:  # twice the blocks would leave SMs short
            assert groups * math.ceil(blocks / (2 * b)) < tli.MIN_CTAS_PER_SM * sms
    assert tlg.plan_blocks(8192, 2048, sms, 2) == tli.BLOCKS


def test_the_table_picks_the_grouped_scores_for_paged_candidates_only():
    def point(kind, tokens, keys, ms):
        return kernel_choice.Point(indexer_select.SCORE_OP, kind, "bfloat16", H, D, tokens, keys, ms)

    ms = {"triton": 2.3, "tilelang": 1.2, "tilelang_grouped": 0.6}
    points = (point("paged", 8192, 2048, ms), point("paged", 128, 16384, {"triton": 0.3, "tilelang": 0.16}))

    def choose(tokens, keys, available=indexer_select.SCORE_PATHS):
        return kernel_choice.choose(
            indexer_select.SCORE_OP, "paged", "bfloat16", H, D, tokens, keys, "sm90", available,
            points=points,
        )  # fmt: skip

    assert choose(8192, 2048) == "tilelang_grouped"
    assert choose(128, 16384) == "tilelang"  # a point that did not time it never picks it
    assert choose(8192, 2048, indexer_select.SCORE_PATHS - {"tilelang_grouped"}) == "tilelang"


def test_cpu_calls_keep_the_triton_scores():
    q, w, keys, index = _paged([4, 4], 40, torch.Generator().manual_seed(1))
    assert indexer_select.choose_scores(q, w, keys, index) == "triton"


def test_only_the_two_token_group_runs_overlapped_by_default():
    """The overlapped build takes a group of 2 (four accumulators spill): a larger group (what
    ``--tune`` times) runs plain by default instead of being refused."""
    assert tlg.overlaps(2) is tlg.OVERLAP
    assert tlg.overlaps(4) is False
    with pytest.raises(ValueError, match="overlap takes a group of 2"):
        tlg.build_grouped_scores(H, D, "bfloat16", 16, 4, overlap=True)


def test_precompile_covers_the_dispatched_group_at_every_block_choice():
    from deepinfer_cuda_sm100.tl.pdl import tl_pdl_enabled
    from deepinfer_cuda_sm100.tl.precompile import grouped_indexer_configurations, jobs, parse_args

    configs = grouped_indexer_configurations(H, D)
    layout = (tl_pdl_enabled(), tlg.WARPGROUPS, tlg.overlaps(tlg.GROUP))
    assert configs == [(H, D, "bfloat16", b, tlg.GROUP, *layout) for b in tli.BLOCK_CHOICES]
    planned = {tlg.plan_blocks(t, c, 132) for t in (5, 512, 8192) for c in (100, 2048, 16384)}
    assert planned <= {c[3] for c in configs}
    args = parse_args(["--gemm-shapes", "4096x1024", "--index-heads", str(H), "--index-dim", str(D)])
    assert [c for m, c in jobs(args) if m == "indexer_grouped"] == configs


def test_the_benchmark_writes_full_rows_to_the_table_and_times_causal_chunks_apart(monkeypatch):
    """``bench_attention.py``'s indexer rows: a causal prefill shape (``8192x2048c``) gives each
    token the entries its position closes and counts only those FLOPs; the table takes the
    grouped kernel's time where it ran, from full rows only."""
    import sys
    from pathlib import Path

    from cuda_sm100_checks import choice_writers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from attention_inputs import indexer_inputs

    g = torch.Generator().manual_seed(0)
    full = indexer_inputs(2048, 512, torch.bfloat16, g, device="cpu")
    causal = indexer_inputs(2048, 512, torch.bfloat16, g, causal=True, device="cpu")
    counts = causal["args"][3].counts
    assert torch.equal(counts, (torch.arange(2048) + 1) // 4)  # a chunk that starts the request
    assert torch.equal(full["args"][3].counts, torch.full((2048,), 512))
    assert causal["flops"] * 2 == pytest.approx(full["flops"], rel=1e-2)

    writers = choice_writers()
    merged = []
    monkeypatch.setattr(writers, "merge", lambda points, *a, **k: merged.extend(points))
    row = {"T": 8192, "C": 2048, "score_ms": 2.3, "tilelang_score_ms": 1.2}
    grouped = {**row, "T": 1024, "grouped_score_ms": 0.5}
    rows = [row, grouped, {**row, "causal": True, "grouped_score_ms": 0.3}]
    writers.write_score_choices(rows)
    assert [p["ms"] for p in merged] == [
        {"triton": 2.3, "tilelang": 1.2},
        {"triton": 2.3, "tilelang": 1.2, "tilelang_grouped": 0.5},
    ]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("group", tlg.GROUP_CHOICES)
def test_the_group_shares_one_gather_per_block_without_a_barrier_in_its_loop(group):
    """Lowered for sm_90: one loop issues a block's key gathers (``cp.async``), with no block
    barrier inside; the GEMM runs once per token of the group (a loop of ``group`` around one
    ``wgmma`` sequence over the same key stage; the overlapped build has its own test)."""
    config = {"tl.disable_safe_memory_legalize": True}
    src = lowered_sm90(tlg.build_grouped_scores(H, D, "bfloat16", 16, group, overlap=False), config)
    loops = loops_containing(src, "cp_async_gs")
    assert loops and all("__syncthreads" not in body for body in loops)
    assert f"for (int j = 0; j < {group}; ++j)" in src
    assert src.count("wgmma_ss<") == 2  # the pipelined loop's and its epilogue's, each in the token loop


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
def test_two_warpgroups_split_a_blocks_keys_never_its_heads():
    """At two warpgroups each takes one 64-row M tile of a block with all of its ``H`` heads
    (``wgmma`` ``m64n64``), so a row's sum over heads stays in one warpgroup's quad: no
    exchange of partial sums through shared memory."""
    config = {"tl.disable_safe_memory_legalize": True}
    src = lowered_sm90(tlg.build_grouped_scores(H, D, "bfloat16", 16, 2, warpgroups=2, overlap=False), config)
    assert re.findall(r"wgmma_ss<[^>]*kFloat32, (\d+), (\d+), 16,", src) == [("64", str(H))] * 2
    assert set(re.findall(r"AllReduce<tl::SumOp, (\d+),", src)) == {"4"}  # within a quad only


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
def test_overlap_issues_both_tokens_gemms_before_the_first_wait():
    """With ``overlap`` a block's two GEMMs (one accumulator a token) are issued back to back,
    then waited for one at a time (``wait_wgmma(1)`` before token 0's epilogue, ``(0)``
    before token 1's), in a kernel built for two CTAs an SM; any other group is refused."""
    config = {"tl.disable_safe_memory_legalize": True}
    src = lowered_sm90(tlg.build_grouped_scores(H, D, "bfloat16", 16, 2, warpgroups=2, overlap=True), config)
    assert "__launch_bounds__(256, 2)" in src
    calls = re.findall(r"(wgmma_ss<|wait_wgmma<\d>|AllReduce<)", src)
    block = ["wgmma_ss<", "wgmma_ss<", "wait_wgmma<1>", "AllReduce<", "wait_wgmma<0>", "AllReduce<"]
    assert calls == block * 2, calls  # the pipelined loop's block and its last
    with pytest.raises(ValueError, match="group of 2"):
        tlg.build_grouped_scores(H, D, "bfloat16", 16, 4, overlap=True)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
def test_hoist_reads_the_weights_before_each_wait_and_decides_a_passs_tokens_once():
    """With ``hoist`` (overlapped kernels) each token's head weights go from shared memory into
    registers before the wait for its GEMM and its epilogue multiplies by those; which tokens
    a pass scores is decided once a pass, so no block's epilogue reads the rows; the GEMMs and
    waits keep their order.  Without overlap, ``hoist`` changes nothing."""
    config = {"tl.disable_safe_memory_legalize": True}
    src = lowered_sm90(tlg.build_grouped_scores(H, D, "bfloat16", 16, 2, warpgroups=2, hoist=True), config)
    loop = min(loops_containing(src, "wait_wgmma<1>"), key=len)  # the pipelined block loop
    for j, wait in enumerate(("wait_wgmma<1>", "wait_wgmma<0>")):
        after = loop.index("wgmma_ss<") if j == 0 else loop.index("wait_wgmma<1>")
        load = loop.index("*(float2*)(w_r + ", after)
        assert load < loop.index(wait) < loop.index(f"if (live[{j}] != 0)"), j
    assert "rows_s" not in loop and "w_s)[" not in loop and "* scale), w_r[" in loop
    calls = re.findall(r"(wgmma_ss<|wait_wgmma<\d>|AllReduce<)", src)
    block = ["wgmma_ss<", "wgmma_ss<", "wait_wgmma<1>", "AllReduce<", "wait_wgmma<0>", "AllReduce<"]
    assert calls == block * 2, calls
    plain = functools.partial(tlg.build_grouped_scores, H, D, "bfloat16", 16, 2, warpgroups=2, overlap=False)
    assert lowered_sm90(plain(hoist=True), config) == lowered_sm90(plain(), config)


@pytest.mark.slow
@pytest.mark.skipif(tilelang_problem() is not None, reason=f"needs TileLang and nvcc: {tilelang_problem()}")
def test_neither_kernel_fuses_the_head_weight_into_the_head_sum(tmp_path):
    """Built for sm_90a, neither the one-token nor the grouped kernel has an FFMA: the head
    weight's product is rounded before the sum over heads adds it (``ieee_mul``).  Where nvcc
    was free to contract the two, the one-token kernel's straight-line epilogue got 64 FFMAs
    and the grouped kernel's (inside its token loop) none, so their scores differed in the last
    bits on real data."""
    import os
    import subprocess

    import triton
    from tilelang.contrib.nvcc import default_compile_options, get_nvcc_compiler

    disasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    config = {"tl.disable_safe_memory_legalize": True}
    kernels = {
        "one": tli.build_scores("paged", H, D, "bfloat16", 1),
        "grouped": tlg.build_grouped_scores(H, D, "bfloat16", 1, 2),
    }
    for name, func in kernels.items():
        src, cubin = tmp_path / f"{name}.cu", tmp_path / f"{name}.cubin"
        src.write_text(lowered_sm90(func, config))
        arch = "-gencode=arch=compute_90a,code=sm_90a"
        cmd = [get_nvcc_compiler(), "-cubin", arch, *default_compile_options(), "-w"]
        cmd += ["-o", str(cubin), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        sass = subprocess.run([disasm, "-c", str(cubin)], capture_output=True, text=True).stdout
        assert "FMUL" in sass and "FFMA" not in sass, name


# ---------------------------------------------------------------------------------------------
# GPU


def _needs_tilelang():
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")


VARIANTS = ((1, 1, False, False), (2, 1, False, False), (tli.BLOCKS, 1, False, False),
            (1, 2, False, False), (2, 2, False, False), (tli.BLOCKS, 2, False, False),
            (1, 2, True, False), (tli.BLOCKS, 2, True, False), (1, 2, True, True),
            (tli.BLOCKS, 2, True, True))  # fmt: skip
"""``(blocks, warpgroups, overlap, hoist)`` of the grouped kernels the GPU test compares (overlap
and hoist at a group of 2 only)."""
BATCHES = ([9, 1, 4, 3], [1] * 7, [2048], [5, 2, 6])
"""Request lengths: groups across requests, single-token requests, one long request, an odd
total (the last group cut short)."""


@pytest.mark.gpu
@pytest.mark.parametrize("group", tlg.GROUP_CHOICES)
def test_gpu_grouped_scores_are_bitwise_the_one_token_kernels(group):
    _needs_tilelang()
    from deepinfer_cuda_sm100.kernels import indexer as ki

    g = torch.Generator().manual_seed(group)
    for lengths in BATCHES:
        for integer in (True, False):
            q, w, keys, index = _paged(lengths, 300, g, "cuda", integer)
            one = tli.indexer_scores(q, w, keys, index, SCALE)
            for blocks, wgs, overlap, hoist in VARIANTS:
                if overlap and group != 2:
                    continue
                config = {"blocks": blocks, "group": group, "warpgroups": wgs, "overlap": overlap}
                config["hoist"] = hoist
                got = tlg.indexer_scores(q, w, keys, index, SCALE, **config)
                assert torch.equal(got, one), f"{lengths} integer={integer} {config}"
            if integer:  # exact sums: the Triton kernel's scores too
                assert torch.equal(one, ki.indexer_scores(q, w, keys, index, SCALE)), f"{lengths}"


@pytest.mark.gpu
def test_gpu_grouped_scores_replay_in_a_cuda_graph_bitwise():
    _needs_tilelang()
    from cuda_sm100_checks import replayed

    q, w, keys, index = _paged([9, 1, 4, 3], 300, torch.Generator().manual_seed(7), "cuda")
    eager = tlg.indexer_scores(q, w, keys, index, SCALE)
    assert torch.equal(replayed(lambda: tlg.indexer_scores(q, w, keys, index, SCALE)), eager)
