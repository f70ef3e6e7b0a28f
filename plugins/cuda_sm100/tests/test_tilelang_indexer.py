"""The TileLang indexer scores (:mod:`deepinfer_cuda_sm100.tl.indexer`) and their dispatch.

**Here** (no GPU, no TileLang): which calls the TileLang scores refuse (with the reason), that
calls off the GPU and batch-invariant calls keep the Triton scores, the choice by the measured
table, and that ``tl.precompile`` compiles both candidate forms.

**GPU** (marked ``gpu``; skipped where TileLang cannot compile): on the ``indexer_topk``
conformance cases at DeepSeek-V4-Flash shapes (paged candidates with ragged entry counts,
explicit rows with ``-1`` holes and fewer valid candidates than ``k``), integer data: the
TileLang scores equal the Triton scores bit for bit (every sum is exact, whatever its order)
and the backend op's picks equal the reference op's; random data: the scores agree to fp32
rounding; a captured CUDA graph replays the eager scores bitwise.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from cuda_sm100_checks import loops_containing, lowered_sm90, pdl_prologue_problem
from deepinfer_cuda_sm100 import indexer_select, kernel_choice
from deepinfer_cuda_sm100.tl import indexer as tli
from deepinfer_cuda_sm100.tl import tilelang_problem

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.modes import batch_invariant_mode


def _call(t=3, h=64, d=128, n=40, dtype=torch.bfloat16):
    q = torch.randn(t, h, d).to(dtype)
    w = torch.randn(t, h)
    keys = torch.randn(n, d).to(dtype)
    cand = torch.randint(-1, n, (t, 10))
    return q, w, keys, cand


def test_the_tilelang_scores_refuse_what_they_cannot_run_and_say_why():
    q, w, keys, cand = _call()
    assert tli.supports(q, w, keys, cand) is True
    assert "bfloat16 and float16" in tli.supports(q.float(), w, keys.float(), cand)
    assert "multiples of 16" in tli.supports(*_call(h=20)[:3], cand)
    assert "multiples of 64" in tli.supports(*_call(d=96)[:3], cand)
    wide = torch.randn(40, 136).to(torch.bfloat16)[:, :128]  # rows of 272 bytes: 16-byte multiple
    assert tli.supports(q, w, wide, cand) is True
    odd = torch.randn(40, 132).to(torch.bfloat16)[:, :128]  # rows of 264 bytes
    assert "multiple of 16 bytes" in tli.supports(q, w, odd, cand)
    shifted = torch.randn(41 * 128 + 1).to(torch.bfloat16)[1:].view(41, 128)[:40]
    assert "16-byte aligned" in tli.supports(q, w, shifted, cand)
    import dataclasses

    index = PagedIndex(torch.zeros(3, 2, dtype=torch.int64), torch.arange(3), torch.full((3,), 20), 16, 20)
    assert tli.supports(q, w, keys, index) is True
    huge = dataclasses.replace(index, max_count=1 << 30)  # past the exact page division
    assert "2**30" in tli.supports(q, w, keys, huge)


def test_cpu_and_batch_invariant_calls_keep_the_triton_scores():
    q, w, keys, cand = _call()
    assert indexer_select.choose_scores(q, w, keys, cand) == "triton"
    with batch_invariant_mode():
        assert indexer_select.choose_scores(q, w, keys, cand) == "triton"


def test_the_measured_table_picks_the_scores_language_at_the_nearest_shape():
    def point(tokens, keys, tl, tr):
        ms = {"tilelang": tl, "triton": tr}
        return kernel_choice.Point(indexer_select.SCORE_OP, "paged", "bfloat16", 64, 128, tokens, keys, ms)

    points = (point(128, 16384, 0.2, 0.3), point(8192, 2048, 3.0, 2.3))
    both = indexer_select.SCORE_PATHS

    def choose(tokens, keys, available=both):
        return kernel_choice.choose(
            indexer_select.SCORE_OP, "paged", "bfloat16", 64, 128, tokens, keys, "sm90", available,
            points=points,
        )  # fmt: skip

    assert choose(128, 16384) == "tilelang"
    assert choose(200, 20000) == "tilelang"
    assert choose(8192, 2048) == "triton"
    assert choose(128, 16384, frozenset({"triton"})) == "triton"


def test_shipped_score_points_time_both_languages():
    points = [p for p in kernel_choice.load_points("sm90") if p.op == indexer_select.SCORE_OP]
    assert points
    for p in points:
        assert {"triton", "tilelang"} <= set(p.ms) <= indexer_select.SCORE_PATHS
        assert all(ms > 0 for ms in p.ms.values())


def test_precompile_covers_every_launch_the_plan_makes():
    from deepinfer_cuda_sm100.tl.pdl import tl_pdl_enabled
    from deepinfer_cuda_sm100.tl.precompile import indexer_configurations

    configs = set(indexer_configurations(64, 128))
    shapes = [(t, c) for t in (1, 7, 64, 128, 8192) for c in (1, 100, 2048, 16384, 1 << 18)]
    planned = {tli.plan_blocks(t, c, 132) for t, c in shapes}
    pdl = tl_pdl_enabled()
    assert configs == {(kind, 64, 128, "bfloat16", b, pdl) for kind in tli.KINDS for b in tli.BLOCK_CHOICES}
    assert planned <= set(tli.BLOCK_CHOICES) and planned >= {1, tli.BLOCKS}


def test_the_block_plan_keeps_the_sms_busy():
    sms = 132
    assert tli.plan_blocks(128, 16384, sms) == tli.BLOCKS  # 1,024 CTAs of 16 blocks
    assert tli.plan_blocks(1, 16384, sms) == 1  # one token: a CTA per block
    for t, c in ((8, 16384), (32, 4096), (128, 2048), (8192, 2048)):
        b = tli.plan_blocks(t, c, sms)
        blocks = math.ceil(c / tli.BN)
        assert t * math.ceil(blocks / b) >= tli.MIN_CTAS_PER_SM * sms or b == 1
        if b < tli.BLOCKS:  # twice the blocks would leave SMs short
            assert t * math.ceil(blocks / (2 * b)) < tli.MIN_CTAS_PER_SM * sms


def _gpu_cases():
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH, indexer_cases
    from test_attention_kernels import _to

    cases = indexer_cases(V4_FLASH)(torch.Generator().manual_seed(0), torch.bfloat16)
    return [_to(args, "cuda") for args, _ in cases]


def _needs_tilelang():
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")


@pytest.mark.gpu
def test_gpu_tilelang_scores_match_triton_and_the_picks_the_reference():
    _needs_tilelang()
    from deepinfer_cuda_sm100.kernels import indexer as ki

    from deepinfer_core.ops.attention import indexer_topk as reference

    cases = _gpu_cases()
    kinds = set()
    for q, w, keys, cand, k, scale in cases[:-1]:  # integer data: exact scores
        assert tli.supports(q, w, keys, cand) is True
        kinds.add("paged" if isinstance(cand, PagedIndex) else "rows")
        got = tli.indexer_scores(q, w, keys, cand, scale)
        want = ki.indexer_scores(q, w, keys, cand, scale)
        assert torch.equal(got, want), f"T={q.shape[0]} {type(cand).__name__}"
        picks = ki.select_topk(got, k, cand)
        assert torch.equal(picks, reference(q, w, keys, cand, k, scale))
        assert torch.equal(indexer_select.indexer_topk(q, w, keys, cand, k, scale), picks)
    assert kinds == set(tli.KINDS)
    q, w, keys, cand, k, scale = cases[-1]  # random data: fp32 rounding apart
    got = tli.indexer_scores(q, w, keys, cand, scale)
    want = ki.indexer_scores(q, w, keys, cand, scale)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    atol = 1e-5 * float(want[finite].abs().max())
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=atol)
    assert torch.equal(ki.select_topk(got, k, cand), reference(q, w, keys, cand, k, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [1, 3, 16])
def test_gpu_tilelang_scores_do_not_depend_on_the_blocks_a_cta_takes(blocks):
    _needs_tilelang()
    for q, w, keys, cand, _, scale in _gpu_cases()[:2]:
        want = tli.indexer_scores(q, w, keys, cand, scale)
        assert torch.equal(tli.indexer_scores(q, w, keys, cand, scale, blocks=blocks), want)


@pytest.mark.gpu
def test_gpu_tilelang_scores_replay_in_a_cuda_graph_bitwise():
    _needs_tilelang()
    from cuda_sm100_checks import replayed

    for q, w, keys, cand, _, scale in _gpu_cases()[:2]:
        eager = tli.indexer_scores(q, w, keys, cand, scale)
        assert torch.equal(replayed(lambda a=(q, w, keys, cand, scale): tli.indexer_scores(*a)), eager)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("kind", ["rows", "paged"])
def test_the_gather_loop_has_no_block_barrier(kind):
    """Lowered for sm_90, the loop issuing a block's key gathers (``cp.async``) does not wait at
    a block barrier in every iteration (the CTA's row offsets sit in static shared memory)."""
    src = lowered_sm90(
        tli.build_scores(kind, 64, 128, "bfloat16", 16), {"tl.disable_safe_memory_legalize": True}
    )
    loops = loops_containing(src, "cp_async_gs")
    assert loops, "no gather loop found in the generated source"
    assert all("__syncthreads" not in body for body in loops), "a block barrier in a gather loop"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("kind", ["rows", "paged", "grouped"])
def test_with_pdl_the_scores_wait_before_any_global_access(kind):
    """With ``pdl`` the score kernels (one token a CTA over explicit or paged candidates, and
    the grouped one) wait for the kernel before them (``griddepcontrol.wait``) before they read
    the queries, weights, index or keys or write a score, then let the next kernel be
    scheduled; TileLang marks them for a PDL launch.  Without ``pdl`` none of it is there."""
    from deepinfer_cuda_sm100.tl import indexer_grouped as tlg

    def build(pdl):
        if kind == "grouped":
            return tlg.build_grouped_scores(64, 128, "bfloat16", 16, tlg.GROUP, pdl)
        return tli.build_scores(kind, 64, 128, "bfloat16", 16, pdl)

    configs = {"tl.disable_safe_memory_legalize": True}
    accesses = r"(cp_async_gs|\bq\[|\bw\[|\bcand\[|\bblock_table\[|\btoken_rows\[|\bcounts\[|\bscores\[)"
    problem = pdl_prologue_problem(build(True), accesses, configs)
    assert problem is None, problem
    plain = lowered_sm90(build(False), configs)
    assert "cudaGridDependencySynchronize" not in plain and "cudaTriggerProgrammatic" not in plain
