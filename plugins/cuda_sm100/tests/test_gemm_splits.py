"""The TileLang FP8 GEMM's K splits by measurement (:mod:`deepinfer_cuda_sm100.gemm_splits`).

**Here** (no GPU): the plan takes a given split count (only one of the candidates), the table's
count replaces the plan's rule only where it was faster by the margin, at the call's token tile,
for the measured shape and architecture alone; precompile lists the counts the table picks (and
every candidate with ``--all-splits``).

**GPU** (marked ``gpu``): every candidate count gives the reference op's result within its
tolerance and no less accurately than the reference against a float64 product, and the
dispatcher runs the table's count (the same bits as that count called directly) and replays it
in a CUDA graph bitwise.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_cuda_sm100 import gemm_dispatch, gemm_splits, kernel_choice
from deepinfer_cuda_sm100.tl import fp8_gemm as tlg
from deepinfer_cuda_sm100.tl import precompile
from deepinfer_cuda_sm100.tl.target import ARCH_ENV

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")
from test_gemm_dispatch import _weight  # noqa: E402  (zero and large blocks, both scale formats)


def _point(n: int, k: int, block_m: int, ms: dict[int, float], groups: int = 1) -> kernel_choice.Point:
    times = {str(s): t for s, t in ms.items()}
    return kernel_choice.Point(
        gemm_splits.SPLITS_OP, gemm_splits.kind(groups), "bfloat16", n, k, block_m, groups, times
    )


POINTS = (
    # 1024 -> 8192 at 64 tokens: the rule's 2 splits lose to none by far
    _point(8192, 1024, 64, {1: 0.006, 2: 0.0108, 4: 0.012}),
    # at 16 tokens a count within the margin of the rule's: the rule's stays
    _point(8192, 1024, 16, {1: 0.0052, 2: 0.0054, 4: 0.006}),
    # a grouped projection's point (the groups as keys)
    _point(8192, 4096, 32, {1: 0.02, 2: 0.015, 4: 0.009}, groups=8),
    # the path table: TileLang for 1024 -> 8192 at 64 tokens
    kernel_choice.Point(
        "linear_fp8", "w8a16", "bfloat16", 8192, 1024, 64, 1024, {"triton": 0.018, "tilelang": 0.011}
    ),
)


@pytest.fixture
def table(monkeypatch):
    """:data:`POINTS` as the shipped table of every architecture."""
    kernel_choice.forget()
    monkeypatch.setattr(kernel_choice, "load_points", lambda arch: POINTS)
    yield
    monkeypatch.undo()
    kernel_choice.forget()


def test_the_plan_takes_a_given_candidate_count_and_refuses_others():
    assert tlg.split_candidates(1024) == [1, 2, 4]
    assert tlg.split_candidates(128) == [1]
    rule = tlg.launch_plan(64, 8192, 1024, 132)
    assert rule.splits == 2 and rule.grid == (128, 2)
    given = tlg.launch_plan(64, 8192, 1024, 132, splits=1)
    assert (given.block_m, given.splits, given.blocks_per_split, given.grid) == (64, 1, 8, (128, 1))
    assert given.stages == min(tlg.STAGES, 8)
    with pytest.raises(ValueError, match="splits=3: a K of 1024 splits into one of \\[1, 2, 4\\]"):
        tlg.launch_plan(64, 8192, 1024, 132, splits=3)


def test_the_table_replaces_the_rule_only_where_faster_by_the_margin(table):
    pick = gemm_splits.measured_splits
    assert pick(64, 8192, 1024, 132, 1, "sm90") == 1  # 6.0 against the rule's 10.8 us
    assert pick(40, 8192, 1024, 132, 1, "sm90") == 1  # the same 64-token tile
    assert pick(16, 8192, 1024, 132, 1, "sm90") is None  # 5.2 against 5.4: within the margin
    assert pick(1, 8192, 1024, 132, 1, "sm90") is None
    assert pick(64, 4096, 1024, 132, 1, "sm90") is None  # another shape: not measured
    assert pick(64, 8192, 1024, 132, 1, None) is None  # no table (off the GPU)
    assert pick(32, 8192, 4096, 132, 8, "sm90") == 4  # the grouped point
    assert pick(32, 8192, 4096, 132, 1, "sm90") is None  # ... is not the plain weight's


def test_the_dispatcher_asks_the_table_of_the_calls_device(table, monkeypatch):
    from deepinfer_cuda_sm100.kernels import fp8_gemm

    monkeypatch.setattr(kernel_choice, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(fp8_gemm, "sm_count", lambda device: 132)
    x = torch.zeros(64, 1024, dtype=torch.bfloat16)
    assert gemm_dispatch.tilelang_splits(x, 64, 8192, 1024, 1) == 1
    assert gemm_dispatch.tilelang_splits(x, 16, 8192, 1024, 1) is None


def test_precompile_compiles_the_tables_counts_and_with_all_splits_every_one(table, monkeypatch):
    monkeypatch.setenv(ARCH_ENV, "9.0")
    assert gemm_splits.table_arch() == "sm90"
    configs = precompile.gemm_configurations("1024x8192", 132)
    gemms = {(c[3], c[4]) for c in configs if c[0] == "gemm"}  # (token tile, splits)
    assert (64, 1) in gemms and (64, 2) not in gemms  # the table's count at 64 tokens
    assert (16, tlg.launch_plan(16, 8192, 1024, 132).splits) in gemms  # the rule's elsewhere
    every = precompile.gemm_configurations("1024x8192", 132, all_splits=True)
    assert {(c[3], c[4]) for c in every if c[0] == "gemm"} == {
        (bm, s) for bm in tlg.BLOCK_MS for s in tlg.split_candidates(1024)
    }
    assert {c[4] for c in every if c[0] == "gemm" and c[-1] is True} == {2, 4}  # fused split sums
    a = precompile.parse_args(["--all-splits", "--gemm-shapes", "1024x8192", "--grouped-shapes", ""])
    assert [c for module, c in precompile.jobs(a) if module == "fp8_gemm"] == every


def test_the_benchmarks_rows_become_points_the_table_chooses_by(monkeypatch, tmp_path):
    """``bench_gemm_splits.py --write-choices``: its rows, merged into a table, are what
    :func:`measured_splits` decides by (a count that did not run is left out)."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    bench = importlib.import_module("bench_gemm_splits")
    rows = [
        {"G": 1, "K": 1024, "N": 8192, "block_m": 64, "rule": 2, "us": {1: 6.0, 2: 10.8, 4: None}},
        {"G": 8, "K": 4096, "N": 8192, "block_m": 32, "rule": 2, "us": {1: 20.0, 2: 15.0, 4: 9.0}},
        {"G": 1, "K": 4096, "N": 1024, "block_m": 16, "rule": 8, "us": {1: None, 2: None}},
    ]
    points = bench.table_points(rows)
    assert [p["ms"] for p in points] == [{"1": 0.006, "2": 0.0108}, {"1": 0.02, "2": 0.015, "4": 0.009}]
    monkeypatch.setattr(kernel_choice, "TABLE_DIR", tmp_path)  # merge_points forgets the old choices
    kernel_choice.merge_points("sm90", points, {"command": "test"})
    try:
        assert gemm_splits.measured_splits(64, 8192, 1024, 132, 1, "sm90") == 1
        assert gemm_splits.measured_splits(32, 8192, 4096, 132, 8, "sm90") == 4
    finally:
        monkeypatch.undo()
        kernel_choice.forget()


def _gpu_ready() -> None:
    from deepinfer_cuda_sm100.tl import tilelang_problem

    problem = tilelang_problem()
    if problem:
        pytest.skip(problem)


@pytest.mark.gpu
def test_gpu_every_split_count_matches_the_reference():
    from deepinfer_core.ops.linear import linear
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    _gpu_ready()
    atol, rtol = DEFAULT_TOLERANCES[torch.bfloat16]
    g = torch.Generator().manual_seed(8)
    for k, n in ((1024, 8192), (4096, 1536)):
        w = _weight(g, n, k, "ue8m0", "cuda")
        dense = w.dequantize(torch.bfloat16).double()
        for m in (1, 33, 64, 200):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            want = linear(x, w)
            ref_err = (want.double() - x.double() @ dense.t()).abs().max()
            for s in tlg.split_candidates(k):
                got = tlg.linear_fp8(x, w, splits=s)
                assert torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol), f"{k}x{n} M={m} s={s}"
                err = (got.double() - x.double() @ dense.t()).abs().max()
                assert err <= 2 * ref_err + 1e-6, f"{k}x{n} M={m} s={s}: {err:.3g} vs {ref_err:.3g}"


@pytest.mark.gpu
def test_gpu_the_dispatcher_runs_the_tables_count_and_replays_it_bitwise(table):
    from deepinfer_cuda_sm100.kernels.fp8_gemm import linear_fp8 as triton_linear

    _gpu_ready()
    g = torch.Generator().manual_seed(9)
    w = _weight(g, 8192, 1024, "fp32", "cuda")
    x = torch.randn(64, 1024, generator=g).to(torch.bfloat16).cuda()
    if gemm_dispatch.choose_path(x, w) != "tilelang":
        pytest.skip("the shipped table does not take TileLang at this shape")
    op = gemm_dispatch.make_linear(triton_linear)
    eager = op(x, w)
    assert torch.equal(eager, tlg.linear_fp8(x, w, splits=1))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = op(x, w)
    graph.replay()
    assert torch.equal(y, eager)
