"""The decode-width FP4 ``moe_experts`` GEMVs (``kernels/moe_gemv.py``) and their dispatch.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not leak
into this pytest process, so the kernels run in a child (``python test_moe_gemv.py
--interpreter-report`` prints a JSON report the tests below read):

- conformance against the reference op within its tolerances, on FP4 stacks with ue8m0 scales
  (the folded path) and float32 scales, with and without the shared expert's output, at 1 to
  16 tokens, top-1 to top-6, over 4 to 16 experts, hidden 256 / intermediate 128; padding ids
  (``-1`` and ``E``, a token with none valid), a token routed twice to one expert, a strided
  ``x``, float32 and float16 activations (fp16 keeps the dequantised weights with ue8m0 scales);
- the down projection over (pair, feature block) programs and the combine, bitwise against a
  down kernel per (token, feature block) that sums its slots itself (:func:`per_token_moe`, the
  formulation it replaces), on the same ``h``;
- launches other than the defaults (:class:`~deepinfer_cuda_sm100.kernels.moe_gemv.GemvLaunch`
  overrides) against the reference.

**Here** (no kernel runs): the launch plan and its overrides, the register-table e2m1 PTX and
the bf16 widening through the PTX emulator of ``test_moe_e2m1_ptx.py``,
:func:`~deepinfer_cuda_sm100.moe_dispatch.gemv_supports` and its reasons, the dispatcher's choice
(a table point of ``triton_gemv`` routes the call to the GEMVs; the batch-invariant mode and the
FP8 math never do; never past the pair counts it was timed at; a table without its points
chooses as before), the benchmark rows as table points, and calls without pairs.

**Compile** (no GPU needed, slow): both GEMV kernels as the host launches them at V4-Flash widths
compile for sm_90 with the PTX e2m1 decoding (with ue8m0 scales its tables in registers, no
bf16x2 scale products), and ``cuobjdump`` finds no stack or local memory (no spills).

**GPU** (marked ``gpu``): V4-Flash widths (hidden 4096, intermediate 2048, 64 experts, top-6,
T = 1, 2, 4; both scale formats; a shared expert) against the reference, with the default and
other launches, and a captured CUDA graph's replay bitwise equal to the eager call.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from cuda_sm100_checks import compile_problem, replayed
from deepinfer_cuda_sm100 import kernel_choice, moe_dispatch

from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.weights.quant import UE8M0_DTYPE, QuantizedTensor

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from deepinfer_cuda_sm100.kernels._common import cast_to, round_through  # noqa: E402
from deepinfer_cuda_sm100.kernels.moe_gemv_rows import gemv_rows  # noqa: E402

GEMV = moe_dispatch.GEMV
slow = pytest.mark.slow  # they read the report of a fresh interpreter, or compile

CASES = (
    # (label, dtype, T, D, I, E, k, scales, shared, variant)
    ("T=1 top-1 ue8m0", torch.bfloat16, 1, 256, 128, 4, 1, "ue8m0", False, ""),
    ("T=1 top-6 ue8m0", torch.bfloat16, 1, 256, 128, 8, 6, "ue8m0", False, ""),
    ("T=1 top-6 fp32 scales, shared", torch.bfloat16, 1, 256, 128, 16, 6, "fp32", True, ""),
    ("T=2 top-2 ue8m0, shared", torch.bfloat16, 2, 256, 128, 4, 2, "ue8m0", True, ""),
    ("T=2 top-6 fp32 scales, strided x", torch.bfloat16, 2, 256, 128, 16, 6, "fp32", False, "strided"),
    ("T=3 top-2 fp32 scales, an expert twice", torch.bfloat16, 3, 256, 128, 4, 2, "fp32", False, "twice"),
    ("T=3 top-6 ue8m0, padding ids, shared", torch.bfloat16, 3, 256, 128, 8, 6, "ue8m0", True, "padding"),
    ("T=4 top-3 fp32 scales, padding ids", torch.bfloat16, 4, 256, 128, 8, 3, "fp32", False, "padding"),
    ("T=5 top-4 ue8m0, padding ids", torch.bfloat16, 5, 256, 128, 16, 4, "ue8m0", False, "padding"),
    ("T=8 top-3 fp32 scales, shared", torch.bfloat16, 8, 256, 128, 8, 3, "fp32", True, ""),
    ("T=16 top-6 ue8m0, padding ids, shared", torch.bfloat16, 16, 256, 128, 8, 6, "ue8m0", True, "padding"),
    ("T=16 top-1 fp32 scales, padding, shared", torch.bfloat16, 16, 256, 128, 4, 1, "fp32", True, "padding"),
    ("T=2 top-6 float32 x, ue8m0", torch.float32, 2, 256, 128, 8, 6, "ue8m0", True, ""),
    ("T=3 top-4 float16 x, ue8m0, padding ids", torch.float16, 3, 256, 128, 8, 4, "ue8m0", True, "padding"),
)
BITWISE_CASES = (1, 2, 5, 6, 7, 11, 12, 13)
"""Indices of :data:`CASES` whose down projection is also compared with :func:`per_token_moe`."""


def _routing(g, t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, weights)`` of ``t`` tokens: distinct experts, weights summing to 1.5."""
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return ids, 1.5 * w / w.sum(-1, keepdim=True)


def _case(g, dtype, t, d, i, e, k, scales, shared, variant) -> tuple:
    from deepinfer_core.ops._cases import randn_fp4

    gate_up = randn_fp4(g, e, 2 * i, d, scale=1.5 * d**-0.5, scale_dtype=scales)
    down = randn_fp4(g, e, d, i, scale=i**-0.5, scale_dtype=scales)
    ids, weights = _routing(g, t, e, k)
    x = torch.randn(t, d, generator=g).to(dtype)
    if variant == "strided":
        x = torch.cat([x, x], dim=1)[:, d // 2 : d // 2 + d]
    elif variant == "twice":
        ids[1, 1] = ids[1, 0]
    elif variant == "padding":  # an expert-parallel dispatch's padding: -1, and foreign ids
        ids[0, k - 1] = -1
        if t > 1:
            ids[1, :] = -1  # a token without a valid id
        if t > 2:
            ids[t - 1, 0] = e
    sh = torch.randn(t, d, generator=g).to(dtype) if shared else None
    return x, ids, weights, gate_up, down, 10.0, sh


# ---------------------------------------------------------------------------------------------
# the interpreter child


@triton.jit
def _per_token_down_kernel(
    h_ptr,
    ids_ptr,
    stride_ids,
    rw_ptr,
    stride_rw,
    w_ptr,
    stride_we,
    stride_wn,
    s_ptr,
    stride_se,
    stride_sn,
    sh_ptr,
    stride_sh,
    out_ptr,
    stride_out,
    E,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    D: tl.constexpr,
    I: tl.constexpr,
    SHARED: tl.constexpr,
    UE8M0: tl.constexpr,
    HALF_GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    E2M1_PTX: tl.constexpr,
):
    """Token ``program_id(0)``, model features ``program_id(1) * 2 * BLOCK_N ..``: its slots in
    ascending (expert, slot) order, each slot's contribution rounded as the Triton path stores
    it and summed in fp32, then ``shared`` as the reference adds it (the down projection before
    the pair programs and the combine)."""
    t = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols0 = tl.program_id(1) * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
    cols1 = cols0 + BLOCK_N
    slot = tl.arange(0, K_PAD)
    ex = tl.load(ids_ptr + t * stride_ids + slot, mask=slot < TOP_K, other=-1)
    ex = tl.where((ex >= 0) & (ex < E), ex, -1).to(tl.int32)
    done = 1 << 30
    key = tl.where((slot < TOP_K) & (ex >= 0), ex * K_PAD + slot, done)
    out0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    out1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for _ in range(TOP_K):
        m = tl.min(key, axis=0)
        if m < done:
            expert = (m // K_PAD).to(tl.int64)
            j = m % K_PAD
            w_rows = expert * stride_we + cols0.to(tl.int64) * stride_wn
            s_rows = expert * stride_se + cols0.to(tl.int64) * stride_sn
            y0, y1 = gemv_rows(
                h_ptr + (t * TOP_K + j) * I, w_ptr, w_rows, w_rows + BLOCK_N * stride_wn,
                s_ptr, s_rows, s_rows + BLOCK_N * stride_sn, cols0 < D, cols1 < D, E >> 31,
                I, dtype, UE8M0, HALF_GROUP, BLOCK_N, BLOCK_K, FP32_DOT, E2M1_PTX,
            )  # fmt: skip
            rw = round_through(tl.load(rw_ptr + t * stride_rw + j).to(tl.float32), dtype)
            out0 += round_through(round_through(y0, dtype) * rw, dtype)
            out1 += round_through(round_through(y1, dtype) * rw, dtype)
        key = tl.where(key == m, done, key)
    if SHARED:
        sh0 = tl.load(sh_ptr + t * stride_sh + cols0, mask=cols0 < D, other=0.0)
        sh1 = tl.load(sh_ptr + t * stride_sh + cols1, mask=cols1 < D, other=0.0)
        out0 = round_through(out0, dtype) + sh0.to(tl.float32)
        out1 = round_through(out1, dtype) + sh1.to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols0, cast_to(out0, dtype), mask=cols0 < D)
    tl.store(out_ptr + t * stride_out + cols1, cast_to(out1, dtype), mask=cols1 < D)


def per_token_moe(x, ids, weights, gate_up, down, limit, shared=None) -> torch.Tensor:
    """The GEMVs with :func:`_per_token_down_kernel` in place of the pair programs and the
    combine: the same ``h`` (the module's gate / up launch) and launch sizes."""
    from deepinfer_cuda_sm100.kernels import moe_gemv
    from deepinfer_cuda_sm100.kernels.moe import _weight_args

    x, ids, weights = (v.contiguous() for v in (x, ids, weights))
    t, d = x.shape
    top_k, num_experts, inter = ids.shape[1], gate_up.shape[0], down.shape[2]
    plan = moe_gemv.launch_plan(t, top_k, d, inter)
    h = moe_gemv.gate_up_h(x, ids, gate_up, limit, plan["gate_up"])
    dn, dn_se, dn_sn, dn_s, dn_sse, dn_ssn, _, ue8m0, half = _weight_args(down)
    out = torch.empty_like(x)
    sh, sh_stride = (shared.contiguous(), d) if shared is not None else (out, 0)
    p = plan["down"]
    _per_token_down_kernel[(t, p["grid"][1])](
        h, ids, ids.stride(0), weights, weights.stride(0), dn, dn_se, dn_sn, dn_s, dn_sse, dn_ssn,
        sh, sh_stride, out, out.stride(0), num_experts, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        D=d, I=inter, SHARED=shared is not None, UE8M0=ue8m0, HALF_GROUP=half, BLOCK_N=p["block_n"],
        BLOCK_K=p["block_k"], FP32_DOT=moe_gemv._FP32_DOT, E2M1_PTX=p["e2m1_ptx"],
    )  # fmt: skip
    return out


def _mismatch(label: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str | None:
    """Why ``got`` is not ``want`` within the op's tolerances relative to the largest output."""
    got, want = got.float(), want.float()
    bound = atol * max(1.0, want.abs().max().item())
    if want.abs().max().item() < 0.1:
        return f"{label}: degenerate outputs"
    if got.shape != want.shape or not torch.allclose(got, want, atol=bound, rtol=rtol):
        err = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
        return f"{label}: max abs err {err:.3g}"
    return None


def case_problems() -> list[str]:
    """Each of :data:`CASES` through the GEMVs against the reference op, within the op's
    tolerances relative to the largest output (as ``test_moe_kernel.py`` checks the FP4 path);
    those of :data:`BITWISE_CASES` also bitwise against :func:`per_token_moe`."""
    from deepinfer_cuda_sm100.kernels.moe_gemv import moe_experts

    from deepinfer_core.ops.moe import moe_experts as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    g = torch.Generator().manual_seed(5)
    problems = []
    for index, (label, *spec) in enumerate(CASES):
        args = _case(g, *spec)
        got = moe_experts(*args)
        problems.append(_mismatch(label, got, reference(*args), *DEFAULT_TOLERANCES[spec[0]]))
        if spec[-1] == "padding" and spec[1] > 1:
            alone = args[6][1] if args[6] is not None else torch.zeros_like(got[1])
            if not torch.equal(got[1], alone):
                problems.append(f"{label}: a token without valid ids is not its shared row alone")
        if index in BITWISE_CASES and not torch.equal(got, per_token_moe(*args)):
            diff = (got.float() - per_token_moe(*args).float()).abs().max().item()
            problems.append(f"{label}: pair programs + combine differ from the per-token down ({diff:.3g})")
    return [p for p in problems if p]


OVERRIDES = (
    # (case index, gate / up launch, down launch): K steps of fewer inputs than a scale group's
    # run, several runs a step, several K steps, other warps and stages
    (1, (32, 128, 2, 1), (16, 64, 2, 2)),
    (2, (32, 32, 1, 1), (32, 256, 8, 1)),
    (6, (16, 256, 4, 2), (32, 512, 4, 1)),
)


def override_problems() -> list[str]:
    """Cases of :data:`CASES` through launches other than the defaults, against the reference."""
    from deepinfer_cuda_sm100.kernels.moe_gemv import GemvLaunch, moe_experts

    from deepinfer_core.ops.moe import moe_experts as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    problems = []
    for index, gate_up, down in OVERRIDES:
        label, *spec = CASES[index]
        args = _case(torch.Generator().manual_seed(index), *spec)
        got = moe_experts(*args, gate_up_launch=GemvLaunch(*gate_up), down_launch=GemvLaunch(*down))
        tol = DEFAULT_TOLERANCES[spec[0]]
        problems.append(_mismatch(f"{label}, launches {gate_up} / {down}", got, reference(*args), *tol))
    return [p for p in problems if p]


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {"interpreted": _common.INTERPRETED, "cases": case_problems(), "overrides": override_problems()}


@slow
def test_kernel_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
def test_interpreter_gemvs_match_the_reference_and_the_per_token_down(report):
    assert not report["cases"], "\n".join(report["cases"])


@slow
def test_interpreter_launch_overrides_match_the_reference(report):
    assert not report["overrides"], "\n".join(report["overrides"])


# ---------------------------------------------------------------------------------------------
# launch plan, supports, choice (no kernel runs)


def test_launch_plan_gives_hundreds_of_programs_at_one_token():
    from deepinfer_cuda_sm100.kernels import moe_gemv

    if moe_gemv.INTERPRETED:
        pytest.skip("the interpreter's block sizes")
    plan = moe_gemv.launch_plan(1, 6, 4096, 2048)
    assert plan["gate_up"]["grid"] == (6, 2048 // moe_gemv.GATE_UP.block_n)
    assert plan["down"]["grid"] == (6, 4096 // (2 * moe_gemv.DOWN.block_n))  # a program row a pair
    assert min(p["grid"][0] * p["grid"][1] for p in plan.values()) >= 3 * 132  # H200: 132 SMs
    for p in plan.values():  # one 16-byte run (a scale group) of one row a thread and row set
        assert p["block_n"] * p["block_k"] // 32 == 32 * p["warps"]
        assert p["e2m1_ptx"] and p["stages"] == 1
    assert moe_gemv.launch_plan(3, 2, 4096, 2048)["gate_up"]["grid"][0] == 6  # a program row a pair


def test_launch_overrides_reach_the_launches(monkeypatch):
    """``gate_up_launch`` / ``down_launch``: the kernels' block sizes, warps and stages and the
    grids follow them (the combine as before); sizes other than powers of two are refused."""
    from cuda_sm100_checks import record_launches
    from deepinfer_cuda_sm100.kernels import moe, moe_gemv

    launches = record_launches(monkeypatch, moe_gemv, ("_gemv_gate_up_kernel", "_gemv_down_kernel"))
    record_launches(monkeypatch, moe, ("_combine_kernel",), launches)
    gu, dn = moe_gemv.GemvLaunch(16, 256, 2, 2), moe_gemv.GemvLaunch(4, 1024, 8)
    args = _call(t=2, d=4096, i=2048, e=2, gate_up=_fp4(2, 4096, 4096), down=_fp4(2, 4096, 2048))
    moe_gemv.moe_experts(*args, gate_up_launch=gu, down_launch=dn)
    assert [kernel.fn.__name__ for kernel, _, _ in launches] == [
        "_gemv_gate_up_kernel", "_gemv_down_kernel", "_combine_kernel"
    ]  # fmt: skip
    for (_, _, kwargs), launch in zip(launches, (gu, dn), strict=False):
        got = (kwargs["BLOCK_N"], kwargs["BLOCK_K"], kwargs["num_warps"], kwargs["num_stages"])
        assert got == tuple(launch)
    plan = moe_gemv.launch_plan(2, 6, 4096, 2048, gu, dn)
    assert plan["gate_up"]["grid"] == (12, 2048 // 16) and plan["down"]["grid"] == (12, 4096 // 8)
    assert plan["down"]["e2m1_ptx"]
    tiny = moe_gemv.launch_plan(1, 6, 4096, 2048, moe_gemv.GemvLaunch(2, 64))
    assert not tiny["gate_up"]["e2m1_ptx"]  # under 4 packed bytes a thread: the arithmetic decoding
    narrow = moe_gemv.launch_plan(1, 6, 256, 128, moe_gemv.GemvLaunch(8, 1024), moe_gemv.GemvLaunch(8, 1024))
    assert narrow["gate_up"]["block_k"] == 256 and narrow["down"]["block_k"] == 128  # at most pow2(K)
    bad_launches = (
        moe_gemv.GemvLaunch(6, 512),
        moe_gemv.GemvLaunch(8, 512, 3),
        moe_gemv.GemvLaunch(8, 512, 4, 0),
    )
    for bad in bad_launches:
        with pytest.raises(ValueError, match="powers of two"):
            moe_gemv.launch_plan(1, 6, 4096, 2048, bad)


def test_register_table_decoding_and_widening_in_the_ptx_emulator():
    """The ue8m0 path's e2m1 PTX (the tables' first words in registers) over every byte in every
    position of its input register, bitwise ``unpack_fp4`` (code 8: -0.0); then the bf16x2
    widening to fp32, bitwise."""
    from deepinfer_cuda_sm100.kernels import moe_gemv_rows as rows
    from test_moe_e2m1_ptx import _assert_bits_equal, _every_byte_in_every_lane, _want, asm_elementwise

    packed = _every_byte_in_every_lane()
    words = (rows._TABLE_L.value, rows._TABLE_H.value, rows._TABLE_SIGN.value)
    tables = [torch.full(packed.shape, w - (w >> 31 << 32), dtype=torch.int32) for w in words]  # as int32
    lo, hi = asm_elementwise(
        rows._E2M1_REG_PTX.value, rows._E2M1_REG_CONSTRAINTS.value, [packed, *tables],
        [torch.bfloat16, torch.bfloat16], pack=4,
    )  # fmt: skip
    want_lo, want_hi = _want(packed)
    _assert_bits_equal(lo, want_lo.to(torch.bfloat16), "low nibbles")
    _assert_bits_equal(hi, want_hi.to(torch.bfloat16), "high nibbles")
    for got, want in ((lo, want_lo), (hi, want_hi)):
        (wide,) = asm_elementwise(rows._WIDEN_BF16X2_PTX.value, "=r,=r,r", [got], [torch.float32], pack=2)
        assert torch.equal(wide.view(torch.int32), want.view(torch.int32))
    text = rows._E2M1_REG_PTX.value
    assert "0xBFBFBF80" not in text and "0x01010101, 0x01010101" not in text, "immediate tables left"


def _fp4(e, out, inp, scale_dtype="ue8m0", group=32):
    data = torch.zeros(e, out, inp // 2, dtype=torch.uint8)
    scale = torch.ones(e, out, inp // group)
    return QuantizedTensor(
        data, scale.to(UE8M0_DTYPE) if scale_dtype == "ue8m0" else scale, "fp4", (1, group)
    )


def _call(t=1, d=256, i=128, e=8, k=6, dtype=torch.bfloat16, **kw):
    x = torch.zeros(t, d, dtype=dtype)
    ids = torch.arange(k).repeat(t, 1) % e
    w = torch.ones(t, k)
    return x, ids, w, kw.get("gate_up", _fp4(e, 2 * i, d)), kw.get("down", _fp4(e, d, i)), 10.0


def test_gemv_supports_fp4_decode_calls_and_names_what_it_refuses():
    from deepinfer_cuda_sm100.kernels.moe_gemv import MAX_TOKENS

    assert moe_dispatch.gemv_supports(*_call()) is True
    assert moe_dispatch.gemv_supports(*_call(t=MAX_TOKENS, gate_up=_fp4(8, 256, 256, "fp32"))) is True
    assert (
        moe_dispatch.gemv_supports(*_call(d=96, i=32, gate_up=_fp4(8, 64, 96), down=_fp4(8, 96, 32))) is True
    )
    cases = {
        "bfloat16": _call(dtype=torch.float16),
        "FP4 QuantizedTensor": _call(down=torch.zeros(8, 256, 128, dtype=torch.bfloat16)),
        "groups of 64": _call(gate_up=_fp4(8, 256, 256, group=64)),
        "groups of 16": _call(down=_fp4(8, 256, 128, group=16)),
        "no (token, slot) pairs": _call(t=0),
        f"at most {MAX_TOKENS}": _call(t=MAX_TOKENS + 1),
    }
    for needle, args in cases.items():
        verdict = moe_dispatch.gemv_supports(*args)
        assert isinstance(verdict, str) and needle in verdict, (needle, verdict)


def _point(pairs: int, triton: float, gemv: float | None = None, tilelang: float | None = None):
    ms = {"triton": triton} | ({} if gemv is None else {GEMV: gemv})
    ms |= {} if tilelang is None else {"tilelang": tilelang}
    return kernel_choice.Point("moe_experts", "fp4", "bfloat16", 256, 128, pairs, 8, ms)


POINTS = (_point(6, 0.070, 0.030), _point(12, 0.080, 0.040), _point(24, 0.090, 0.088), _point(96, 0.1))
"""GEMV points at 1, 2 and 4 tokens of top-6 (at 4 a near tie), none at 16."""


@pytest.fixture
def table(monkeypatch):
    """The calls here run as on a CUDA device of sm_90 whose table holds :data:`POINTS`."""
    from cuda_sm100_checks import sm90_moe_table

    yield from sm90_moe_table(monkeypatch, POINTS)


def test_a_table_point_routes_the_call_to_the_gemvs(table, monkeypatch):
    from deepinfer_cuda_sm100.kernels import moe_gemv

    monkeypatch.setattr(moe_gemv, "moe_experts", lambda *args: "gemv")
    fn = moe_dispatch.make_moe_experts(lambda *args: "triton")
    assert fn(*_call(t=1)) == "gemv" and fn(*_call(t=2)) == "gemv"
    assert fn(*_call(t=4)) == "triton"  # within the margin: the op's own kernel
    assert fn(*_call(t=16)) == "triton"  # past the GEMVs' timed pairs: never extrapolated
    assert fn(*_call(t=1, dtype=torch.float16)) == "triton"  # a call it does not take
    with batch_invariant_mode(True):
        assert fn(*_call(t=1)) == "triton"
        assert "batch-invariant" in moe_dispatch.mode_problem(torch.device("cuda", 0))
    monkeypatch.setenv("DEEPINFER_MOE_MATH", "fp8")
    assert fn(*_call(t=1)) == "triton"


def test_the_batch_invariant_mode_never_takes_the_gemvs(table):
    for t in (1, 2):
        assert moe_dispatch.choose_language(*_call(t=t)) == GEMV
        with batch_invariant_mode(True):
            assert moe_dispatch.choose_language(*_call(t=t)) == "triton"


def test_a_table_without_gemv_points_chooses_as_before():
    """Every measured shape of the shipped table (its GEMV points left out, if any): the choice
    with the GEMVs available is the choice without them, at every pair count."""
    shipped = [p for p in kernel_choice.load_points("sm90") if p.op == "moe_experts" and GEMV not in p.ms]
    assert shipped, "the shipped table has moe_experts points"
    shapes = {(p.kind, p.dtype, p.heads, p.head_dim, p.keys) for p in shipped}
    for kind, dtype, heads, head_dim, keys in sorted(shapes):
        langs = moe_dispatch.languages(heads, head_dim)
        for pairs in (1, 6, 12, 24, 48, 96, 384, 1536, 6144, 49152):

            def choose(available, shape=(kind, dtype, heads, head_dim, pairs, keys)):
                return kernel_choice.choose("moe_experts", *shape, "sm90", available, points=tuple(shipped))

            assert choose(langs | {GEMV}) == choose(langs), (kind, heads, head_dim, keys, pairs)
            assert choose(frozenset({"triton", GEMV})) == "triton"


def test_bench_rows_with_gemv_times_become_points():
    """``bench_moe.py --write-choices``: a row's GEMV time becomes the point's ``triton_gemv``
    entry, with or without TileLang times; rows with neither stay out."""
    from cuda_sm100_checks import choice_writers

    writers = choice_writers()
    rows = [
        {"T": 1, "triton_fp4_us": 70.0, "tilelang_fp4_us": 60.0, "triton_gemv_fp4_us": 30.0},
        {"T": 2, "triton_fp4_us": 80.0, "tilelang_fp4_us": None, "triton_gemv_fp4_us": 40.0},
        {"T": 16, "triton_fp4_us": 100.0, "tilelang_fp4_us": None, "triton_gemv_fp4_us": None},
    ]
    dicts = writers.moe_points(rows, 256, 128, 8, 6)
    assert [p["tokens"] for p in dicts] == [6, 12]
    assert dicts[0]["ms"] == {"triton": 0.07, "tilelang": 0.06, GEMV: 0.03}
    assert dicts[1]["ms"] == {"triton": 0.08, GEMV: 0.04}
    points = tuple(kernel_choice.Point(**p) for p in dicts)
    langs = frozenset({"triton", "tilelang", GEMV})
    assert (
        kernel_choice.choose("moe_experts", "fp4", "bfloat16", 256, 128, 6, 8, "sm90", langs, points) == GEMV
    )
    # a later run without TileLang does not erase the times a point was taken in
    later = writers.moe_points([{"T": 1, "triton_fp4_us": 71.0, "triton_gemv_fp4_us": 31.0}], 256, 128, 8, 6)
    assert writers.keeping_languages(later, points) == []
    assert writers.keeping_languages(dicts, points) == dicts
    assert writers.keeping_languages(later, ()) == later


def test_calls_without_pairs_launch_nothing_and_plain_stacks_are_refused():
    from deepinfer_cuda_sm100.kernels.moe_gemv import moe_experts

    x, ids, w, gu, dn, lim = _call(t=2)
    shared = torch.randn(2, 256).to(torch.bfloat16)
    assert moe_experts(x[:0], ids[:0], w[:0], gu, dn, lim).shape == (0, 256)
    assert torch.equal(moe_experts(x, ids[:, :0], w[:, :0], gu, dn, lim, shared), shared)
    assert not moe_experts(x, ids[:, :0], w[:, :0], gu, dn, lim).any()
    with pytest.raises(ValueError, match="FP4"):
        moe_experts(x, ids, w, gu, torch.zeros(8, 256, 128, dtype=torch.bfloat16), lim)


# ---------------------------------------------------------------------------------------------
# compile for the GPU (no GPU needed)


def _local_memory(cubin: bytes, tmp_path) -> str | None:
    """``cuobjdump``'s resource line of a cubin (``REG:.. STACK:.. SHARED:.. LOCAL:..``), or
    ``None`` where Triton ships no ``cuobjdump``."""
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    if not tool or not os.path.exists(tool):
        return None
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout
    found = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", out)
    return found.group(0) if found else None


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("scales", ["ue8m0", "fp32"])
def test_kernels_compile_for_sm90_without_spills(scales, monkeypatch, tmp_path):
    """Both GEMV launches as the host makes them at V4-Flash widths (recorded from CPU tensors,
    two experts; no kernel runs), with and without the shared expert: the PTX decoding (for
    ue8m0 unscaled, its tables in registers, the scale folded: no bf16x2 products), the bf16
    widening, no stack or local memory."""
    from cuda_sm100_checks import compile_launch, record_launches
    from deepinfer_cuda_sm100.kernels import moe, moe_gemv

    launches = record_launches(monkeypatch, moe_gemv, ("_gemv_gate_up_kernel", "_gemv_down_kernel"))
    record_launches(monkeypatch, moe, ("_combine_kernel",), launches)
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    ids, w = torch.zeros(1, 6, dtype=torch.int64), torch.ones(1, 6)
    gate_up, down = _fp4(2, 4096, 4096, scales), _fp4(2, 4096, 2048, scales)
    moe_gemv.moe_experts(x, ids, w, gate_up, down, 10.0)
    moe_gemv.moe_experts(x, ids, w, gate_up, down, 10.0, torch.zeros_like(x))
    monkeypatch.undo()
    assert len(launches) == 6
    for kernel, args, kwargs in launches[:2]:  # (the second call's GEMVs: the same launches)
        compiled = compile_launch(kernel, args, kwargs, 90)
        ptx = compiled.asm["ptx"]
        assert "0xC0C0C0C0, m;" in ptx, "no PTX e2m1 decoding"
        assert ("prmt.b32 h0, 0xBFBFBF80" in ptx) == (scales == "fp32"), "ue8m0: the tables in registers"
        assert "mul.rn.bf16x2" not in ptx
        assert "0xFFFF0000;" in ptx, "no bf16x2 widening"
        usage = _local_memory(compiled.asm["cubin"], tmp_path)
        if usage is not None:
            assert "STACK:0 " in usage and usage.endswith("LOCAL:0"), f"{kernel.fn.__name__}: {usage}"
            print(kernel.fn.__name__, scales, usage)


# ---------------------------------------------------------------------------------------------
# GPU

V4_D, V4_I, V4_K, V4_E = 4096, 2048, 6, 64


def _v4_cases() -> list[tuple]:
    """FP4 calls at V4-Flash widths on the GPU (64 experts, random codes, scales near ``1 /
    (3 sqrt(inp))``): ue8m0 and float32 scales, 1, 2 and 4 tokens, a shared expert at 2."""
    from test_moe_kernel import _random_fp4

    out = []
    for scale in ("ue8m0", "fp32"):
        gate_up, down = _random_fp4(V4_E, 2 * V4_I, V4_D, scale), _random_fp4(V4_E, V4_D, V4_I, scale)
        for t in (1, 2, 4):
            g = torch.Generator().manual_seed(t)
            ids, weights = _routing(g, t, V4_E, V4_K)
            x = torch.randn(t, V4_D, generator=g).to(torch.bfloat16).cuda()
            shared = torch.randn(t, V4_D, generator=g).to(torch.bfloat16).cuda() if t == 2 else None
            out.append((x, ids.cuda(), weights.cuda(), gate_up, down, 10.0, shared))
    return out


@pytest.mark.gpu
def test_gpu_gemvs_match_the_reference_at_v4_flash_widths():
    from deepinfer_cuda_sm100.kernels.moe_gemv import moe_experts

    from deepinfer_core.ops.moe import moe_experts as reference

    for args in _v4_cases():
        assert moe_dispatch.gemv_supports(*args) is True
        want = reference(*args).float()
        got = moe_experts(*args).float()
        scale = want.abs().max().item()
        assert scale > 0.1, "degenerate outputs"
        torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_launch_overrides_match_the_reference():
    """A few launches of the benchmark's sweep (other rows per set, K steps, warps, stages) on
    the V4-Flash calls of one token and two."""
    from deepinfer_cuda_sm100.kernels.moe_gemv import GemvLaunch, moe_experts

    from deepinfer_core.ops.moe import moe_experts as reference

    launches = (GemvLaunch(16, 512, 8), GemvLaunch(4, 1024, 4, 2), GemvLaunch(8, 256, 2))
    cases = _v4_cases()  # ue8m0 then float32 scales, at 1, 2 and 4 tokens each
    for args in cases[:2] + cases[3:5]:
        want = reference(*args).float()
        scale = want.abs().max().item()
        for gate_up in launches:
            for down in launches:
                got = moe_experts(*args, gate_up_launch=gate_up, down_launch=down).float()
                torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_gemvs_replay_in_a_cuda_graph_bitwise():
    from deepinfer_cuda_sm100.kernels.moe_gemv import moe_experts

    for args in _v4_cases():
        eager = moe_experts(*args)
        assert torch.equal(replayed(lambda args=args: moe_experts(*args)), eager)


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
