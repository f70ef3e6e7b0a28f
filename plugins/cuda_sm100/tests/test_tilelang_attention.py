"""The TileLang ``sparse_attention`` kernel and the choice between kernel languages.

**Here** (no GPU, no TileLang): the measured choice table (the shipped one parses and each of
its points has both languages; nearest-point choice, the default outside the measured token
range, on other architectures and among unavailable languages), the split plan, and which calls
the TileLang kernel refuses (with the reason) — all host-side logic, checked against what the
docstrings promise.

**GPU** (marked ``gpu``; skipped where TileLang cannot compile): the kernel against the reference
op on every plain-pool and every packed-FP8-pool conformance case at DeepSeek-V4-Flash shapes
that it takes (sliding, CSA
and HCA layers; decode and prefill tokens; ragged page counts, ``-1`` holes, a query with no key
at all), through the direct and the split-KV launch, and replay of a captured CUDA graph
(bitwise equal to the eager call).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from cuda_sm100_checks import loops_containing, lowered_sm90, pdl_prologue_problem, replayed
from deepinfer_cuda_sm100 import kernel_choice
from deepinfer_cuda_sm100.attention_dispatch import choice_kind, tilelang_supports
from deepinfer_cuda_sm100.tl import sparse_attention as tla
from deepinfer_cuda_sm100.tl import tilelang_problem

from deepinfer_core.ops.attention import PagedIndex
from deepinfer_core.ops.kv_format import Fp8KVPool

BOTH = frozenset({"triton", "tilelang"})


def _point(tokens: int, keys: int, tl: float, tr: float, kind: str = "rows") -> kernel_choice.Point:
    return kernel_choice.Point(
        "sparse_attention", kind, "bfloat16", 64, 512, tokens, keys, {"tilelang": tl, "triton": tr}
    )


def _choose(tokens: int, keys: int, points, kind: str = "rows", available=BOTH) -> str:
    return kernel_choice.choose(
        "sparse_attention", kind, "bfloat16", 64, 512, tokens, keys, "sm90", available, points=tuple(points)
    )


def test_shipped_table_parses_and_times_both_languages():
    """Every point times Triton and TileLang; the seesaw kernel's times appear beside them, and
    on plain and on packed FP8 pools it is somewhere the fastest."""
    points = [p for p in kernel_choice.load_points("sm90") if p.op == "sparse_attention"]
    assert points, "choices_sm90.json ships with the package"
    for p in points:
        assert {"triton", "tilelang"} <= set(p.ms) <= {"triton", "tilelang", "tilelang_ws"}
        assert all(ms > 0 for ms in p.ms.values())
    for packed in (False, True):
        wins = [min(p.ms, key=p.ms.get) for p in points if p.kind.endswith("+fp8") == packed]
        assert "tilelang_ws" in wins, f"packed={packed}: the seesaw kernel wins nowhere"
    assert kernel_choice.load_points("sm1") == ()


def test_a_tilelang_that_does_not_import_leaves_triton_serving_and_says_why(tmp_path, monkeypatch):
    """An installed TileLang whose native library fails to load is a problem, not a crash later."""
    (tmp_path / "tilelang").mkdir()
    (tmp_path / "tilelang" / "__init__.py").write_text(
        "raise OSError('libz3.so.4.15: cannot open shared object file')\n"
    )
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.delitem(__import__("sys").modules, "tilelang", raising=False)
    tilelang_problem.cache_clear()
    try:
        problem = tilelang_problem()
    finally:
        tilelang_problem.cache_clear()
    assert problem is not None and "does not import" in problem and "libz3.so.4.15" in problem


def test_choice_is_the_fastest_language_at_the_nearest_point():
    points = [_point(32, 768, tl=1.0, tr=2.0), _point(256, 768, tl=3.0, tr=2.0)]
    assert _choose(40, 700, points) == "tilelang"  # nearest: 32 tokens
    assert _choose(200, 768, points) == "triton"  # nearest: 256 tokens
    assert _choose(64, 768, points, available=frozenset({"triton"})) == "triton"


def test_a_near_tie_keeps_the_default_language():
    margin = kernel_choice.MARGIN
    tie = [_point(32, 768, tl=1.0, tr=1.0 + margin / 2)]
    assert _choose(32, 768, tie) == kernel_choice.DEFAULT_LANGUAGE
    clear = [_point(32, 768, tl=1.0, tr=1.0 + 2 * margin)]
    assert _choose(32, 768, clear) == "tilelang"


def test_choice_defaults_outside_the_measured_range_and_without_a_table():
    points = [_point(32, 768, tl=1.0, tr=2.0), _point(256, 768, tl=1.0, tr=2.0)]
    assert _choose(1, 768, points) == kernel_choice.DEFAULT_LANGUAGE  # fewer tokens than measured
    assert _choose(8192, 768, points) == kernel_choice.DEFAULT_LANGUAGE  # a prefill chunk: unmeasured
    assert _choose(64, 768, points, kind="paged") == kernel_choice.DEFAULT_LANGUAGE  # no paged points
    assert (
        kernel_choice.choose("sparse_attention", "rows", "bfloat16", 64, 512, 64, 768, "sm1", BOTH)
        == kernel_choice.DEFAULT_LANGUAGE
    )


@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 131, 132, 500])
@pytest.mark.parametrize("keys", [0, 64, 768, 1 << 20])
def test_split_plan_covers_the_sms_without_starving_a_split(tokens, keys):
    sms = 132
    s = tla.plan_splits(tokens, 64, keys, sms)
    assert s >= 1
    if tokens >= sms:
        assert s == 1  # enough CTAs already
    if s > 1:
        blocks = -(-keys // tla.BN)
        per_split = -(-blocks // s)
        assert per_split >= tla.MIN_SPLIT_BLOCKS  # every split gets its share of blocks
        assert -(-blocks // per_split) == s  # no split left without blocks
        assert tokens * s <= sms  # one wave of CTAs
        assert -(-blocks // (s + 1)) == per_split or tokens * (s + 1) > sms  # more splits: no gain


@pytest.mark.parametrize(("tokens", "splits"), [(1, 12), (4, 12), (16, 6), (32, 4), (64, 2), (131, 1)])
def test_split_plan_at_the_measured_shapes(tokens, splits):
    # 768 keys (12 blocks) on 132 SMs: the sweep's best split counts (bench_attention.py --tune)
    assert tla.plan_splits(tokens, 64, 768, 132) == splits


def _call(t=4, h=64, d=512, dtype=torch.bfloat16, third="rows"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    ring, kv, ckv = (torch.randn(n, d, generator=g).to(dtype) for n in (16, t, 32))
    idx = [torch.zeros(t, 8, dtype=torch.long), torch.zeros(t, 2, dtype=torch.long)]
    idx.append(
        PagedIndex(torch.arange(4).view(1, 4), torch.zeros(t, dtype=torch.long), torch.full((t,), 5), 8, 32)
        if third == "paged"
        else torch.zeros(t, 8, dtype=torch.long)
    )
    return q, [ring, kv, ckv], idx, torch.zeros(h), d**-0.5


def test_tilelang_takes_plain_v4_calls_and_names_what_it_refuses():
    assert tilelang_supports(*_call()) is True
    assert tilelang_supports(*_call(third="paged")) is True
    q, pools, idx, sinks, scale = _call()
    assert "float32" in tilelang_supports(q.float(), pools, idx, sinks, scale)
    assert "heads" in tilelang_supports(*_call(h=8))
    assert "head dim" in tilelang_supports(*_call(d=576))
    packed = [Fp8KVPool.from_values(p, 64) for p in pools]
    assert tilelang_supports(q, packed, idx, sinks, scale) is True  # the FP8 kernel
    assert "one format" in tilelang_supports(q, [packed[0], *pools[1:]], idx, sinks, scale)
    assert "one format" in tilelang_supports(q, [pools[0], *packed[1:]], idx, sinks, scale)
    assert "bfloat16" in tilelang_supports(q.half(), packed, idx, sinks, scale)
    assert choice_kind(idx, packed) == "rows+fp8" and choice_kind(idx, pools) == "rows"
    q, pools, paged_idx, sinks, scale = _call(third="paged")
    assert "paged index" in tilelang_supports(q, pools[::-1], paged_idx[::-1], sinks, scale)
    assert "sources" in tilelang_supports(q, pools[:1], idx[:1], sinks, scale)
    odd = torch.randn(16, 513).to(torch.bfloat16)[:, :512]  # rows 513 apart: not 16-byte aligned
    assert "aligned" in tilelang_supports(q, [odd, *pools[1:]], idx, sinks, scale)
    import dataclasses

    huge = dataclasses.replace(paged_idx[-1], max_count=1 << 30)  # past the exact page division
    assert "2**30" in tilelang_supports(q, pools, [*paged_idx[:-1], huge], sinks, scale)


def test_split_kinds_and_key_counts_follow_the_sources():
    q, pools, idx, sinks, scale = _call(third="paged")
    assert tla.third_kind(idx) == "paged" and tla.max_keys(idx) == 8 + 2 + 32
    assert tla.third_kind(idx[:2]) is None and tla.third_kind(_call()[2]) == "rows"


def test_paged_index_tensors_go_to_the_kernel_as_the_engine_builds_them():
    """The kernel reads a paged source's block table and token rows in the contract's int64:
    contiguous int64 tensors (the step plans') are passed as they are, no conversion launch per
    call; another integer dtype or a strided view is copied to contiguous int64, values kept."""
    table = torch.arange(12).view(3, 4)
    rows = torch.tensor([2, 0, 1])
    assert tla.index_int64(table) is table and tla.index_int64(rows) is rows
    for x in (table.to(torch.int32), table.t(), rows.to(torch.int32)):
        y = tla.index_int64(x)
        assert y.dtype == torch.int64 and y.is_contiguous() and torch.equal(y, x.long())


# ---------------------------------------------------------------------------------------------
# GPU


def _map_rows(pool, fn):
    """``fn`` applied to a pool's rows (a plain tensor, or a packed pool's bytes)."""
    return Fp8KVPool(fn(pool.data), pool.dim, pool.rope_dim) if isinstance(pool, Fp8KVPool) else fn(pool)


def _repeated(case, rep: int):
    """A call of ``rep`` times the tokens: each query again with its own keys (the step's rows
    of the copies in copies of that pool)."""
    (q, pools, idx, sinks, scale), kw = case
    t = q.shape[0]
    step_rows = torch.where(idx[1] >= 0, idx[1][None] + t * torch.arange(rep)[:, None, None], -1)
    third = idx[2:]  # none (a sliding layer's call) or one
    if third and isinstance(third[0], PagedIndex):
        p = third[0]
        third = [
            PagedIndex(
                p.block_table, p.token_rows.repeat(rep), p.counts.repeat(rep), p.entries_per_page, p.max_count
            )
        ]
    elif third:
        third = [third[0].repeat(rep, 1)]
    pools = [pools[0], _map_rows(pools[1], lambda x: x.repeat(rep, 1)), *pools[2:]]
    idx = [idx[0].repeat(rep, 1), step_rows.flatten(0, 1), *third]
    return (q.repeat(rep, 1, 1), pools, idx, sinks, scale), kw


def _v4_cases(kv: str = "plain"):
    from deepinfer_cuda_sm100.attention_ops import V4_FLASH, attention_cases
    from test_attention_kernels import _to

    g = torch.Generator().manual_seed(1)
    cases = attention_cases(V4_FLASH, kv=kv)(g, torch.bfloat16)
    (q, pools, idx, sinks, scale), kw = cases[-1]  # long context, a paged source first: reordered
    cases.append(((q, pools[1:] + pools[:1], idx[1:] + idx[:1], sinks, scale), kw))
    # the widest sliding, CSA (rows) and HCA (paged) calls 4x over: more CTAs than SMs, one split
    for kind in (None, "rows", "paged"):
        third = [
            c
            for c in cases
            if all(isinstance(i, torch.Tensor) for i in c[0][2][:2]) and tla.third_kind(c[0][2]) == kind
        ]
        if third:
            widest = max(third, key=lambda c: c[0][0].shape[0])
            cases.append(_repeated(widest, max(4, -(-160 // widest[0][0].shape[0]))))
    out = []
    for (q, pools, idx, sinks, scale), _ in cases:
        args = _to((q, pools, idx, sinks, scale), "cuda")
        if tilelang_supports(*args) is True:
            out.append(args)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["plain", "fp8"])
def test_gpu_tilelang_matches_the_reference_at_v4_flash_shapes(kv):
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")
    from deepinfer_core.ops.attention import sparse_attention as reference

    cases = _v4_cases(kv)
    assert len(cases) >= 6  # sliding, CSA and HCA at several token counts
    kinds = set()
    for args in cases:
        t = args[0].shape[0]
        splits = tla.plan_splits(t, 64, tla.max_keys(args[2]), tla.num_sms(args[0].device))
        kinds.add((tla.third_kind(args[2]), splits > 1))
        want = reference(*args).float()
        got = tla.sparse_attention(*args).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert kinds >= {(None, False), ("rows", True), ("rows", False), ("paged", True), ("paged", False)}


@pytest.mark.gpu
def test_gpu_tilelang_replays_in_a_cuda_graph_bitwise():
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")
    for args in _v4_cases()[:3] + _v4_cases("fp8")[:3]:
        eager = tla.sparse_attention(*args)
        assert torch.equal(replayed(lambda args=args: tla.sparse_attention(*args)), eager)


@pytest.mark.gpu
def test_gpu_combine_from_loads_issued_first_equals_its_loop_bitwise():
    """The split combine with every split's loads issued before the merge (at most
    ``UNROLLED_SPLITS`` splits) gives its loop form's bits (``unrolled=0``), at one to two more
    splits than it unrolls, and both the merge of the partials (a float32 reference)."""
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")
    from deepinfer_cuda_sm100.tl.pdl import tl_pdl_enabled

    g = torch.Generator(device="cuda").manual_seed(0)
    for splits in range(1, tla.UNROLLED_SPLITS + 3):
        part = torch.randn(5, splits, 64, 512, device="cuda", generator=g)
        m = torch.randn(5, splits, 64, device="cuda", generator=g) * 8
        l = torch.rand(5, splits, 64, device="cuda", generator=g) * 100 + 1  # noqa: E741
        outs = []
        for unrolled in (tla.UNROLLED_SPLITS, 0):
            out = torch.empty(5, 64, 512, dtype=torch.bfloat16, device="cuda")
            pdl = tl_pdl_enabled()
            kernel = tla._kernel("combine", False, False, 64, 512, "bfloat16", None, pdl, unrolled)
            kernel(part, torch.stack([m, l], -1).contiguous(), out)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"{splits} splits"
        w = torch.exp2(m - m.amax(1, keepdim=True))
        want = (part * w[..., None]).sum(1) / (l * w).sum(1)[..., None]
        torch.testing.assert_close(outs[0].float(), want, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# lowering (where TileLang imports, no GPU needed)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("kv", ["plain", "fp8"])
def test_with_pdl_the_kernels_wait_before_any_global_access(kv):
    """With ``pdl`` the attention kernels (this module's and the seesaw one, direct and split)
    and the split combine wait for the kernel before them (``griddepcontrol.wait``) before they
    read or write global memory (their inputs come from it: the prologue's counts, the cache
    rows, the partials), then let the next kernel be scheduled; TileLang marks them for a PDL
    launch.  Without ``pdl`` none of it is there."""
    from deepinfer_cuda_sm100.tl import sparse_attention_ws as tlw

    from deepinfer_core.ops.kv_format import fp8_row_layout

    lay = fp8_row_layout(512, 64)
    fp8 = None if kv == "plain" else tla.Fp8Geometry(lay.nope, lay.rope_offset, lay.scale_offset, lay.groups)
    configs = {"tl.disable_safe_memory_legalize": True}
    funcs = [
        (tla.build_attention(True, True, 64, 512, "bfloat16", fp8, True), configs),
        (tlw.build_attention_ws(True, False, 64, 512, "bfloat16", fp8, True), tlw.pass_configs(fp8)),
        (tla.build_combine(64, 512, "bfloat16", True), {}),
    ]
    accesses = r"(cp_async_gs|tma_load|\bq\[|\bnvalid\[|\bpart\[|\bml\[)"
    for func, passes in funcs:
        assert pdl_prologue_problem(func, accesses, passes) is None
    plain = lowered_sm90(tla.build_attention(True, True, 64, 512, "bfloat16", fp8), configs)
    assert "cudaGridDependencySynchronize" not in plain


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("kv", ["plain", "fp8"])
def test_the_gather_and_dequantisation_loops_have_no_block_barrier(kv):
    """Lowered for sm_90, no loop that issues the key gathers (``cp.async``) or converts the
    packed FP8 values into the key tile waits at a block barrier in every iteration (TileLang
    puts one there when such a loop reads one buffer of the dynamic shared memory and writes
    another; the kernels keep those reads in static shared memory or registers)."""
    from deepinfer_core.ops.kv_format import fp8_row_layout

    lay = fp8_row_layout(512, 64)
    fp8 = None if kv == "plain" else tla.Fp8Geometry(lay.nope, lay.rope_offset, lay.scale_offset, lay.groups)
    src = lowered_sm90(
        tla.build_attention(True, False, 64, 512, "bfloat16", fp8), {"tl.disable_safe_memory_legalize": True}
    )
    loops = loops_containing(src, "cp_async_gs")
    if fp8 is not None:
        loops += loops_containing(src, "__float22bfloat162_rn")
    assert loops, "no gather loop found in the generated source"
    assert all("__syncthreads" not in body for body in loops), "a block barrier in a gather loop"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
def test_the_combine_loads_every_split_before_it_merges():
    """Lowered for sm_90: up to ``UNROLLED_SPLITS`` splits, a thread loads every split's
    ``m``, ``l`` and values (each behind its check of the split count) before it takes the
    first maximum; more splits take the loop; ``unrolled=0`` has the loop alone."""
    u = tla.UNROLLED_SPLITS
    body = lowered_sm90(tla.build_combine(64, 512, "bfloat16"), {})
    body = body[body.index("__global__ void __launch_bounds__") :]
    first_max = body.index("mx = max(mx, m_s[0])")
    assert body.index(f"if (S <= {u})") < body.index("m_s[0] = ml[")
    for s in range(u):
        assert body.index(f"if ({s} < S)") < body.index(f"m_s[{s}] = ml[") < first_max
        assert body.index(f"*(float4*)(p_s + {4 * s}) = *(float4*)(part + ") < first_max
    assert f"if ({u} < S)" not in body and "} else {" in body[first_max:]
    assert "< S; ++s" in body[first_max:]  # the loop beyond
    looped = lowered_sm90(tla.build_combine(64, 512, "bfloat16", unrolled=0), {})
    assert "m_s[" not in looped and "< S; ++s" in looped
