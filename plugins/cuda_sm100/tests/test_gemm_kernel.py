"""The ``cuda_sm100`` FP8 block-scaled GEMM (``linear`` with a ``QuantizedTensor`` weight).

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_gemm_kernel.py --interpreter-report`` prints a JSON report and each test below reads one
part of it.  On the small shapes of :data:`deepinfer_cuda_sm100.cases.SMALL` it runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` holding the op: the core's
  cases (the plain-tensor one is refused) and the kernel's (decode and prefill launches,
  float32 and ue8m0 scales, partial edge tiles) in float32, bfloat16 and float16;
- the batch-invariant mode: every case refused with the reason;
- the launch shapes: the decode launch's choices (tile widths 64 / 32 / 16, even and uneven
  K splits) and the prefill launch, against the reference within the op's tolerance;
- split-K: explicit launches (several row tiles, each tile width, 2-11 splits, grouped) with
  the splits summed in the kernel (the tile's last program) and by torch after it, the tile
  counters back at zero after each call, and the same bits from two calls;
- the opt-in W8A8 variant against an emulation of its activation quantisation (tight) and
  against the reference (bounded by the quantisation error).

**GPU** (skipped without CUDA): conformance at DeepSeek-V4-Flash shapes, the W8A8 bound, the
split-K checks at V4-Flash shapes and the replay of a captured CUDA graph (decode split-K, both
reductions, and prefill).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from cuda_sm100_checks import compile_problem, conformance_problems, failed_rows

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


SPLIT_LAUNCHES = (
    # (M, K, N, groups, (BLOCK_N, splits)): row tiles, tile widths, even and uneven splits
    (1, 1280, 64, 0, (64, 2)),
    (3, 1280, 96, 0, (32, 3)),  # uneven: 4 + 4 + 2 blocks; N not a multiple of the tile
    (20, 640, 48, 0, (16, 5)),  # two row tiles, one block a split
    (64, 1152, 128, 0, (64, 4)),  # four row tiles; 9 blocks in 4 splits: 3 splits of 3 are run
    (2, 512, 128, 2, (32, 2)),  # grouped: two groups of 128 output rows
)


def split_problems(dtype: torch.dtype, device: str, shapes=SPLIT_LAUNCHES) -> list[str]:
    """Explicit split-K launches (``shapes``), the splits summed in the kernel and by torch:
    each within the op's tolerance of the reference, the kernel's sum the same bits on a second
    call, the tile counters all zero after each call."""
    from deepinfer_cuda_sm100.kernels import fp8_gemm, split_counters

    from deepinfer_core.ops.linear import linear as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    if dtype == torch.float32 and device != "cpu":
        atol, rtol = 1e-4, 1e-4  # tf32-free fp32 MMAs, summed in another order
    g = torch.Generator().manual_seed(5)
    problems = []
    for m, k, n, groups, (bn, splits) in shapes:
        w = _to(_weight(g, n * max(groups, 1), k, "ue8m0" if m % 2 else "fp32"), device)
        x = torch.randn(m, max(groups, 1), k, generator=g).to(dtype).to(device)
        x = x if groups else x[:, 0]
        want = reference(x.reshape(m * max(groups, 1), k), w) if not groups else None
        if groups:  # group j of x times rows j*n:(j+1)*n of w
            parts = [reference(x[:, j], _rows(w, j * n, (j + 1) * n)) for j in range(groups)]
            want = torch.cat(parts, dim=1)
        want = want.float().reshape(m, -1)
        launch = fp8_gemm.Launch(16, bn, splits, 4, 3)
        label = f"M={m} K={k} N={n} groups={groups} tile 16x{bn}, {splits} splits"
        for reduction in ("fused", "separate"):
            got = fp8_gemm._run(x, w.data, w.scale, False, groups, launch, reduction).float().reshape(m, -1)
            if not torch.allclose(got, want, atol=atol, rtol=rtol):
                err = (got - want).abs().max().item()
                problems.append(f"{label}, {reduction}: max abs err {err:.3g}")
            if reduction == "fused":
                again = fp8_gemm._run(x, w.data, w.scale, False, groups, launch, reduction).float()
                if not torch.equal(again.reshape(m, -1), got):
                    problems.append(f"{label}: a second call gave other bits")
            busy = [int(c.count_nonzero()) for c in split_counters.buffers()]
            if any(busy):
                problems.append(f"{label}, {reduction}: {sum(busy)} tile counters left non-zero")
    return problems


def _rows(w, start: int, stop: int):
    """Rows ``start:stop`` of a 128x128-block FP8 weight (whole scale blocks)."""
    from deepinfer_core.weights.quant import QuantizedTensor

    return QuantizedTensor(w.data[start:stop], w.scale[start // 128 : -(-stop // 128)], w.fmt, w.block)


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
    return problems + prefill_switch_problems(device)


def prefill_switch_problems(device: str) -> list[str]:
    """``DEEPINFER_FP8_PREFILL=w8a8`` runs the registered ``linear`` / ``grouped_linear`` at
    prefill sizes of 16-bit activations as the W8A8 kernel (bitwise), decode and fp32 as W8A16."""
    from deepinfer_cuda_sm100.kernels import fp8_gemm

    g = torch.Generator().manual_seed(8)
    w = _to(_weight(g, 256, 256), device)
    problems = []
    old = os.environ.get(fp8_gemm.PREFILL_ENV)
    try:
        os.environ[fp8_gemm.PREFILL_ENV] = "w8a8"
        for m, dtype, w8a8 in (
            (70, torch.bfloat16, True),
            (16, torch.bfloat16, False),
            (70, torch.float32, False),
        ):
            x = torch.randn(m, 256, generator=g).to(dtype).to(device)
            want = fp8_gemm._run(x, w.data, w.scale, w8a8=w8a8)
            if not torch.equal(fp8_gemm.linear_fp8(x, w), want):
                problems.append(f"M={m} {dtype}: linear is not the {'W8A8' if w8a8 else 'W8A16'} kernel")
        xg = torch.randn(70, 2, 256, generator=g).to(torch.bfloat16).to(device)
        got = fp8_gemm.grouped_linear_fp8(xg, w).reshape(70, -1)
        if not torch.equal(got, fp8_gemm._run(xg, w.data, w.scale, w8a8=True, groups=2)):
            problems.append("grouped_linear at M=70 is not the W8A8 kernel")
        os.environ[fp8_gemm.PREFILL_ENV] = "fp4"
        try:
            fp8_gemm.prefill_math()
            problems.append("DEEPINFER_FP8_PREFILL=fp4 was accepted")
        except ValueError as e:
            if fp8_gemm.PREFILL_ENV not in str(e):
                problems.append(f"the error does not name the variable: {e}")
    finally:
        if old is None:
            os.environ.pop(fp8_gemm.PREFILL_ENV, None)
        else:
            os.environ[fp8_gemm.PREFILL_ENV] = old
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
    report["splits"] = split_problems(torch.float32, "cpu") + split_problems(torch.bfloat16, "cpu")
    report["w8a8"] = w8a8_problems("cpu")
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernel


@slow
def test_kernel_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
def test_interpreter_conformance(report):
    from deepinfer_cuda_sm100.ops import PLAIN_WEIGHT_REFUSAL

    rows = [r for r in report["conformance"] if r["mode"] == "default"]
    bad = conformance_problems(rows, PLAIN_WEIGHT_REFUSAL, core="core's FP8")
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
def test_interpreter_split_k(report):
    assert not report["splits"], "\n".join(report["splits"])


@slow
def test_interpreter_w8a8_error_is_bounded(report):
    assert not report["w8a8"], "\n".join(report["w8a8"])


# ---------------------------------------------------------------------------------------------
# launch shapes and supports (no kernel runs)


V4_FLASH_PROJECTIONS = ((4096, 1024), (1024, 32768), (4096, 512), (8192, 4096), (4096, 2048), (2048, 4096))
"""``(K, N)`` of DeepSeek-V4-Flash's FP8 projections (the benchmark's shapes)."""
V4_FLASH_FUSED_PROJECTIONS = ((4096, 1536), (4096, 4096), (1024, 8192))
"""``(K, N)`` of the fused projections the V4 model runs (``q_a`` + ``kv``, the shared expert's
gate + up) and the indexer's query projection."""


def test_launch_shape_depends_on_static_shapes_only():
    from deepinfer_cuda_sm100.kernels.fp8_gemm import DECODE_MAX_M, MID_MAX_M, PREFILL_TILE, launch_shape

    assert launch_shape(1, 1024, 4096) == (16, 32, 11)  # 32 tiles x 11 splits of 3 blocks
    assert launch_shape(DECODE_MAX_M, 32768, 1024) == (16, 64, 1)  # 2048 tiles: no split
    assert launch_shape(1, 512, 4096) == (16, 16, 11)  # the narrowest tile
    assert launch_shape(1, 64, 128)[2] == 1  # one K block: nothing to split
    assert launch_shape(1, 64, 256)[2] == 1  # two: a split would hold one
    assert launch_shape(MID_MAX_M + 1, 1024, 4096) == (*PREFILL_TILE, 1)  # prefill
    assert launch_shape(MID_MAX_M, 32768, 1024) == (*PREFILL_TILE, 1)  # 1024 tiles: no split
    assert launch_shape(DECODE_MAX_M + 1, 1024, 4096) == (64, 64, 5)  # 32 tiles x 5 splits of 7


@pytest.mark.parametrize("sms", [132, 148, 78])
def test_mid_launch_fills_the_gpu(sms):
    """At 64 < M <= 512 every V4-Flash projection runs >= one program per SM where its K allows:
    the widest tile of MID_TILES with one per SM, else the narrowest with the fewest K splits."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import (
        BLOCK_K,
        DECODE_MAX_M,
        MID_MAX_M,
        MID_TILES,
        MIN_SPLIT_BLOCKS,
        launch_config,
    )

    for m in (DECODE_MAX_M + 1, 128, 256, MID_MAX_M):
        for k, n in V4_FLASH_PROJECTIONS + V4_FLASH_FUSED_PROJECTIONS:
            bm, bn, splits, warps, stages = launch_config(m, n, k, sms=sms)
            k_blocks = -(-k // BLOCK_K)
            programs = -(-m // bm) * -(-n // bn) * splits
            label = f"M={m} K={k} N={n} on {sms} SMs: {bm}x{bn}, {splits} splits, {programs} programs"
            assert (bm, bn) in MID_TILES, label
            wider = MID_TILES[: MID_TILES.index((bm, bn))]
            assert all(-(-m // a) * -(-n // b) < sms for a, b in wider), label  # no wider tile fills it
            if splits > 1:
                assert (bm, bn) == MID_TILES[-1] and -(-k_blocks // splits) >= MIN_SPLIT_BLOCKS, label
            most = k_blocks // MIN_SPLIT_BLOCKS if k_blocks >= 2 * MIN_SPLIT_BLOCKS else 1
            assert programs >= sms or splits >= most, label


@pytest.mark.parametrize("sms", [132, 148, 78])
def test_decode_launch_fills_the_gpu(sms):
    """At M <= 64 every V4-Flash projection runs >= 2 programs per SM, K splits of >= 2 blocks
    of 128 (but the last), the fewest splits that get there at the widest tile that does."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import (
        BLOCK_K,
        DECODE_BLOCK_NS,
        MAX_STAGES,
        MIN_SPLIT_BLOCKS,
        PROGRAMS_PER_SM,
        launch_config,
    )

    for m in (1, 2, 16, 17, 64):
        for k, n in V4_FLASH_PROJECTIONS:
            bm, bn, splits, warps, stages = launch_config(m, n, k, sms=sms)
            k_blocks = -(-k // BLOCK_K)
            per_split = -(-k_blocks // splits)
            programs = -(-m // bm) * -(-n // bn) * splits
            label = f"M={m} K={k} N={n} on {sms} SMs: 16x{bn}, {splits} splits, {programs} programs"
            assert (bm, warps) == (16, 4) and bn in DECODE_BLOCK_NS and 128 % bn == 0, label
            assert programs >= PROGRAMS_PER_SM * sms, label
            assert splits == 1 or per_split >= MIN_SPLIT_BLOCKS, label
            assert -(-k_blocks // per_split) == splits, label  # balanced: no empty split
            assert 2 <= stages <= MAX_STAGES, label
            if splits > 1 and bn == DECODE_BLOCK_NS[0]:  # no fewer balanced splits would do
                for fewer in range(1, splits):
                    balanced = -(-k_blocks // -(-k_blocks // fewer))
                    assert -(-m // bm) * -(-n // bn) * balanced < PROGRAMS_PER_SM * sms, label


def test_split_reduction_switch(monkeypatch):
    from deepinfer_cuda_sm100.kernels.fp8_gemm import SPLITK_ENV, split_reduction

    monkeypatch.delenv(SPLITK_ENV, raising=False)
    assert split_reduction() == "fused"
    monkeypatch.setenv(SPLITK_ENV, "Separate")
    assert split_reduction() == "separate"
    monkeypatch.setenv(SPLITK_ENV, "atomic")
    with pytest.raises(ValueError, match=SPLITK_ENV):
        split_reduction()


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
# compile for the GPU (no GPU needed)


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_kernel_compiles_for_the_gpu(arch):
    """The decode launches (each tile width; splits summed in the kernel: one acq_rel atomic per
    program, L2 reads of the partials; or by torch), prefill (W8A16, and W8A8 on pre-quantised
    activations), W8A8 compile for sm_90 / sm_100."""
    import triton
    import triton.language as tl
    from deepinfer_cuda_sm100.kernels import fp8_gemm
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = fp8_gemm._fp8_gemm_kernel
    args = {"x_ptr": "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16"}
    args |= {"ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32"}
    args |= {"stride_xg": "i32", "stride_xsm": "i32", "stride_xsg": "i32", "stride_wn": "i32"}
    args |= {"stride_sn": "i32", "stride_ym": "i32", "stride_split": "i32"}
    aligned = {"N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_split"}  # as the launcher sees them
    names = list(fn.arg_names)
    attrs = {
        (names.index(a),): [["tt.divisibility", 16]] for a, ty in args.items() if ty[0] == "*" or a in aligned
    }
    configs = (  # (BLOCK_M, BLOCK_N, fused splits, W8A8, pre-quantised x, warps, stages)
        (16, 64, 5, False, False, 4, 4),
        (16, 32, 11, False, False, 4, 3),
        (16, 16, 11, True, False, 4, 3),
        (16, 64, 1, False, False, 4, 3),
        (64, 128, 1, False, False, 8, 3),
        (64, 64, 1, True, False, 8, 3),
        (128, 128, 1, True, True, 8, 3),
    )
    for bm, bn, fused, w8a8, a_fp8, warps, stages in configs:
        args["x_ptr"] = "*fp8e4nv" if a_fp8 else "*bf16"
        consts = {"K_BLOCKS_PER_SPLIT": 3, "FUSED_SPLITS": fused, "GROUP_N": 1024}
        consts |= {"W8A8": w8a8, "A_FP8": a_fp8}
        consts |= {"out_dtype": tl.bfloat16, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128}
        consts |= {"SCALE_BLOCK": 128, "FP32_DOT": False}
        signature = {name: args.get(name, "constexpr") for name in names}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
        target = GPUTarget("cuda", arch, 32)
        ptx = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages}).asm[
            "ptx"
        ]
        label = f"{bm}x{bn} fused={fused} w8a8={w8a8} sm_{arch}"
        assert ("atom.global.gpu.acq_rel.add" in ptx) == (fused > 1), label
        assert ("ld.global.cg" in ptx) == (fused > 1), label


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_split_k(dtype):
    """The split-K checks on explicit launches, and at V4-Flash shapes with the decode launch's
    own choice (several tile widths and split counts on this GPU's SM count)."""
    from deepinfer_cuda_sm100.kernels.fp8_gemm import launch_shape, sm_count

    sms = sm_count(torch.device("cuda"))
    v4 = []
    for m in (1, 16, 64):
        for k, n in V4_FLASH_PROJECTIONS:
            bm, bn, splits = launch_shape(m, n, k, sms=sms)
            if splits > 1:
                v4.append((m, k, n, 0, (bn, splits)))
    assert v4, "no V4-Flash shape splits K"
    problems = split_problems(dtype, "cuda") + split_problems(dtype, "cuda", tuple(v4))
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_w8a8_error_is_bounded():
    problems = w8a8_problems("cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
@pytest.mark.parametrize("reduction", ["fused", "separate"])
@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_gpu_graph_replay(m, reduction, monkeypatch):
    from deepinfer_cuda_sm100.kernels.fp8_gemm import SPLITK_ENV

    monkeypatch.setenv(SPLITK_ENV, reduction)
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
        for replay in range(3):
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


def test_split_counters_are_one_zeroed_buffer_per_device_and_stream_kept_when_replaced():
    """The split-K GEMM's tile counters: one int32 buffer per device and stream role with room for
    every tile, the same tensor on each call; the side stream's (a block's overlapped chain) does
    not share a counter with the current stream's; a call needing more counters gets longer
    buffers and the shorter ones stay alive (a captured graph may hold their addresses)."""
    from deepinfer_cuda_sm100.kernels import split_counters

    cpu = torch.device("cpu")
    saved = dict(split_counters._BUFFERS)
    split_counters._BUFFERS.pop(cpu, None)
    try:
        a = split_counters.tile_counters(cpu, 16)
        assert a.dtype == torch.int32 and a.numel() >= 16 and not a.any()
        assert split_counters.tile_counters(cpu, 24) is a
        assert split_counters.tile_counters(cpu, 24, side=False) is a  # the CPU has no side stream
        side = split_counters.tile_counters(cpu, 24, side=True)
        assert side is not a and side.numel() == a.numel() and not side.any()
        a.fill_(1)  # no counter of one stream is the other's
        assert not side.any()
        a.zero_()
        b = split_counters.tile_counters(cpu, a.numel() + 1)
        assert b is not a and b.numel() > a.numel() and not b.any()
        for old in (a, side):
            assert any(t is old for t in split_counters.buffers())
        assert any(t is b for t in split_counters.buffers())
    finally:
        split_counters._BUFFERS.clear()
        split_counters._BUFFERS.update(saved)
        split_counters._RETIRED.clear()
