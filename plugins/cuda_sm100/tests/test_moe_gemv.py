"""The decode-width FP4 ``moe_experts`` GEMVs (``kernels/moe_gemv.py``) and their dispatch.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not leak
into this pytest process, so the kernels run in a child (``python test_moe_gemv.py
--interpreter-report`` prints a JSON report the tests below read): on FP4 stacks with ue8m0 and
float32 scales, with and without the shared expert's output, at T = 1, 2, 3 over 4 to 16
experts, top-2 and top-6, hidden 256 / intermediate 128, against the reference op within its
tolerances; also a token routed twice to one expert, padding ids (``-1`` and ``E``, a token
with none valid), a strided ``x`` and float32 activations.

**Here** (no kernel runs): the launch plan, :func:`~deepinfer_cuda_sm100.moe_dispatch.
gemv_supports` and its reasons, the dispatcher's choice (a table point of ``triton_gemv`` routes
the call to the GEMVs; the batch-invariant mode and the FP8 math never do; never past the pair
counts it was timed at; a table without its points chooses as before), the benchmark rows as
table points, and calls without pairs.

**Compile** (no GPU needed, slow): both kernels as the host launches them at V4-Flash widths
compile for sm_90 with the PTX e2m1 decoding, and ``cuobjdump`` finds no stack or local memory
(no spills).

**GPU** (marked ``gpu``): V4-Flash widths (hidden 4096, intermediate 2048, 64 experts, top-6,
T = 1, 2, 4; both scale formats; a shared expert) against the reference, and a captured CUDA
graph's replay bitwise equal to the eager call.
"""

from __future__ import annotations

import functools
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

GEMV = moe_dispatch.GEMV
slow = pytest.mark.slow  # they read the report of a fresh interpreter, or compile

CASES = (
    # (label, dtype, T, D, I, E, k, scales, shared, variant)
    ("T=1 top-6 ue8m0", torch.bfloat16, 1, 256, 128, 8, 6, "ue8m0", False, ""),
    ("T=1 top-6 fp32 scales, shared", torch.bfloat16, 1, 256, 128, 16, 6, "fp32", True, ""),
    ("T=2 top-2 ue8m0, shared", torch.bfloat16, 2, 256, 128, 4, 2, "ue8m0", True, ""),
    ("T=2 top-6 fp32 scales, strided x", torch.bfloat16, 2, 256, 128, 16, 6, "fp32", False, "strided"),
    ("T=3 top-2 fp32 scales, an expert twice", torch.bfloat16, 3, 256, 128, 4, 2, "fp32", False, "twice"),
    ("T=3 top-6 ue8m0, padding ids, shared", torch.bfloat16, 3, 256, 128, 8, 6, "ue8m0", True, "padding"),
    ("T=2 top-6 float32 x, ue8m0", torch.float32, 2, 256, 128, 8, 6, "ue8m0", True, ""),
)


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
        ids[0, 1], ids[1, :], ids[2, 0] = -1, -1, e
    sh = torch.randn(t, d, generator=g).to(dtype) if shared else None
    return x, ids, weights, gate_up, down, 10.0, sh


# ---------------------------------------------------------------------------------------------
# the interpreter child


def case_problems() -> list[str]:
    """Each of :data:`CASES` through the GEMVs against the reference op, within the op's
    tolerances relative to the largest output (as ``test_moe_kernel.py`` checks the FP4 path)."""
    from deepinfer_cuda_sm100.kernels.moe_gemv import moe_experts

    from deepinfer_core.ops.moe import moe_experts as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    g = torch.Generator().manual_seed(5)
    problems = []
    for label, *spec in CASES:
        args = _case(g, *spec)
        atol, rtol = DEFAULT_TOLERANCES[spec[0]]
        got, want = moe_experts(*args).float(), reference(*args).float()
        bound = atol * max(1.0, want.abs().max().item())
        if want.abs().max().item() < 0.1:
            problems.append(f"{label}: degenerate outputs")
        if got.shape != want.shape or not torch.allclose(got, want, atol=bound, rtol=rtol):
            err = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
            problems.append(f"{label}: max abs err {err:.3g}")
        if spec[-1] == "padding" and not torch.equal(got[1], args[6][1].float()):
            problems.append(f"{label}: a token without valid ids is not its shared row alone")
    return problems


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {"interpreted": _common.INTERPRETED, "cases": case_problems()}


@slow
def test_kernel_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
def test_interpreter_gemvs_match_the_reference(report):
    assert not report["cases"], "\n".join(report["cases"])


# ---------------------------------------------------------------------------------------------
# launch plan, supports, choice (no kernel runs)


def test_launch_plan_gives_hundreds_of_programs_at_one_token():
    from deepinfer_cuda_sm100.kernels import moe_gemv

    plan = moe_gemv.launch_plan(1, 6, 4096, 2048)
    if moe_gemv.INTERPRETED:
        pytest.skip("the interpreter's block sizes")
    assert plan["gate_up"]["grid"] == (6, 2048 // moe_gemv.GATE_UP_BLOCK_N)
    assert plan["down"]["grid"] == (1, 4096 // (2 * moe_gemv.DOWN_BLOCK_N))
    assert min(p["grid"][0] * p["grid"][1] for p in plan.values()) >= 3 * 132  # H200: 132 SMs
    for p in plan.values():  # one 16-byte run (a scale group) of one row a thread and row set
        assert p["block_n"] * p["block_k"] // 32 == 32 * moe_gemv.WARPS
        assert p["e2m1_ptx"]
    assert moe_gemv.launch_plan(3, 2, 4096, 2048)["gate_up"]["grid"][0] == 6  # a program row a pair


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
    cuda, real_mode_problem = torch.device("cuda", 0), moe_dispatch.mode_problem
    monkeypatch.setattr(moe_dispatch, "mode_problem", lambda device: real_mode_problem(cuda))
    monkeypatch.setattr(kernel_choice, "device_arch", lambda device: "sm90")
    table = functools.cache(lambda arch: POINTS if arch == "sm90" else ())
    monkeypatch.setattr(kernel_choice, "load_points", table)
    kernel_choice._choose_shipped.cache_clear()
    yield
    monkeypatch.undo()
    kernel_choice.forget()


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
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "choice_writers.py"
    spec = importlib.util.spec_from_file_location("choice_writers", script)
    writers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writers)
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
    """Both launches as the host makes them at V4-Flash widths (recorded from CPU tensors, one
    expert; no kernel runs), with and without the shared expert: the PTX decoding (and for ue8m0
    the bf16x2 scale products), the bf16 widening, no stack or local memory."""
    from cuda_sm100_checks import compile_launch, record_launches
    from deepinfer_cuda_sm100.kernels import moe_gemv

    launches = record_launches(monkeypatch, moe_gemv, ("_gemv_gate_up_kernel", "_gemv_down_kernel"))
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    ids, w = torch.zeros(1, 6, dtype=torch.int64), torch.ones(1, 6)
    gate_up, down = _fp4(1, 4096, 4096, scales), _fp4(1, 4096, 2048, scales)
    moe_gemv.moe_experts(x, ids, w, gate_up, down, 10.0)
    moe_gemv.moe_experts(x, ids, w, gate_up, down, 10.0, torch.zeros_like(x))
    monkeypatch.undo()
    assert len(launches) == 4
    for kernel, args, kwargs in (launches[0], launches[1], launches[3]):  # (2: as 0)
        compiled = compile_launch(kernel, args, kwargs, 90)
        ptx = compiled.asm["ptx"]
        assert "prmt.b32 h0, 0xBFBFBF80" in ptx, "no PTX e2m1 decoding"
        assert ("mul.rn.bf16x2" in ptx) == (scales == "ue8m0")
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
def test_gpu_gemvs_replay_in_a_cuda_graph_bitwise():
    from deepinfer_cuda_sm100.kernels.moe_gemv import moe_experts

    for args in _v4_cases():
        eager = moe_experts(*args)
        assert torch.equal(replayed(lambda args=args: moe_experts(*args)), eager)


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
