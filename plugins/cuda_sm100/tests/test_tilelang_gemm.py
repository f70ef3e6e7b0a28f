"""The TileLang FP8 GEMM (:mod:`deepinfer_cuda_sm100.tl.fp8_gemm`) and its place among
``linear``'s paths (:mod:`deepinfer_cuda_sm100.gemm_dispatch`).

**Here** (no GPU): the launch plan (token tile, K splits covering K in equal whole-block
ranges, the fewest splits that fill the GPU), the tile kinds (the wide tiles' stages fit one
SM's shared memory), which calls the kernel refuses (with the reason), the dispatcher's rules
(never off the GPU, TileLang's absence logged once, the measured table decides among the usable
paths) and the precompiled configurations covering every ``M <= 256``.  Where TileLang imports,
one shape's configurations lower for sm_90, the wide tiles with two consumer warpgroups of 64
weight rows fencing exactly their accumulators; where ``nvcc`` is found too, the wide tiles
compile to sm_90a code without spills (slow).

**GPU** (marked ``gpu``; skipped where TileLang cannot compile): the kernel against the
reference op at V4-Flash shapes for ``M`` in 1, 7, 16, 33, 64 and (wide tiles) 65, 100, 128,
200, 256 with float32 and ue8m0 scales (within the op's tolerance, and no less accurate than
the reference against a float64 product), and the replay of a captured CUDA graph (bitwise
equal to the eager call).
"""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from cuda_sm100_checks import lowered_sm90, sm90a_cubin
from deepinfer_cuda_sm100 import gemm_dispatch, kernel_choice
from deepinfer_cuda_sm100.tl import fp8_gemm as tlg
from deepinfer_cuda_sm100.tl import tilelang_problem

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")
from test_gemm_dispatch import _weight  # noqa: E402  (zero and large blocks, both scale formats)

V4_SHAPES = ((4096, 1024), (1024, 32768), (4096, 512), (8192, 4096), (4096, 2048), (2048, 4096))
"""``K x N`` of DeepSeek-V4-Flash's FP8 dense projections."""
DECODE_M = (1, 7, 16, 33, 64)
WIDE_M = (65, 100, 128, 200, 256)
"""Token counts on the wide tiles (128 and 256 tokens)."""
SMEM_PER_CTA = 227 * 1024
"""An H100 / H200 CTA's shared memory at most."""


# ---------------------------------------------------------------------------------------------
# launch plan


@pytest.mark.parametrize("sms", [132, 78])
@pytest.mark.parametrize(("k", "n"), V4_SHAPES)
def test_launch_plan_covers_k_in_equal_ranges_with_the_fewest_splits_that_fill_the_gpu(k, n, sms):
    k_blocks = k // 128
    for m in range(1, 257):
        plan = tlg.launch_plan(m, n, k, sms)
        assert plan.block_m == min(bm for bm in (16, 32, 64, 128, 256) if bm >= m)
        wide = m > 64
        tiles = n // (128 if wide else 64)
        target = (tlg.WIDE_CTAS_PER_SM_TARGET if wide else tlg.CTAS_PER_SM_TARGET) * sms
        assert plan.splits * plan.blocks_per_split == k_blocks, "every K block exactly once"
        assert plan.blocks_per_split >= tlg.MIN_SPLIT_BLOCKS
        assert plan.grid == (tiles, plan.splits)
        assert 1 <= plan.stages <= min(tlg.tile(plan.block_m).max_stages, plan.blocks_per_split)
        fewer = [s for s in range(1, plan.splits) if k_blocks % s == 0]
        assert all(tiles * s < target for s in fewer), "not the fewest"
        more = [s for s in range(plan.splits + 1, k_blocks + 1) if k_blocks % s == 0 and k_blocks // s >= 2]
        assert tiles * plan.splits >= target or not more, "could split further"


def test_tile_kinds_fit_the_sm():
    """Narrow tiles: 64 weight rows, one consumer warpgroup; wide: 128 rows (one wgmma atom per
    warpgroup), two warpgroups, and their stages of weight bytes and bf16 activations within a
    CTA's shared memory (the epilogue's buffer, at most the fp32 tile, within the stages)."""
    for bm in (16, 32, 64):
        assert tlg.tile(bm)[:3] == (64, 128, 4)
    for bm in (128, 256):
        block_n, threads, stages, _ = tlg.tile(bm)
        assert (block_n, threads) == (128, 256)
        stage_bytes = block_n * 128 + bm * 128 * 2
        assert stages >= 2 and stages * stage_bytes + 1024 <= SMEM_PER_CTA, bm
        assert (stages + 1) * stage_bytes > 192 * 1024, f"{bm}: room for another stage"
        assert bm * block_n * 4 <= stages * stage_bytes, "the fp32 epilogue tile fits over the stages"
    assert tlg.tile(128).max_stages == 4 and tlg.tile(256).max_stages == 2


@pytest.mark.parametrize(("k", "n"), V4_SHAPES)
def test_the_wide_kind_at_decode_token_counts_plans_128_row_tiles(k, n):
    """``wide=True`` at ``M <= 64`` (a probe ``bench_fp8_gemm.py`` times): the same token tile,
    128 weight rows a CTA, the wide kind's split target, stages within the SM's shared memory."""
    k_blocks = k // 128
    for m in (1, 16, 17, 33, 64):
        plan, narrow = tlg.launch_plan(m, n, k, 132, wide=True), tlg.launch_plan(m, n, k, 132)
        kind = tlg.tile(plan.block_m, wide=True)
        assert plan.block_m == narrow.block_m and kind[:2] == (128, 256)
        assert plan.grid == (n // 128, plan.splits) and plan.splits * plan.blocks_per_split == k_blocks
        fewer = [s for s in range(1, plan.splits) if k_blocks % s == 0]
        assert all(n // 128 * s < tlg.WIDE_CTAS_PER_SM_TARGET * 132 for s in fewer), "not the fewest"
        stage_bytes = 128 * 128 + plan.block_m * 128 * 2
        assert 1 <= plan.stages <= kind.max_stages and kind.max_stages * stage_bytes <= SMEM_PER_CTA
    assert tlg.launch_plan(100, 4096, 4096, 132, wide=True) == tlg.launch_plan(100, 4096, 4096, 132)


def test_wide_weights_take_no_split():
    assert tlg.launch_plan(1, 32768, 1024, 132).splits == 1  # 512 CTAs of 64 rows already


# ---------------------------------------------------------------------------------------------
# supports


def _x(m: int, k: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(m, k, dtype=dtype)


def test_problem_takes_v4_decode_calls_and_names_what_it_refuses():
    g = torch.Generator().manual_seed(0)
    w = _weight(g, 256, 384)
    for m in DECODE_M + WIDE_M:
        assert tlg.problem(_x(m, 384), w) is None, m
    assert tlg.problem(torch.zeros(2, 3, 384, dtype=torch.bfloat16), w) is None  # [..., K] rows
    assert tlg.problem(_x(4, 384), _weight(g, 128, 256, "ue8m0")) is None
    cases = {
        "bfloat16": (_x(4, 384, torch.float16), w),
        "1 to 256": (_x(257, 384), w),
        "0 rows": (_x(0, 384), w),
        "multiples of 128": (_x(4, 320), _weight(g, 256, 320)),
        "128x128 blocks": (_x(4, 384), torch.zeros(256, 384, dtype=torch.bfloat16)),
    }
    for needle, (x, weight) in cases.items():
        verdict = tlg.problem(x, weight)
        assert verdict is not None and needle in verdict, (needle, verdict)
    from deepinfer_core.weights.quant import QuantizedTensor

    strided = QuantizedTensor(w.data.t().contiguous().t(), w.scale, "fp8", (128, 128))
    assert "contiguous" in tlg.problem(_x(4, 384), strided)


def test_problem_takes_the_grouped_projection_and_names_what_it_refuses():
    g = torch.Generator().manual_seed(7)
    w = _weight(g, 2 * 128, 384)
    for m in (1, 64, 256):
        assert tlg.problem(torch.zeros(m, 2, 384, dtype=torch.bfloat16), w, groups=2) is None, m
    cases = {
        "[T, 2, 384]": (torch.zeros(4, 3, 384, dtype=torch.bfloat16), w, 2),  # groups in x != G
        "multiple of 128 rows a group": (torch.zeros(4, 4, 384, dtype=torch.bfloat16), w, 4),  # 64 rows
        "1 to 256": (torch.zeros(257, 2, 384, dtype=torch.bfloat16), w, 2),
    }
    for needle, (x, weight, groups) in cases.items():
        verdict = tlg.problem(x, weight, groups)
        assert verdict is not None and needle in verdict, (needle, verdict)


def test_scale_kind_names_the_format():
    g = torch.Generator().manual_seed(1)
    assert tlg.scale_kind(_weight(g, 128, 128)) == "fp32"
    assert tlg.scale_kind(_weight(g, 128, 128, "ue8m0")) == "ue8m0"


# ---------------------------------------------------------------------------------------------
# dispatch


def test_tilelang_absence_is_logged_once_and_the_other_paths_serve(monkeypatch, caplog):
    from deepinfer_cuda_sm100 import tl

    g = torch.Generator().manual_seed(2)
    w = _weight(g, 256, 256)
    monkeypatch.setattr(tl, "tilelang_problem", lambda: "TileLang is not installed (hint)")
    tl._warn_unusable.cache_clear()
    with caplog.at_level(logging.WARNING, logger="deepinfer.cuda_sm100"):
        assert gemm_dispatch.tilelang_usable(_x(4, 256), w) is False
        assert gemm_dispatch.tilelang_usable(_x(8, 256), w) is False
    assert [r.getMessage() for r in caplog.records].count(
        "linear (FP8): TileLang is not installed (hint); the Triton and cuBLAS paths serve every call"
    ) == 1
    monkeypatch.setattr(tl, "tilelang_problem", lambda: None)
    assert gemm_dispatch.tilelang_usable(_x(4, 256), w) is True
    assert gemm_dispatch.tilelang_usable(_x(4, 256, torch.float16), w) is False  # the kernel refuses
    tl._warn_unusable.cache_clear()


def test_off_the_gpu_the_dispatcher_never_takes_tilelang():
    g = torch.Generator().manual_seed(3)
    assert gemm_dispatch.choose_path(_x(4, 256), _weight(g, 256, 256)) == "triton"


def _points(n: int = 1024, k: int = 4096):
    def point(m, ms):
        return kernel_choice.Point(gemm_dispatch.OP, "w8a16", "bfloat16", n, k, m, k, ms)

    return (
        point(1, {"triton": 5.0, "cublas": 6.0, "tilelang": 3.0}),
        point(64, {"triton": 12.0, "cublas": 6.0, "tilelang": 7.0}),
        point(256, {"triton": 20.0, "cublas": 9.0}),  # prefill: no TileLang time
    )


def test_the_table_picks_tilelang_only_where_it_measured_fastest_and_usable():
    paths = gemm_dispatch.PATHS["w8a16"]
    assert "tilelang" in paths

    def pick(m, available=paths):
        return kernel_choice.choose(
            gemm_dispatch.OP, "w8a16", "bfloat16", 1024, 4096, m, 4096, "sm90", available, points=_points()
        )

    assert [pick(m) for m in (1, 4, 64, 256)] == ["tilelang", "tilelang", "cublas", "cublas"]
    assert pick(1, paths - {"tilelang"}) == "triton"  # TileLang unusable: the next fastest


# ---------------------------------------------------------------------------------------------
# precompile


def test_precompile_lists_every_launch_of_the_v4_shapes():
    from deepinfer_cuda_sm100.tl.precompile import GEMM_SHAPES, GROUPED_SHAPES, gemm_configurations

    configs = set(gemm_configurations(GEMM_SHAPES, 132, GROUPED_SHAPES))
    pdl = tlg.tl_pdl_enabled()
    for m in range(1, 257):  # V4-Flash's o_a: 8 groups of 4096 -> 1024, one launch
        plan = tlg.launch_plan(m, 8 * 1024, 4096, 132)
        fused = (False, True) if plan.splits > 1 else ()  # the splits summed in the launch
        for kind in tlg.SCALE_KINDS:
            key = ("gemm", 8192, 4096, plan.block_m, plan.splits, plan.stages, kind, pdl, 8, *fused)
            assert key in configs
    assert {c[3] for c in configs if c[0] == "gemm"} == {16, 32, 64, 128, 256}
    for k, n in V4_SHAPES:
        for m in range(1, 257):
            plan = tlg.launch_plan(m, n, k, 132)
            fused = (False, True) if plan.splits > 1 else ()  # the splits summed in the launch
            for kind in tlg.SCALE_KINDS:
                assert ("gemm", n, k, plan.block_m, plan.splits, plan.stages, kind, pdl, 1, *fused) in configs
    assert not any(c[0] == "combine" for c in configs)


def test_every_precompile_job_binds_to_its_modules_kernel():
    """Each job names the module whose ``_kernel`` takes its arguments (kernels of different
    modules share kind names such as ``combine``)."""
    import inspect

    from deepinfer_cuda_sm100.tl import precompile

    jobs = precompile.jobs(precompile.parse_args(["--gemm-shapes", "4096x1024"]))
    assert {module for module, _ in jobs} == {
        "sparse_attention",
        "sparse_attention_ws",
        "moe",
        "fp8_gemm",
        "indexer",
        "indexer_grouped",
    }
    for module, config in jobs:
        kernel = importlib.import_module(f"deepinfer_cuda_sm100.tl.{module}")._kernel
        inspect.signature(kernel).bind(*config)


# ---------------------------------------------------------------------------------------------
# lowering (where TileLang imports, no GPU needed)


def _lower(config: tuple) -> str:
    """The CUDA source of a ``_kernel`` configuration, lowered for sm_90."""
    build = tlg.build_gemm if config[0] == "gemm" else tlg.build_combine
    return lowered_sm90(build(*config[1:]), tlg.PASS_CONFIGS)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
def test_the_v4_configurations_lower_for_sm90():
    """One shape's configurations (the others: ``tl.precompile`` on a GPU machine)."""
    import re

    for config in tlg.configurations(1024, 4096, 132):
        src = _lower(config)
        if config[0] != "gemm":
            continue
        bm = config[3]
        bf16 = "tl::DataType::kBFloat16"
        wgmma = f"wgmma_rs<{bf16}, {bf16}, tl::DataType::kFloat32, 64, {bm}, 16"
        assert wgmma in src, "register-A wgmma: 64 weight rows (per warpgroup) x BLOCK_M tokens"
        assert "tma_load(w_desc" in src
        # narrow: two CTAs an SM, no register split; wide: the consumers' registers raised
        assert ("warpgroup_reg_alloc" in src) == (bm > 64), bm
        # each consumer thread holds a 64 x BLOCK_M fp32 accumulator, and its fence names no more
        assert re.search(rf"float acc\[{bm // 2}\];", src), bm
        fences = {
            int(c) for c in re.findall(r"fence_operand\(reinterpret_cast<float\*>\(acc \+ 0\), (\d+)\)", src)
        }
        assert fences == {bm // 2}, (bm, fences)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("block_m", [16, 64])
def test_the_wide_kind_lowers_at_decode_token_tiles(block_m):
    """``wide=True`` at 16 / 64 tokens: each of the two consumer warpgroups its own 64 weight rows
    against the CTA's tokens, their registers raised, its fence on its own accumulator."""
    import re

    plan = tlg.launch_plan(block_m, 8192, 1024, 132, wide=True)
    src = _lower(("gemm", 8192, 1024, plan.block_m, plan.splits, plan.stages, "ue8m0", True, 1, True))
    bf16 = "tl::DataType::kBFloat16"
    assert f"wgmma_rs<{bf16}, {bf16}, tl::DataType::kFloat32, 64, {block_m}, 16" in src
    assert "warpgroup_reg_alloc" in src and "tma_load(w_desc" in src
    assert re.search(rf"float acc\[{block_m // 2}\];", src), block_m
    narrow = _lower(("gemm", 8192, 1024, block_m, 2, 4, "ue8m0", True, 1))
    assert "warpgroup_reg_alloc" not in narrow


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("block_m", [16, 256])
def test_a_grouped_ctas_activation_tile_comes_from_its_groups_inputs(block_m):
    """Grouped (8 groups of 4096 -> 1024): ``x`` is ``[M, 8 * 4096]`` and CTA ``nb``'s TMA loads
    of the activations start at column ``4096 (BLOCK_N nb / 1024)`` (plus its split's K range);
    the weight's and the output's addressing are the dense GEMM's over ``8192`` rows."""
    import re

    block_n = tlg.tile(block_m).block_n
    plan = tlg.launch_plan(block_m, 8192, 4096, 132)
    src = _lower(("gemm", 8192, 4096, plan.block_m, plan.splits, plan.stages, "ue8m0", False, 8))
    loads = re.findall(r"tma_load\(x_desc, [^;]*;", src)
    assert loads, src[:2000]
    shift = (1024 // block_n).bit_length() - 1  # nb * BLOCK_N // 1024 as TileLang simplifies it
    assert all(f"(((int)blockIdx.x) >> {shift}) * 4096)" in load for load in loads), loads
    dense = _lower(("gemm", 8192, 4096, plan.block_m, plan.splits, plan.stages, "ue8m0", False, 1))
    assert all("blockIdx.x" not in load for load in re.findall(r"tma_load\(x_desc, [^;]*;", dense))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("block_m", [16, 256])
def test_the_fused_split_reduction_lowers_to_a_last_cta_sum_in_split_order(block_m):
    """``fused``: after its partial's stores every consumer thread fences them GPU-wide, one
    thread counts the CTA's arrival in the tile's counter (acquire-release), and the CTA that
    arrives last fences again, sums the ``splits`` partials in a loop over the splits in order,
    writes ``y`` in bf16 and resets the counter; the partial's stores come before the count."""
    import re

    src = _lower(("gemm", 4096, 1024, block_m, 4, 2, "ue8m0", True, 1, False, True))
    body = src[src.index("fp8_gemm_fused_kernel(") :]
    count = re.search(r"AtomicAddRet\(\(&\(counters\[\(\(int\)blockIdx\.x\)\]\)\), 1, (\d)\)", body)
    assert count and count.group(1) == "4", "one acquire-release count per CTA in its tile's counter"
    assert body.index("(ws + ") < body.index("__threadfence();") < count.start()
    last = body.index("[0] == 3)", count.end())  # the fourth of 4 to arrive
    assert "__threadfence();" in body[last : last + 200]
    assert re.search(r"for \(int sp = 0; sp < 4; \+\+sp\)", body[last:]), "the splits summed in order"
    assert "(y + " in body[last:] and re.search(r"counters\[\(\(int\)blockIdx\.x\)\] = 0;", body[last:])
    plain = _lower(("gemm", 4096, 1024, block_m, 4, 2, "ue8m0", True, 1))
    assert "AtomicAddRet" not in plain and "(y + " not in plain


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize("block_m", [16, 256])
def test_the_pdl_prologue_reads_only_the_scales_before_its_wait(block_m):
    """With ``pdl`` the GEMM reads only its weight's block scales (which no kernel of a step
    writes) before it waits for the kernel before it (``griddepcontrol.wait``), so their
    latency overlaps that kernel's tail; the weights' and activations' TMA loads and the
    output come after the wait, then the next kernel is let be scheduled.  The kernel is
    marked for a PDL launch.  Without ``pdl`` none of it is there."""
    import tilelang
    import tvm
    from tvm.target import Target

    config = ("gemm", 4096, 1024, block_m, 4, 2, "ue8m0", True, 1)
    src = _lower(config)
    body = src[src.index("fp8_gemm_kernel(") :]
    wait = body.index("cudaGridDependencySynchronize();")
    assert wait < body.index("cudaTriggerProgrammaticLaunchCompletion();")
    assert body.index("s[") < wait, "the scales are read while the kernel before runs"
    for access in ("tma_load(w_desc", "tma_load(x_desc", "(out + "):
        assert wait < body.index(access), access
    target = Target({"kind": "cuda", "arch": "sm_90"})
    with target, tvm.transform.PassContext(config=tlg.PASS_CONFIGS):
        for func in (tlg.build_gemm(*config[1:]), tlg.build_combine(4096, 4, True)):
            assert '"has_cuda_pdl_sync": 1' in str(tilelang.lower(func, target=target).device_mod)
    plain = _lower(config[:-2] + (False, 1))
    assert "cudaGridDependencySynchronize" not in plain and "cudaTriggerProgrammatic" not in plain


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="TileLang is not installed")
@pytest.mark.parametrize(
    "config",
    [
        ("gemm", 4096, 8192, 256, 4, 2, "fp32"),
        ("gemm", 32768, 1024, 256, 1, 2, "ue8m0"),
        ("gemm", 8192, 1024, 64, 2, 4, "ue8m0", True, 1, True),
    ],
    ids=["split-fp32", "direct-ue8m0", "decode-64-wide-pdl"],
)
def test_the_wide_tiles_compile_for_sm90a_without_spills(config, tmp_path):
    """The 256-token tile (128 accumulators per thread, the most registers of any configuration):
    ``ptxas`` reports no stack frame and no spills once the consumers hold 240 registers; nor
    does the wide kind at 64 tokens (the probe of ``bench_fp8_gemm.py``)."""
    import re

    if tilelang_problem() is not None:
        pytest.skip(f"needs TileLang and nvcc: {tilelang_problem()}")
    report = sm90a_cubin(_lower(config), tmp_path / "kernel.cu")
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", report), report


# ---------------------------------------------------------------------------------------------
# GPU


def _gpu_ready() -> None:
    if not torch.cuda.is_available() or tilelang_problem() is not None:
        pytest.skip(f"needs a CUDA GPU and TileLang ({tilelang_problem()})")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [DECODE_M, WIDE_M], ids=["narrow", "wide"])
@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_gpu_tilelang_gemm_matches_the_reference_at_v4_flash_shapes(scale_dtype, tokens):
    from deepinfer_core.ops.linear import linear
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    _gpu_ready()
    atol, rtol = DEFAULT_TOLERANCES[torch.bfloat16]
    g = torch.Generator().manual_seed(4)
    for k, n in V4_SHAPES:
        w = _weight(g, n, k, scale_dtype, "cuda")
        dense = w.dequantize(torch.bfloat16).double()
        for m in tokens:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            got, want = tlg.linear_fp8(x, w), linear(x, w)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol), f"{k}x{n} M={m}"
            exact = x.double() @ dense.t()
            err, ref_err = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
            assert err <= 2 * ref_err + 1e-6, f"{k}x{n} M={m}: {err:.3g} vs the reference's {ref_err:.3g}"


@pytest.mark.gpu
def test_gpu_the_wide_kind_at_decode_token_counts_matches_the_reference():
    """The probe ``bench_fp8_gemm.py`` times (``wide=True`` at ``M <= 64``): within the op's
    tolerance of the reference, as close to the exact product as the narrow tiles' twice over."""
    from deepinfer_core.ops.linear import linear
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    _gpu_ready()
    atol, rtol = DEFAULT_TOLERANCES[torch.bfloat16]
    g = torch.Generator().manual_seed(6)
    for k, n in ((1024, 8192), (4096, 1536)):  # split K at every M, and the widest split
        w = _weight(g, n, k, "ue8m0", "cuda")
        dense = w.dequantize(torch.bfloat16).double()
        for m in DECODE_M:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            got, want = tlg.linear_fp8(x, w, wide=True), linear(x, w)
            assert torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol), f"{k}x{n} M={m}"
            exact = x.double() @ dense.t()
            err = (got.double() - exact).abs().max()
            narrow = (tlg.linear_fp8(x, w).double() - exact).abs().max()
            assert err <= 2 * narrow + 1e-6, f"{k}x{n} M={m}: {err:.3g} vs narrow {narrow:.3g}"


@pytest.mark.gpu
def test_gpu_tilelang_gemm_replays_in_a_cuda_graph_bitwise():
    _gpu_ready()
    g = torch.Generator().manual_seed(5)
    for k, n in ((4096, 1024), (1024, 32768)):  # split K (with the combine) and no split
        w = _weight(g, n, k, "fp32", "cuda")
        for m in (1, 33, 100, 256):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            first = tlg.linear_fp8(x, w)
            assert torch.equal(first, tlg.linear_fp8(x, w)), "not deterministic"
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = tlg.linear_fp8(x, w)
            x.copy_(torch.randn(m, k, device="cuda"))
            graph.replay()
            assert torch.equal(y, tlg.linear_fp8(x, w)), f"{k}x{n} M={m}: the replay differs"


@pytest.mark.gpu
def test_gpu_split_sums_in_the_launch_equal_the_combines_bitwise(monkeypatch):
    """V4-Flash shapes at several K split counts, narrow and wide tiles, dense and grouped: the
    tile's last CTA summing the partials gives the separate combine's bits; the counters are
    zero after every launch; on the side stream too; a captured graph replays the same bits.
    (The separate launches are compiled here: a few cases keep that short.)"""
    from deepinfer_cuda_sm100.kernels import split_counters
    from deepinfer_cuda_sm100.kernels.fp8_gemm import SPLITK_ENV

    from deepinfer_core.ops.overlap import side_stream

    _gpu_ready()
    g = torch.Generator().manual_seed(9)

    def both(call, x, w, splits):
        monkeypatch.setenv(SPLITK_ENV, "separate")
        want = call(x, w, splits=splits)
        monkeypatch.setenv(SPLITK_ENV, "fused")
        return call(x, w, splits=splits), want

    cases = ((1, 4096, 1024, (1, 64, 256), (2, 8)), (8, 4096, 1024, (16,), (4,)))
    for groups, k, n, tokens, counts in cases:
        w = _weight(g, groups * n, k, "ue8m0", "cuda")
        for m in tokens:
            x = torch.randn(m, groups, k, generator=g).to(torch.bfloat16).cuda()
            for splits in counts:
                if groups == 1:
                    got, want = both(tlg.linear_fp8, x[:, 0], w, splits)
                else:
                    got, want = both(tlg.grouped_linear_fp8, x, w, splits)
                assert torch.equal(got, want), f"{groups}x{k}x{n} M={m} splits={splits}"
                assert split_counters.buffers(), "the in-launch sums took no counters: they did not run"
                assert not any(b.any() for b in split_counters.buffers()), "a counter left set"
    x = torch.randn(16, 4096, generator=g).to(torch.bfloat16).cuda()
    w = _weight(g, 1024, 4096, "fp32", "cuda")
    want = tlg.linear_fp8(x, w, splits=8)
    stream = side_stream(x.device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        beside = tlg.linear_fp8(x, w, splits=8)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(beside, want)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tlg.linear_fp8(x, w, splits=8)
    for _ in range(3):
        graph.replay()
    assert torch.equal(y, want) and not any(b.any() for b in split_counters.buffers())


@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
def test_gpu_grouped_tilelang_gemm_matches_the_reference_and_replays_bitwise(scale_dtype):
    """V4-Flash's ``o_a`` (8 groups of 4096 -> 1024) and a 2-group shape: within the bf16
    tolerance of the reference ``grouped_linear`` and no farther from the exact product than
    twice the reference's own error, every group on its own inputs (a group's inputs zeroed
    zero its outputs alone); CUDA-graph replay bitwise equal to eager."""
    from deepinfer_core.ops.linear import grouped_linear
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    _gpu_ready()
    atol, rtol = DEFAULT_TOLERANCES[torch.bfloat16]
    g = torch.Generator().manual_seed(8)
    for groups, k, n in ((8, 4096, 1024), (2, 1024, 256)):
        w = _weight(g, groups * n, k, scale_dtype, "cuda")
        dense = w.dequantize(torch.bfloat16).double().view(groups, n, k)
        for m in (1, 16, 64, 100, 256):
            x = torch.randn(m, groups, k, generator=g).to(torch.bfloat16).cuda()
            assert tlg.problem(x, w, groups) is None
            got, want = tlg.grouped_linear_fp8(x, w), grouped_linear(x, w)
            assert got.shape == (m, groups, n) and got.dtype == torch.bfloat16
            assert torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol), f"{groups}x{k}x{n} M={m}"
            exact = torch.einsum("tgk,gnk->tgn", x.double(), dense)
            err, ref_err = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
            assert err <= 2 * ref_err + 1e-6, f"M={m}: {err:.3g} vs the reference's {ref_err:.3g}"
        x[:, 1].zero_()
        out = tlg.grouped_linear_fp8(x, w)
        assert not out[:, 1].any() and out[:, 0].abs().sum() > 0
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = tlg.grouped_linear_fp8(x, w)
        x.copy_(torch.randn(x.shape, device="cuda"))
        graph.replay()
        assert torch.equal(y, tlg.grouped_linear_fp8(x, w)), f"{groups}x{k}x{n}: the replay differs"


@pytest.mark.gpu
def test_gpu_dispatcher_takes_tilelang_where_measured_fastest_but_not_in_batch_invariant_mode(monkeypatch):
    from deepinfer_cuda_sm100.kernels.fp8_gemm import linear_fp8 as triton_linear

    from deepinfer_core.ops.modes import batch_invariant_mode

    _gpu_ready()
    kernel_choice.forget()
    monkeypatch.setattr(kernel_choice, "load_points", lambda arch: _points())
    op = gemm_dispatch.make_linear(triton_linear)
    g = torch.Generator().manual_seed(6)
    w = _weight(g, 1024, 4096, "fp32", "cuda")
    x = torch.randn(1, 4096, generator=g).to(torch.bfloat16).cuda()
    assert gemm_dispatch.choose_path(x, w) == "tilelang"
    assert torch.equal(op(x, w), tlg.linear_fp8(x, w))
    with batch_invariant_mode():
        assert gemm_dispatch.choose_path(x, w) == "triton"
    monkeypatch.undo()
    kernel_choice.forget()
