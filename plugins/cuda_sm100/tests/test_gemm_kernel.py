"""The ``cuda_sm100`` FP8 block-scaled GEMM (``linear`` with a ``QuantizedTensor`` weight).

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_gemm_kernel.py --interpreter-report`` prints a JSON report and each test below reads one
part of it.  On the small shapes of :data:`deepinfer_cuda_sm100.cases.SMALL` it runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` holding the op: the core's
  cases (the plain-tensor one is refused) and the kernel's (decode and prefill launches,
  float32 and ue8m0 scales, partial edge tiles) in float32, bfloat16 and float16;
- the batch-invariant mode: every case refused with the reason;
- the launch shapes: every split count of the decode launch and the prefill launch, against
  the reference within the op's tolerance;
- the opt-in W8A8 variant against an emulation of its activation quantisation (tight) and
  against the reference (bounded by the quantisation error).

**GPU** (skipped without CUDA): conformance at DeepSeek-V4-Flash shapes, the W8A8 bound and
the replay of a captured CUDA graph (decode split-K and prefill).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from cuda_sm100_checks import failed_rows

HERE = Path(__file__).resolve()

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

OP = "linear"


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def _impl():
    from deepinfer_cuda_sm100.ops import load_ops

    return load_ops()[OP]


def _spec(device: str):
    """The GEMM ops alone: ``linear`` and the grouped output projection ``grouped_linear``."""
    from deepinfer_cuda_sm100.ops import GEMM_OPS, load_ops

    from deepinfer_core.backends import BackendSpec

    return BackendSpec(
        name="cuda_sm100_gemm", device_type=device, ops=lambda: {op: load_ops()[op] for op in GEMM_OPS}
    )


def _conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """The conformance suite on the op alone, in the default and the batch-invariant mode."""
    from cuda_sm100_checks import conformance_rows

    return conformance_rows(_spec(device), dtypes)


def _weight(g: torch.Generator, n: int, k: int, scale_dtype: str = "fp32"):
    from deepinfer_core.ops._cases import randn_fp8

    return randn_fp8(g, n, k, scale=k**-0.5, scale_dtype=scale_dtype)


def _to(w, device: str):
    from deepinfer_core.weights.quant import QuantizedTensor

    return QuantizedTensor(w.data.to(device), w.scale.to(device), w.fmt, w.block)


def launch_problems(dtype: torch.dtype, device: str) -> list[str]:
    """Every decode split count and the prefill launch, within the op's tolerance."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import launch_shape

    from deepinfer_core.ops.linear import linear as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    fn = _impl().fn
    g = torch.Generator().manual_seed(3)
    problems = []
    for m, k, n in ((1, 1040, 64), (2, 400, 1024), (1, 256, 16400), (3, 2048, 32), (65, 272, 144)):
        if device == "cpu" and n * k > 1 << 20:
            n = 4096  # the interpreter: still few programs over N, so K splits
        bm, bn, splits = launch_shape(m, n, k)
        w = _to(_weight(g, n, k, "ue8m0" if m % 2 else "fp32"), device)
        x = (torch.randn(m, k, generator=g)).to(dtype).to(device)
        got, want = fn(x, w).float(), reference(x, w).float()
        if not torch.allclose(got, want, atol=atol, rtol=rtol):
            err = (got - want).abs().max().item()
            problems.append(f"M={m} K={k} N={n} (tile {bm}x{bn}, {splits} splits): max abs err {err:.3g}")
    return problems


def _emulated_w8a8(x: torch.Tensor, w) -> torch.Tensor:
    """The W8A8 product in float32: x quantised per (row, 128 channels), amax / 448 scales."""
    m, k = x.shape
    kb = -(-k // 128)
    xp = torch.nn.functional.pad(x.float(), (0, kb * 128 - k)).view(m, kb, 128)
    s = xp.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    xq = ((xp / s).to(torch.float8_e4m3fn).float() * s).view(m, -1)[:, :k]
    return xq @ w.dequantize(torch.float32).T


def w8a8_problems(device: str) -> list[str]:
    """The W8A8 variant against its emulation (tight) and the reference (quantisation bound)."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import linear_fp8_w8a8

    g = torch.Generator().manual_seed(4)
    problems = []
    for m, k, n in ((1, 384, 128), (5, 320, 192), (70, 256, 256)):
        w = _to(_weight(g, n, k), device)
        x = torch.randn(m, k, generator=g).to(device)
        got = linear_fp8_w8a8(x, w).float()
        emulated = _emulated_w8a8(x, w)
        exact = x.float() @ w.dequantize(torch.float32).T
        tight = (got - emulated).abs().max().item()
        scale = exact.abs().max().item()
        # the CPU interpreter: only the fp32 summation order differs from the emulation.  On
        # Hopper an FP8 wgmma (the 64-row prefill tile) accumulates its 128-long K-block with
        # ~14 mantissa bits before the fp32 promotion (DeepGEMM's note): measured 1.2e-3 x scale
        rel = 1e-4 if device == "cpu" else 4e-3
        if tight > rel * scale:
            problems.append(f"M={m} K={k} N={n}: {tight:.3g} from the emulated W8A8 product")
        # e4m3 rounds each activation by <= 2**-4 relative; |err| <= 2**-4 * sum_k |x_k w_k|
        bound = 2.0**-4 * (x.float().abs() @ w.dequantize(torch.float32).abs().T) + 1e-5
        if not bool(((got - exact).abs() <= bound).all()):
            err = ((got - exact).abs() / bound).max().item()
            problems.append(f"M={m} K={k} N={n}: error {err:.3g}x the activation-quantisation bound")
        xb = x.to(torch.bfloat16)
        bf = linear_fp8_w8a8(xb, w)
        if bf.dtype != torch.bfloat16 or bf.shape != (m, n):
            problems.append(f"M={m}: bf16 output {bf.dtype} {tuple(bf.shape)}")
    return problems


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", (torch.float32, torch.bfloat16, torch.float16))
    report["launches"] = launch_problems(torch.float32, "cpu") + launch_problems(torch.bfloat16, "cpu")
    report["w8a8"] = w8a8_problems("cpu")
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernel


@pytest.fixture(scope="module")
def report() -> dict:
    from cuda_sm100_checks import interpreter_report

    return interpreter_report(HERE)


@slow
def test_kernel_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
def test_interpreter_conformance(report):
    from deepinfer_cuda_sm100.ops import PLAIN_WEIGHT_REFUSAL

    rows = [r for r in report["conformance"] if r["mode"] == "default"]
    assert any(r["own"] and r["status"] == "passed" for r in rows), "the kernel's own cases did not run"
    assert any(not r["own"] and r["status"] == "passed" for r in rows), "the core's FP8 cases did not run"
    bad = failed_rows(rows, PLAIN_WEIGHT_REFUSAL)
    assert not bad, "\n".join(bad)


@slow
def test_interpreter_conforms_in_batch_invariant_mode(report):
    from deepinfer_cuda_sm100.ops import PLAIN_WEIGHT_REFUSAL

    rows = [r for r in report["conformance"] if r["mode"] == "bi"]
    assert any(r["status"] == "passed" for r in rows)
    bad = failed_rows(rows, PLAIN_WEIGHT_REFUSAL)
    assert not bad, "\n".join(bad)


@slow
def test_interpreter_launch_shapes(report):
    assert not report["launches"], "\n".join(report["launches"])


@slow
def test_interpreter_w8a8_error_is_bounded(report):
    assert not report["w8a8"], "\n".join(report["w8a8"])


# ---------------------------------------------------------------------------------------------
# launch shapes and supports (no kernel runs)


def test_launch_shape_depends_on_static_shapes_only():
    from deepinfer_cuda_sm100.kernels.fp8_gemm import DECODE_MAX_M, MAX_SPLITS, launch_shape

    assert launch_shape(1, 1024, 4096) == (16, 64, 8)  # 16 N tiles: split K eight ways
    assert launch_shape(DECODE_MAX_M, 32768, 1024) == (16, 64, 1)  # 512 N tiles: no split
    assert launch_shape(16, 512, 4096)[2] == MAX_SPLITS
    assert launch_shape(1, 64, 128)[2] == 1  # one K block: nothing to split
    assert launch_shape(DECODE_MAX_M + 1, 1024, 4096) == (64, 128, 1)  # prefill


def test_batch_invariant_launch_shape_ignores_m():
    from deepinfer_cuda_sm100.kernels.fp8_gemm import INVARIANT_TILE, launch_shape

    shapes = {
        launch_shape(m, n, k, invariant=True)
        for m in (1, 7, 64, 65, 4096)
        for n, k in ((1024, 4096), (64, 128))
    }
    assert shapes == {(*INVARIANT_TILE, 1)}


CPU = {"interpreted": True}
CUDA = {"interpreted": False}


def _supports(interpreted: bool):
    from deepinfer_cuda_sm100.ops import make_supports

    return make_supports(interpreted)[OP]


def _case(k: int = 256, n: int = 128, m: int = 3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g).to(dtype), _weight(g, n, k)


def test_supports_takes_fp8_block_weights():
    x, w = _case()
    assert _supports(True)(x, w) is True
    assert _supports(True)(x.float(), w) is True
    assert _supports(True)(x.view(1, 3, 256), w) is True  # leading dims


def test_supports_refuses_with_reasons():
    from deepinfer_cuda_sm100.ops import PLAIN_WEIGHT_REFUSAL

    from deepinfer_core.ops._cases import randn_fp4, randn_fp8
    from deepinfer_core.ops.modes import batch_invariant_mode

    sup = _supports(True)
    x, w = _case()
    g = torch.Generator().manual_seed(1)
    assert sup(x, torch.randn(128, 256)) == PLAIN_WEIGHT_REFUSAL
    with batch_invariant_mode():  # the mode takes its own launch shape, not a refusal
        assert sup(x, w) is True
    assert "fp4" in sup(x, randn_fp4(g, 128, 256))
    assert "block" in sup(x, randn_fp8(g, 128, 256, block=(64, 64)))
    assert "multiple of 16" in sup(*_case(k=264))
    assert "multiple of 16" in sup(*_case(n=120))
    assert "channels" in sup(x[:, :128], w)
    assert "channel stride" in sup(torch.randn(256, 3).t(), w)
    assert "dtype" in sup(x.to(torch.float64), w)
    assert "GPU" in _supports(False)(x, w)  # CPU tensors for the compiled kernel


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="needs a CUDA GPU (none visible) and compiled kernels (TRITON_INTERPRET unset)",
)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_conformance_at_v4_flash_shapes(dtype):
    from deepinfer_cuda_sm100.ops import PLAIN_WEIGHT_REFUSAL

    rows = [r for r in _conformance("cuda", (dtype,)) if r["mode"] == "default"]
    assert any(r["own"] and r["status"] == "passed" for r in rows)
    bad = failed_rows(rows, PLAIN_WEIGHT_REFUSAL)
    assert not bad, "\n".join(bad)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_launch_shapes(dtype):
    problems = launch_problems(dtype, "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_w8a8_error_is_bounded():
    problems = w8a8_problems("cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_gpu_graph_replay(m):
    fn = _impl().fn
    g = torch.Generator().manual_seed(6)
    for k, n in ((4096, 1024), (4096, 512), (2048, 4096)):
        w = _to(_weight(g, n, k), "cuda")
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
        fn(x, w)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fn(x, w)
        for replay in range(2):
            x.copy_(torch.randn(m, k, device="cuda"))
            graph.replay()
            assert torch.equal(y, fn(x, w)), f"M={m} K={k} N={n}, replay {replay}: differs from eager"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_batch_invariant_rows_do_not_depend_on_m(dtype):
    """In the mode a row's output alone is bitwise its output in a batch of 1-255 others."""
    from deepinfer_core.ops.modes import batch_invariant_mode

    fn = _impl().fn
    g = torch.Generator().manual_seed(8)
    for k, n in ((4096, 1024), (1024, 4096)):
        w = _to(_weight(g, n, k), "cuda")
        x = torch.randn(256, k, generator=g).to(dtype).cuda()
        with batch_invariant_mode():
            alone = torch.cat([fn(x[i : i + 1], w) for i in (0, 1, 100, 255)])
            for m in (2, 3, 17, 64, 101, 256):
                out = fn(x[:m], w)
                for j, i in enumerate((0, 1, 100, 255)):
                    if i < m:
                        assert torch.equal(out[i], alone[j]), (
                            f"K={k} N={n}: row {i} of {m} differs from alone"
                        )


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
