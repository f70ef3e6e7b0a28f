"""``indexer_topk``'s exact ``torch.topk`` selection and the measured choice of the selection
path (:mod:`deepinfer_cuda_sm100.indexer_select`).

The ``torch`` path against the definition (a stable descending sort: equal scores rank by
column, ``-inf`` candidates are ``-1``) on scores with many ties, negative values and ``-inf``
holes, for explicit, paged and absent candidate lists; its 64-bit keys order exactly as the
scores do.  The interpreter report of ``test_attention_kernels.py`` checks it against the
Triton radix select on the conformance cases; the GPU tier runs the op through both paths.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

from cuda_sm100_checks import compile_launch, compile_problem  # noqa: E402
from deepinfer_cuda_sm100 import kernel_choice  # noqa: E402
from deepinfer_cuda_sm100.indexer_select import (  # noqa: E402
    OP,
    PATHS,
    choose_path,
    ordered_keys,
    select_topk_torch,
)

from deepinfer_core.ops.attention import PagedIndex  # noqa: E402


def _scores(t: int, c: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-4, 5, (t, c), generator=g).float() * 0.5  # many ties, negatives, zeros
    s[torch.rand(t, c, generator=g) < 0.2] = float("-inf")  # invalid candidates
    s[0, -5:] = torch.tensor([3.0e38, -3.0e38, 1e-45, -1e-45, 0.0])  # extremes and subnormals
    return s


def _definition(scores: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    cols = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    picked = rows.gather(1, cols)
    return picked.masked_fill(scores.gather(1, cols) == float("-inf"), -1)


def test_keys_order_like_the_scores_with_ties_to_the_earlier_column():
    s = _scores(3, 50)
    keys = ordered_keys(s)
    for r in range(3):
        by_key = torch.sort(keys[r], descending=True).indices
        by_score = torch.sort(s[r], descending=True, stable=True).indices
        assert torch.equal(by_key, by_score)


@pytest.mark.parametrize("k", [1, 7, 40, 64])
def test_torch_path_is_the_stable_descending_order(k):
    t, c = 5, 48
    s = _scores(t, c, seed=k)
    cols = torch.arange(c).expand(t, c)
    assert torch.equal(select_topk_torch(s, k, None), _definition(s, min(k, c), cols))
    g = torch.Generator().manual_seed(k)
    explicit = torch.randint(0, 1000, (t, c), generator=g)
    assert torch.equal(select_topk_torch(s, k, explicit), _definition(s, min(k, c), explicit))
    epp, pages = 8, c // 8
    table = torch.randperm(t * pages, generator=g).view(t, pages)
    paged = PagedIndex(table, torch.arange(t), torch.full((t,), c), epp, c)
    entries = table.repeat_interleave(epp, dim=1) * epp + torch.arange(c) % epp
    assert torch.equal(select_topk_torch(s, k, paged), _definition(s, min(k, c), entries))


def test_the_choice_keeps_triton_off_the_gpu_and_where_unmeasured():
    s = _scores(4, 64)
    assert choose_path(s, None) == "triton"
    points = (
        kernel_choice.Point(OP, "paged", "float32", 0, 0, 128, 262144, {"triton": 2.0, "torch": 1.0}),
        kernel_choice.Point(OP, "paged", "float32", 0, 0, 8192, 2048, {"triton": 1.0, "torch": 2.0}),
    )

    def pick(t, c, kind="paged"):
        return kernel_choice.choose(OP, kind, "float32", 0, 0, t, c, "sm90", PATHS, points=points)

    assert (pick(128, 200000), pick(8192, 4096), pick(128, 262144, "rows")) == ("torch", "triton", "triton")


# ---------------------------------------------------------------------------------------------
# the radix select and the threshold path of the Triton selection against the reference op


def _op_inputs(scores: torch.Tensor, masked: torch.Tensor) -> tuple:
    """``indexer_topk`` arguments whose exact scores are ``scores`` (``-inf`` where ``masked``):
    two heads of weights ``+1, -1`` read ``relu(v)`` and ``relu(-v)`` off key ``[relu(v),
    relu(-v)]`` (every step exact in fp32); masked candidates are ``-1``."""
    t, c = scores.shape
    v = scores.masked_fill(masked, 0.0)
    keys = torch.stack([v.clamp(min=0), (-v).clamp(min=0)], dim=-1).reshape(t * c, 2)
    q = torch.eye(2).expand(t, 2, 2).contiguous()
    w = torch.tensor([1.0, -1.0]).expand(t, 2).contiguous()
    cand = torch.arange(t * c).view(t, c).masked_fill(masked, -1)
    return q, w, keys, cand


def _split_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, int, int]]:
    """``(name, scores, masked, k, segments)``: few rows, long enough for several segments."""
    g = torch.Generator().manual_seed(7)
    cases = []
    s = torch.randn(2, 300, generator=g)
    cases.append(("random", s, torch.zeros_like(s, dtype=torch.bool), 13, 3))
    s = torch.randint(-2, 3, (2, 300), generator=g).float()  # five values: ties everywhere
    cases.append(("ties", s, torch.rand(2, 300, generator=g) < 0.3, 11, 4))
    # equal values straddle the k-th place in every segment: 3 of 2.0, then 1.0 everywhere
    s = torch.ones(2, 290)
    s[0, [5, 150, 280]] = 2.0
    s[1, 200:] = 3.0
    cases.append(("boundary ties", s, torch.zeros_like(s, dtype=torch.bool), 9, 3))
    masked = torch.rand(2, 260, generator=g) < 0.5
    masked[1, 7:] = True  # fewer valid candidates than k
    cases.append(("masked", torch.randn(2, 260, generator=g), masked, 12, 2))
    # the large scores all in one group (column % G, G = 16 for k = 6): 24 keys reach the
    # threshold, more than half the capacity (the finish's full-size sort); with capacity k,
    # more than fit, and the row takes the radix select
    s = torch.rand(2, 300, generator=g)
    s[:, ::16] += 5.0
    cases.append(("one group", s, torch.zeros_like(s, dtype=torch.bool), 6, 2))
    s = torch.randint(0, 2, (2, 270), generator=g).float()  # C not a multiple of a segment
    cases.append(("ragged", s, torch.rand(2, 270, generator=g) < 0.2, 5, 5))
    return cases


def split_problems() -> list[str]:
    """:func:`select_topk`'s threshold path (forced ``segments``; and a capacity so small
    that rows fall back to the radix select) and its radix select against the reference
    ``indexer_topk`` on the same exact scores, best first and in column order."""
    from deepinfer_cuda_sm100.kernels import indexer as ki

    from deepinfer_core.ops.attention import indexer_topk as reference
    from deepinfer_core.ops.modes import batch_invariant_mode

    problems = []
    ratio = ki.FILTER_PER_HIT_RATIO
    try:
        for name, s, masked, k, segments in _split_cases():
            q, w, keys, cand = _op_inputs(s, masked)
            scores = s.masked_fill(masked, float("-inf"))
            # the threshold path with each filter (per-hit atomics: ratio 1; block-counted:
            # ratio 10**9), with the default capacity and a capacity of k, and with the sorting
            # programs at other widths; the radix select
            runs = [(segments, cap, r, None) for cap in (None, k) for r in (1, 10**9)]
            runs += [(segments, None, 10**9, (16, 32)), (0, None, ratio, None)]
            for bi in (False, True):
                with batch_invariant_mode(bi):
                    want = reference(q, w, keys, cand, k, 1.0)
                for seg, cap, r, widths in runs:
                    ki.FILTER_PER_HIT_RATIO = r
                    got = ki.select_topk(
                        scores, k, cand, column_order=bi, segments=seg, capacity=cap, sort_warps=widths
                    )
                    if not torch.equal(got, want):
                        where = f"segments={seg} capacity={cap} ratio={r} widths={widths} order={bi}"
                        problems.append(f"{name} {where}: differs")
    finally:
        ki.FILTER_PER_HIT_RATIO = ratio
    return problems


def _radix(scores, k, cand, column_order):
    from deepinfer_cuda_sm100.kernels import indexer as ki

    return ki.select_topk(scores, k, cand, column_order=column_order, segments=0)


def _rows(scores, k, cand, column_order):
    from deepinfer_cuda_sm100.kernels import indexer_rows as kr

    return kr.select_topk_rows(scores, k, cand, column_order=column_order)


def paged_problems(select=_radix) -> list[str]:
    """``select`` (default: the radix select) over paged candidates whose counts leave rows
    short (0, fewer than ``k``, ``k``, more, all: a causal chunk), one of them missing a page
    inside its count (its entries score ``-inf`` and are picked as ``-1``), against the
    reference ``indexer_topk`` on the same exact scores, best first and in column order."""
    from deepinfer_core.ops.attention import PagedIndex
    from deepinfer_core.ops.attention import indexer_topk as reference
    from deepinfer_core.ops.modes import batch_invariant_mode

    g = torch.Generator().manual_seed(11)
    epp, k = 4, 7
    problems = []
    for name, s in (
        ("random", torch.randn(9, 24, generator=g)),
        ("ties", torch.randint(-2, 3, (9, 24), generator=g).float()),
    ):
        t, c = s.shape
        counts = torch.tensor([0, 1, 6, 7, 8, 13, 24, 24, 3])
        masked = torch.arange(c)[None, :] >= counts[:, None]
        q, w, keys, _ = _op_inputs(s, masked)
        # entry e of token i is pool row i * c + e (the keys' layout): page p of row i is i * c / epp + p
        table = torch.arange(t * c // epp).view(t, c // epp)
        table[4, 1] = -1  # token 4 (8 entries) without its second page: 4 valid, fewer than k
        masked[4, epp : 2 * epp] = True  # -inf in the scores, as a kernel gives them; the reference
        # finds the entries invalid through the table
        cand = PagedIndex(table, torch.arange(t), counts, epp, c)
        scores = s.masked_fill(masked, float("-inf"))
        for bi in (False, True):
            with batch_invariant_mode(bi):
                want = reference(q, w, keys, cand, k, 1.0)
            got = select(scores, k, cand, bi)
            if not torch.equal(got, want):
                problems.append(f"{name} order={bi}: {got.tolist()} != {want.tolist()}")
    return problems


def rows_problems() -> list[str]:
    """The row selection (:mod:`deepinfer_cuda_sm100.kernels.indexer_rows`, several warp
    counts) against the reference ``indexer_topk`` on explicit candidates (the threshold
    path's cases: ties at the ``k``-th place, ``-inf`` holes, fewer valid candidates than
    ``k``; and ``k`` past the row, all scores equal, the extremes), on the paged cases, and
    against the radix select where the candidates are the columns themselves."""
    from deepinfer_cuda_sm100.kernels import indexer_rows as kr

    from deepinfer_core.ops.attention import indexer_topk as reference
    from deepinfer_core.ops.modes import batch_invariant_mode

    cases = [(name, s, masked, k) for name, s, masked, k, _ in _split_cases()]
    extremes = _scores(3, 40, seed=3)
    cases += [
        ("k past the row", torch.randn(2, 20), torch.zeros(2, 20, dtype=torch.bool), 33),
        ("all equal", torch.zeros(2, 64), torch.zeros(2, 64, dtype=torch.bool), 10),
        ("extremes", extremes.nan_to_num(neginf=0.0), extremes == float("-inf"), 12),
    ]
    problems = []
    for warps in (1, 4):
        for name, s, masked, k in cases:
            q, w, keys, cand = _op_inputs(s, masked)
            scores = s.masked_fill(masked, float("-inf"))
            for bi in (False, True):
                with batch_invariant_mode(bi):
                    want = reference(q, w, keys, cand, k, 1.0)
                got = kr.select_topk_rows(scores, k, cand, column_order=bi, warps=warps)
                if not torch.equal(got, want):
                    problems.append(f"{name} warps={warps} order={bi}: {got.tolist()} != {want.tolist()}")
                got = kr.select_topk_rows(scores, k, None, column_order=bi, warps=warps)
                if not torch.equal(got, _radix(scores, k, None, bi)):
                    problems.append(
                        f"{name} warps={warps} order={bi}: columns differ from the radix select's"
                    )
    g = torch.Generator().manual_seed(11)  # long-context decode rows (ties, -inf holes)
    s, masked = (
        torch.randint(-40, 40, (2, 16384), generator=g).float(),
        torch.rand(2, 16384, generator=g) < 0.1,
    )
    q, w, keys, cand = _op_inputs(s, masked)
    for bi in (False, True):
        with batch_invariant_mode(bi):
            want = reference(q, w, keys, cand, 512, 1.0)
        got = kr.select_topk_rows(s.masked_fill(masked, float("-inf")), 512, cand, column_order=bi)
        if not torch.equal(got, want):
            problems.append(f"long rows order={bi}: the picks differ from the reference's")
    return problems + [f"paged: {p}" for p in paged_problems(_rows)]


def interpreter_report() -> dict:
    """The interpreter checks as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    from deepinfer_cuda_sm100.kernels import _common

    return {
        "interpreted": _common.INTERPRETED,
        "split": split_problems(),
        "paged": paged_problems(),
        "rows": rows_problems(),
    }


def test_the_plan_splits_only_few_long_rows():
    from deepinfer_cuda_sm100.kernels.indexer import FILTER_MIN_COLUMNS, filter_groups, plan_select

    g, cap = filter_groups(512)
    assert g >= 1024 and cap >= 2048
    assert plan_select(128, 262144, 512, 132) > 1
    assert plan_select(8192, 2048, 512, 132) == 0  # short rows: one program each
    assert plan_select(128, FILTER_MIN_COLUMNS - 1, 512, 132) == 0
    assert plan_select(4, 262144, 4096, 132) == 0  # k too large for the threshold path
    for t, c in ((1, 262144), (128, 262144), (4096, 65536), (128, 16384)):
        s = plan_select(t, c, 512, 132)
        assert s == 0 or -(-c // s) >= 4 * g  # each segment at least 4 G columns


@pytest.mark.slow  # reads the report of a fresh interpreter running the kernels
def test_interpreter_radix_select_of_short_paged_rows_equals_the_reference(report):
    assert not report["paged"], "\n".join(report["paged"])


@pytest.mark.slow  # reads the report of a fresh interpreter running the kernels
def test_interpreter_row_selection_equals_the_reference(report):
    assert not report["rows"], "\n".join(report["rows"])


@pytest.mark.slow  # reads the report of a fresh interpreter running the kernels
def test_interpreter_threshold_path_equals_the_reference(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"
    assert not report["split"], "\n".join(report["split"])


# ---------------------------------------------------------------------------------------------
# compile for the GPU (no GPU needed): the host wrapper's real launch arguments, intercepted

MAX_SHARED = 232448
"""Shared memory one block may use on SM90 and SM100 (227 KiB)."""

_SELECT_KERNELS = (
    "_select_kernel",
    "_group_max_kernel",
    "_threshold_kernel",
    "_filter_kernel",
    "_finish_kernel",
)


def _recorded_select_launches(call: tuple, column_order: bool, monkeypatch, **kw) -> list[tuple]:
    """``(kernel, args, kwargs)`` of every launch :func:`select_topk` makes for ``call`` (and
    its keywords ``kw``; CPU tensors; no kernel runs)."""
    from cuda_sm100_checks import record_launches
    from deepinfer_cuda_sm100.kernels import indexer as ki

    launches = record_launches(monkeypatch, ki, _SELECT_KERNELS)
    ki.select_topk(*call, column_order=column_order, **kw)
    monkeypatch.undo()
    return launches


@pytest.mark.slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_select_kernels_compile_for_the_gpu(arch, monkeypatch):
    """Decode at long contexts (the threshold path, its radix fallback included, both orders;
    its sorting programs also at the widest widths the tuning times) and prefill rows (the
    radix select): every kernel compiles for ``sm_<arch>`` and fits in a block's shared
    memory."""
    t, c, k = 128, 262144, 512
    scores = torch.empty(t, c)
    epp = 64
    table = torch.zeros(t, c // epp, dtype=torch.int64)
    paged = PagedIndex(table, torch.arange(t), torch.full((t,), c), epp, c)
    calls = [
        ((scores, k, paged), False),
        ((scores, k, paged), True),
        ((torch.empty(128, 16384), k, None), False),  # the block-counted filter
        ((torch.empty(64, 2048), k, None), False),
    ]
    problems, seen = [], set()
    wide = {"sort_warps": (32, 32)}
    for call, column_order, kw in [(*c, {}) for c in calls] + [(calls[2][0], False, wide)]:
        for fn, args, kwargs in _recorded_select_launches(call, column_order, monkeypatch, **kw):
            key = (fn.fn.__name__, tuple(sorted(kwargs.items())))
            if key in seen:  # the same kernel, the same specialisation
                continue
            seen.add(key)
            compiled = compile_launch(fn, args, kwargs, arch)
            if compiled.metadata.shared > MAX_SHARED:
                problems.append(f"{key[0]} {kwargs}: {compiled.metadata.shared} bytes of shared memory")
    assert {key[0] for key in seen} == set(_SELECT_KERNELS)
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_row_selection_compiles_for_the_gpu(arch, monkeypatch):
    """The row selection at prefill rows (2,048 and 8,192 candidates) and its longest rows,
    paged (both orders, its default width) and explicit (one warp at 2,048), compiles for
    ``sm_<arch>`` within a block's shared memory."""
    from cuda_sm100_checks import record_launches
    from deepinfer_cuda_sm100.kernels import indexer_rows as kr

    launches = record_launches(monkeypatch, kr, ["_row_select_kernel"])
    for c in (2048, 8192, kr.ROW_MAX_COLUMNS):
        epp = 64
        paged = PagedIndex(
            torch.zeros(4, c // epp, dtype=torch.int64), torch.arange(4), torch.full((4,), c), epp, c
        )
        runs = [(paged, False, None), (paged, True, None)] + ([(None, False, 1)] if c == 2048 else [])
        for cand, column_order, warps in runs:
            kr.select_topk_rows(torch.empty(4, c), 512, cand, column_order=column_order, warps=warps)
    monkeypatch.undo()
    assert len(launches) == 7
    for fn, args, kwargs in launches:
        compiled = compile_launch(fn, args, kwargs, arch)
        assert compiled.metadata.shared <= MAX_SHARED, kwargs


def test_the_register_cap_is_offered_where_a_thread_holds_few_columns():
    """:func:`capped_registers` offers the cap where a thread of the row's program holds at
    most ``CAPPED_COLUMNS`` columns (prefill rows at their default width), else nothing."""
    from deepinfer_cuda_sm100.kernels import indexer_rows as kr

    assert kr.capped_registers(2048) == kr.capped_registers(1000) == kr.CAPPED_REGISTERS
    assert kr.capped_registers(2048, warps=1) is None  # 64 columns a thread
    assert kr.capped_registers(8192) is None and kr.capped_registers(16384) is None
    assert kr.capped_registers(2048, column_order=True) is None  # its build needs more registers


@pytest.mark.slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
def test_the_capped_row_selection_compiles_for_sm90_without_spills(monkeypatch):
    """Where :func:`capped_registers` offers the cap (paged rows of 2,048 columns, best first),
    the row selection compiles for sm_90 within it and without stack (spills), in as many
    instructions as at the compiler's choice, give or take 2 %."""
    from cuda_sm100_checks import cubin_resources, record_launches
    from deepinfer_cuda_sm100.kernels import indexer_rows as kr

    c, epp = 2048, 64
    cap = kr.capped_registers(c)
    rows = torch.zeros(4, c // epp, dtype=torch.int64)
    paged = PagedIndex(rows, torch.arange(4), torch.full((4,), c), epp, c)
    launches = record_launches(monkeypatch, kr, ["_row_select_kernel"])
    kr.select_topk_rows(torch.empty(4, c), 512, paged)
    kr.select_topk_rows(torch.empty(4, c), 512, paged, registers=cap)
    monkeypatch.undo()
    assert [kwargs.get("maxnreg") for _, _, kwargs in launches] == [None, cap]
    (free, capped) = [cubin_resources(compile_launch(*launch, 90).asm["cubin"]) for launch in launches]
    assert capped["STACK"] == free["STACK"] == 0 and capped["REG"] <= cap < free["REG"], (free, capped)
    assert abs(capped["SASS"] - free["SASS"]) <= 0.02 * free["SASS"], (free, capped)


# ---------------------------------------------------------------------------------------------
# GPU: the shapes the threshold path is for


def _long_rows(t: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random scores with ties, ``-inf`` holes and a short row, and explicit candidates."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.randn(t, c, device="cuda", generator=g)
    s[: t // 2] = torch.randint(-50, 50, (t // 2, c), device="cuda", generator=g).float()
    s[torch.rand(t, c, device="cuda", generator=g) < 0.1] = float("-inf")
    s[-1, 100:] = float("-inf")  # fewer valid candidates than k
    s[-2] = 0.0  # all equal
    cand = torch.randint(0, 1 << 30, (t, c), device="cuda", generator=g)
    return s, cand.masked_fill(s == float("-inf"), -1)


def _exact_picks(s: torch.Tensor, k: int, cand: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact ``torch.topk`` path's picks of ``s`` (best first), and the same picks in
    column order."""
    cols = torch.sort(ordered_keys(s), dim=1, descending=True).indices[:, :k].sort(dim=1).values
    return select_topk_torch(s, k, cand), torch.where(
        s.gather(1, cols) == float("-inf"), -1, cand.gather(1, cols)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 2048), (40, 8192), (33, 1000), (128, 16384), (9, 32768)])
def test_gpu_row_selection_equals_the_exact_torch_path(shape):
    """The row selection at prefill and long-context decode widths (ties, ``-inf`` holes,
    all-equal and short rows) equals the exact ``torch.topk`` path, best first and in column
    order, at its default width and every width worth timing, and replays in a CUDA graph."""
    from cuda_sm100_checks import replayed
    from deepinfer_cuda_sm100.kernels import indexer_rows as kr

    t, c = shape
    s, cand = _long_rows(t, c, seed=c)
    for k in (512, 77):
        want, want_cols = _exact_picks(s, k, cand)
        for warps in (None, *kr.candidate_warps(c)):
            assert torch.equal(kr.select_topk_rows(s, k, cand, warps=warps), want), (shape, k, warps)
            got = kr.select_topk_rows(s, k, cand, column_order=True, warps=warps)
            assert torch.equal(got, want_cols), (shape, k, warps, "column order")
        cap = kr.capped_registers(c)
        if cap is not None:  # the register cap --tune offers: the same picks
            assert torch.equal(kr.select_topk_rows(s, k, cand, registers=cap), want), (shape, k, cap)
        assert torch.equal(replayed(lambda k=k: kr.select_topk_rows(s, k, cand)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 16384), (128, 262144), (16, 100003)])
def test_gpu_threshold_path_equals_the_exact_torch_path(shape):
    from cuda_sm100_checks import replayed
    from deepinfer_cuda_sm100.kernels import indexer as ki

    t, c = shape
    s, cand = _long_rows(t, c, seed=c)
    for k in (512, 77):
        want, want_cols = _exact_picks(s, k, cand)
        for segments in (None, 1, 7):
            got = ki.select_topk(s, k, cand, segments=segments)
            assert torch.equal(got, want), (shape, k, segments)
            for widths in ((16, 16), (32, 32)):  # the sorting programs' widths the tuning times
                assert torch.equal(ki.select_topk(s, k, cand, segments=segments, sort_warps=widths), want)
            got = ki.select_topk(s, k, cand, segments=segments, column_order=True)
            assert torch.equal(got, want_cols), (shape, k, segments, "column order")
        assert torch.equal(replayed(lambda k=k: ki.select_topk(s, k, cand)), want)
    assert ki.plan_select(128, 262144, 512, torch.cuda.get_device_properties(0).multi_processor_count) > 0


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
