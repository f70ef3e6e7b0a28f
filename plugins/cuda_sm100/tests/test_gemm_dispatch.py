"""``linear``'s two W8A16 paths and the measured choice between them
(:mod:`deepinfer_cuda_sm100.gemm_dispatch`).

**Interpreter** (a child with ``TRITON_INTERPRET=1``, see ``test_gemm_kernel.py``): the
dequantisation kernel is bitwise :func:`deepinfer_core.weights.quant.dequant_fp8` -- float32
and UE8M0 block scales (zero, subnormal-exponent and large scales), partial edge tiles, into
float32, bfloat16 and float16.

**Here**: the choice rules (Triton off the GPU, in batch-invariant mode and outside the
measured points; the faster path at the nearest measured ``M``).

**GPU** (marked ``gpu``): the cuBLAS path is bitwise the reference op on the same device
(the reference dequantises and calls ``F.linear`` too); the dispatcher takes the measured
faster path per ``M`` and replays it in a CUDA graph bitwise.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")


def _weight(g: torch.Generator, n: int, k: int, scale_dtype: str = "fp32", device: str = "cpu"):
    from deepinfer_core.weights.quant import QuantizedTensor, quant_fp8

    w = torch.randn(n, k, generator=g) * k**-0.5
    w[:3, :130] = 0  # an all-zero block row start: scale of an all-zero block
    w[-1] *= 1e4  # a large block
    data, scale = quant_fp8(w, (128, 128), scale_dtype)
    return QuantizedTensor(data.to(device), scale.to(device), "fp8", (128, 128))


def dequant_problems(device: str) -> list[str]:
    """The kernel against ``dequant_fp8``, bit for bit."""
    from deepinfer_cuda_sm100.kernels.fp8_dequant import dequantize_fp8

    from deepinfer_core.weights.quant import dequant_fp8

    problems = []
    g = torch.Generator().manual_seed(0)
    for scale_dtype in ("fp32", "ue8m0"):
        for n, k in ((256, 384), (200, 130), (64, 64)):
            w = _weight(g, n, k, scale_dtype, device)
            if scale_dtype == "ue8m0":  # the extreme exponents: 2**-127 (subnormal) and 2**127
                raw = w.scale.view(torch.uint8)
                raw[0, 0], raw[-1, -1] = 0, 254
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                want = dequant_fp8(w.data, w.scale, (128, 128), dtype)
                got = dequantize_fp8(w.data, w.scale, (128, 128), dtype)
                same = torch.equal(want.view(torch.uint8), got.view(torch.uint8))
                if not same:
                    problems.append(f"{scale_dtype} {n}x{k} {dtype}: not bitwise dequant_fp8")
    return problems


def grouped_problems(device: str) -> list[str]:
    """The grouped ``"cublas"`` path (the weight dequantised by the kernel, then the reference's
    batched GEMM) against the reference ``grouped_linear``, bit for bit."""
    from deepinfer_cuda_sm100.gemm_dispatch import cublas_grouped_linear

    from deepinfer_core.ops.linear import grouped_linear

    problems = []
    g = torch.Generator().manual_seed(5)
    for scale_dtype in ("fp32", "ue8m0"):
        for groups, n, k, t in ((2, 128, 256, 3), (4, 128, 130, 1)):
            w = _weight(g, groups * n, k, scale_dtype, device)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(t, groups, k, generator=g).to(device=device, dtype=dtype)
                if not torch.equal(cublas_grouped_linear(x, w), grouped_linear(x, w)):
                    problems.append(
                        f"{scale_dtype} G={groups} {n}x{k} T={t} {dtype}: not the reference's bits"
                    )
    return problems


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {
        "interpreted": _common.INTERPRETED,
        "dequant": dequant_problems("cpu"),
        "grouped": grouped_problems("cpu"),
    }


@pytest.mark.slow  # a fresh interpreter running the kernel
def test_interpreter_dequantisation_is_bitwise_the_reference(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"
    assert not report["dequant"], "\n".join(report["dequant"])


@pytest.mark.slow
def test_interpreter_grouped_dequantise_then_bmm_is_bitwise_the_reference(report):
    assert not report["grouped"], "\n".join(report["grouped"])


# ---------------------------------------------------------------------------------------------
# choice rules


def _points(m_fast_cublas: int, n: int = 512, k: int = 256):
    from deepinfer_cuda_sm100 import kernel_choice
    from deepinfer_cuda_sm100.gemm_dispatch import OP

    def point(m, triton_ms, cublas_ms):
        ms = {"triton": triton_ms, "cublas": cublas_ms}
        return kernel_choice.Point(OP, "w8a16", "bfloat16", n, k, m, k, ms)

    return (point(1, 1.0, 2.0), point(16, 1.0, 2.0), point(m_fast_cublas, 2.0, 1.0))


def test_off_the_gpu_the_dispatcher_runs_the_triton_kernel():
    from deepinfer_cuda_sm100.gemm_dispatch import choose_path, make_linear

    g = torch.Generator().manual_seed(1)
    w = _weight(g, 256, 256)
    x = torch.randn(512, 256, generator=g)
    assert choose_path(x, w) == "triton"
    calls = []
    out = make_linear(lambda x, w: calls.append(x.shape) or x[:, :1])(x, w)
    assert calls == [(512, 256)] and out.shape == (512, 1)


def test_off_the_gpu_the_grouped_dispatcher_runs_the_triton_kernel():
    from deepinfer_cuda_sm100.gemm_dispatch import choose_grouped_path, make_grouped_linear

    g = torch.Generator().manual_seed(1)
    w = _weight(g, 2 * 128, 256)
    x = torch.randn(5, 2, 256, generator=g)
    assert choose_grouped_path(x, w) == "triton"
    calls = []
    out = make_grouped_linear(lambda x, w: calls.append(x.shape) or x[..., :1])(x, w)
    assert calls == [(5, 2, 256)] and out.shape == (5, 2, 1)


def test_the_table_picks_the_faster_path_at_the_nearest_m():
    from deepinfer_cuda_sm100 import kernel_choice
    from deepinfer_cuda_sm100.gemm_dispatch import OP, PATHS

    points = _points(4096)

    def pick(m, n=512, k=256):
        paths = PATHS["w8a16"]
        return kernel_choice.choose(OP, "w8a16", "bfloat16", n, k, m, k, "sm90", paths, points=points)

    assert [pick(m) for m in (1, 8, 16, 3000, 4096)] == ["triton"] * 3 + ["cublas"] * 2
    assert pick(8192) == "triton"  # past the measured M: the default
    assert pick(4096, n=1024) == "triton"  # another weight shape: unmeasured


def test_a_call_the_table_has_no_point_around_takes_cublas_above_the_prefill_rows(monkeypatch):
    """Past the measured rows, or at an unmeasured weight shape, a W8A16 call of more than
    ``PREFILL_ROWS`` rows takes the dequantise-then-cuBLAS path (compute-bound: the measured
    prefill points all favour it), a smaller one Triton; a measured point still decides."""
    from deepinfer_cuda_sm100 import gemm_dispatch, kernel_choice
    from deepinfer_cuda_sm100.gemm_dispatch import OP, PATHS, PREFILL_ROWS, _choose_usable, default_path

    n, k = 512, 256
    kernel_choice.forget()
    monkeypatch.setattr(kernel_choice, "device_arch", lambda device: "sm90")
    monkeypatch.setattr(kernel_choice, "load_points", lambda arch: _points(64, n, k)[:2])  # M = 1, 16
    w = _weight(torch.Generator().manual_seed(2), n, k)
    try:

        def pick(m, rows=n):
            x = torch.empty(m, k, dtype=torch.bfloat16)
            key = (OP, "w8a16", "bfloat16", rows, k, m, k)
            return _choose_usable(x, w, 0, key, PATHS["w8a16"], default_path(m))

        assert [pick(m) for m in (1, 16)] == ["triton", "triton"]  # measured: Triton faster
        assert [pick(m) for m in (64, PREFILL_ROWS)] == ["triton", "triton"]  # past them, small
        assert [pick(m) for m in (PREFILL_ROWS + 1, 8192)] == ["cublas", "cublas"]
        assert pick(8192, rows=1024) == "cublas" and pick(32, rows=1024) == "triton"  # unmeasured
        assert gemm_dispatch.default_path(PREFILL_ROWS) == "triton"
    finally:
        monkeypatch.undo()
        kernel_choice.forget()


def test_a_path_is_never_chosen_past_the_token_range_it_was_timed_over():
    from deepinfer_cuda_sm100 import kernel_choice
    from deepinfer_cuda_sm100.gemm_dispatch import OP, PATHS

    def point(m, ms):
        return kernel_choice.Point(OP, "w8a16", "bfloat16", 512, 256, m, 256, ms)

    fast_tl = {"triton": 3.0, "cublas": 2.0, "tilelang": 1.0}
    points = (point(16, fast_tl), point(64, fast_tl), point(128, {"triton": 3.0, "cublas": 2.0}))

    def pick(m):
        paths = PATHS["w8a16"]
        return kernel_choice.choose(OP, "w8a16", "bfloat16", 512, 256, m, 256, "sm90", paths, points=points)

    assert [pick(m) for m in (16, 40, 64)] == ["tilelang"] * 3
    assert pick(80) == "cublas"  # nearest point is M = 64, but TileLang was never timed above it
    assert pick(128) == "cublas"


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype", ["fp32", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_cublas_path_is_bitwise_the_reference(scale_dtype, dtype):
    from deepinfer_cuda_sm100.gemm_dispatch import cublas_linear

    from deepinfer_core.ops.linear import linear

    problems = dequant_problems("cuda")
    assert not problems, "\n".join(problems)
    g = torch.Generator().manual_seed(2)
    for k, n in ((4096, 1024), (1024, 4096), (4096, 512)):
        w = _weight(g, n, k, scale_dtype, "cuda")
        for m in (1, 64, 1000):
            x = torch.randn(m, k, generator=g).to(dtype).cuda()
            assert torch.equal(cublas_linear(x, w), linear(x, w)), f"{k}x{n} M={m}"


@pytest.mark.gpu
def test_gpu_scaled_mm_path_is_the_w8a8_math(monkeypatch):
    """cuBLAS's block-scaled GEMM on the W8A8 prefill's quantised activations: within the fp32
    accumulation's reach of Triton's W8A8 tile, which quantises the same way."""
    from deepinfer_cuda_sm100 import scaled_mm
    from deepinfer_cuda_sm100.kernels.fp8_gemm import PREFILL_ENV, linear_fp8

    if not scaled_mm.available():
        pytest.skip("this torch has no recipe-based scaled_mm")
    monkeypatch.setenv(PREFILL_ENV, "w8a8")
    g = torch.Generator().manual_seed(4)
    for k, n in ((4096, 1024), (2048, 4096)):
        w = _weight(g, n, k, "ue8m0", "cuda")
        for m in (65, 1000, 4096):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            got, want = scaled_mm.scaled_mm_linear(x, w).float(), linear_fp8(x, w).float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{k}x{n} M={m}: relative difference {err:.3g} from Triton's W8A8"


@pytest.mark.gpu
def test_gpu_dispatcher_takes_the_measured_path_and_replays_it(monkeypatch):
    from deepinfer_cuda_sm100 import gemm_dispatch, kernel_choice
    from deepinfer_cuda_sm100.kernels.fp8_gemm import linear_fp8

    from deepinfer_core.ops.linear import linear as reference
    from deepinfer_core.ops.modes import batch_invariant_mode

    n, k = 512, 256
    kernel_choice.forget()  # no choice memoised from the shipped table
    monkeypatch.setattr(kernel_choice, "load_points", lambda arch: _points(2048, n, k))
    op = gemm_dispatch.make_linear(linear_fp8)
    g = torch.Generator().manual_seed(3)
    w = _weight(g, n, k, "fp32", "cuda")
    # 4096 rows: past the table's points, so the prefill default (gemm_dispatch.PREFILL_ROWS)
    for m, path in ((1, "triton"), (16, "triton"), (2048, "cublas"), (4096, "cublas")):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
        assert gemm_dispatch.choose_path(x, w) == path
        if path == "cublas":
            assert torch.equal(op(x, w), reference(x, w))
            with batch_invariant_mode():
                assert gemm_dispatch.choose_path(x, w) == "triton"
        op(x, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = op(x, w)
        x.copy_(torch.randn(m, k, device="cuda"))
        graph.replay()
        assert torch.equal(y, op(x, w)), f"M={m}: the replay differs from an eager call"
    monkeypatch.undo()
    kernel_choice.forget()


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))


@pytest.mark.gpu
def test_gpu_grouped_dispatcher_takes_the_measured_path_and_replays_it(monkeypatch):
    """The grouped op takes the table's faster path per ``T`` (the groups as the point's keys),
    Triton in the batch-invariant mode; the cuBLAS path is bitwise the reference and replays in
    a CUDA graph bitwise; TileLang where it is fastest and takes the call (it equals its own
    kernel's result), the next fastest where the kernel does not take the call (300 rows)."""
    from deepinfer_cuda_sm100 import gemm_dispatch, kernel_choice
    from deepinfer_cuda_sm100.kernels.fp8_gemm import grouped_linear_fp8
    from deepinfer_cuda_sm100.tl import tilelang_problem

    from deepinfer_core.ops.linear import grouped_linear as reference
    from deepinfer_core.ops.modes import batch_invariant_mode

    groups, n, k = 4, 128, 256

    def point(m, triton_ms, cublas_ms, tilelang_ms=None):
        ms = {"triton": triton_ms, "cublas": cublas_ms}
        if tilelang_ms is not None:
            ms["tilelang"] = tilelang_ms
        op = gemm_dispatch.GROUPED_OP
        return kernel_choice.Point(op, "w8a16", "bfloat16", groups * n, k, m, groups, ms)

    kernel_choice.forget()
    tilelang = "tilelang" if tilelang_problem() is None else "triton"
    table = (
        point(1, 1.0, 2.0),
        point(16, 1.0, 2.0),
        point(64, 2.0, 3.0, 1.0),
        point(256, 2.0, 1.0),
        point(300, 3.0, 2.0, 1.0),
    )
    monkeypatch.setattr(kernel_choice, "load_points", lambda arch: table)
    op = gemm_dispatch.make_grouped_linear(grouped_linear_fp8)
    g = torch.Generator().manual_seed(6)
    w = _weight(g, groups * n, k, "ue8m0", "cuda")
    try:
        for t, path in ((1, "triton"), (16, "triton"), (64, tilelang), (256, "cublas"), (300, "cublas")):
            x = torch.randn(t, groups, k, generator=g).to(torch.bfloat16).cuda()
            assert gemm_dispatch.choose_grouped_path(x, w) == path, t
            want = reference(x, w)
            got = op(x, w)
            if path == "tilelang":
                from deepinfer_cuda_sm100.tl.fp8_gemm import grouped_linear_fp8 as tilelang_grouped

                assert torch.equal(got, tilelang_grouped(x, w))
            if path == "cublas":
                assert torch.equal(got, want)
                with batch_invariant_mode():
                    assert gemm_dispatch.choose_grouped_path(x, w) == "triton"
            else:
                assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = op(x, w)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, got)
    finally:
        monkeypatch.undo()  # the shipped table back, then no choice memoised from the test's
        kernel_choice.forget()
