"""The ``cuda_sm100`` ``swiglu``, ``rope_cos_sin`` and ``apply_rope`` kernels at their edges.

Their conformance, batch invariance and CUDA-graph replay run with the other
:data:`~deepinfer_cuda_sm100.ops.FUSED_OPS` (``test_interpreter.py``, ``test_gpu.py``); this
module checks what those random cases rarely reach.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_swiglu_rope_tables.py --interpreter-report`` prints a JSON report and each test below
reads one part of it.  It runs

- ``swiglu`` at the limit's edges (gate and up beyond ``±L``, exactly at it and one step
  inside, gate large negative and positive, ``±inf`` and NaN; strided views of a fused
  projection, rows wider than one column tile) within 1 ulp of the reference in bfloat16 and
  float16.  In float32 within 1 ulp of the reference's formula ``x / (1 + exp(-x))`` with a
  correctly rounded ``exp`` (what PyTorch's CUDA ``silu`` computes with ``expf``; PyTorch's
  CPU ``silu``, vectorised, is itself up to a few ulps off that formula) and within the op's
  tolerance of the CPU reference;
- ``rope_cos_sin`` at large positions (up to ``2**20``, ``1_000_000`` included), scale 1 and a
  YaRN factor, int32 and strided positions, in float32, bfloat16 and float16: both tables'
  dtypes, shapes and contiguity, values within the op's tolerance of the reference; no tokens;
- ``apply_rope`` at 1 to 16 heads a program (``heads_per_program``), on whole rows and on a
  strided rope-only slice, bit for bit its default launch.

The report also holds the largest ulp distances seen, which the tests print.

**Compile** (no GPU needed): both kernels compile for sm_90 and sm_100.

**GPU** (skipped without CUDA): the same edges at V4-Flash widths (``I = 2048``, rope width 64),
float32 ``swiglu`` within 1 ulp of PyTorch's CUDA reference itself.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from cuda_sm100_checks import compile_problem

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

LIMIT = 10.0
_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF)}
_BITS[torch.float16] = _BITS[torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in representable steps between ``a`` and ``b`` (one float dtype; ``-0``
    and ``+0`` are one value; NaN must sit at the same places in both, else a huge distance)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.numel() == 0:
        return 0
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return 1 << 40
    int_dtype, magnitude = _BITS[a.dtype]

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(int_dtype).long()
        return torch.where(bits < 0, -(bits & magnitude), bits)

    d = (ordered(a) - ordered(b)).abs()
    return int(d[~nan_a].max().item()) if (~nan_a).any() else 0


def _swiglu_fn():
    from deepinfer_cuda_sm100.ops import load_ops

    return load_ops()["swiglu"].fn


def _tables_fn():
    from deepinfer_cuda_sm100.ops import load_ops

    return load_ops()["rope_cos_sin"].fn


def edge_operands(inter: int, dtype: torch.dtype, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(gate, up)`` pairs that reach the limit's edges, as strided views and contiguous."""
    step = torch.finfo(dtype).eps * LIMIT  # about one ulp at the limit
    special = [-math.inf, -1e4, -200.0, -104.0, -88.7, -30.0, -LIMIT - 1, -LIMIT - step, -LIMIT]
    special += [-LIMIT + step, -1.0, -1e-3, -0.0, 0.0, 1e-3, 1.0, LIMIT - step, LIMIT, LIMIT + step]
    special += [LIMIT + 1, 30.0, 1e4, math.inf, math.nan]
    edges = torch.tensor(special)
    n = edges.numel()
    t = -(-n * n // inter) + 2  # every (gate, up) pair of special values, then random rows
    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(t * inter, generator=g) * 12 for _ in range(2))  # beyond the limit
    gate[: n * n], up[: n * n] = edges.repeat_interleave(n), edges.repeat(n)
    fused = torch.cat([torch.randn(t, 8, generator=g), gate.view(t, inter), up.view(t, inter)], dim=1)
    fused = fused.to(dtype).to(device)
    views = (fused[:, 8 : 8 + inter], fused[:, 8 + inter :])  # as the fused projection's split
    return [views, (views[0].contiguous(), views[1].contiguous())]


def accurate_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The reference's op sequence with a correctly rounded fp32 ``exp`` (float64, rounded)."""
    g = gate.float().clamp(max=limit)
    e = torch.exp(-g.double()).float()
    act = (g / (1 + e)).to(gate.dtype)
    return act * up.clamp(min=-limit, max=limit)


def swiglu_edge_problems(inter: int, device: str, fp32_against_formula: bool) -> tuple[list[str], dict]:
    """Every ``swiglu`` edge case over 1 ulp (see the module docstring); the largest ulp seen."""
    from deepinfer_core.ops.moe import swiglu as reference
    from deepinfer_core.ops.registry import get_op

    fn, spec = _swiglu_fn(), get_op("swiglu")
    problems, seen = [], {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        worst = 0
        for k, (gate, up) in enumerate(edge_operands(inter, dtype, device)):
            got = fn(gate, up, LIMIT)
            want = reference(gate, up, LIMIT)
            if got.dtype != dtype or got.shape != gate.shape or not got.is_contiguous():
                problems.append(f"{dtype} case {k}: got {got.dtype} {tuple(got.shape)} {got.stride()}")
                continue
            d = ulp_distance(got, want)
            worst = max(worst, d)
            if dtype == torch.float32 and fp32_against_formula:
                d = ulp_distance(got, accurate_swiglu(gate, up, LIMIT))
                seen["torch.float32 vs the formula"] = max(seen.get("torch.float32 vs the formula", 0), d)
                atol, rtol = spec.tolerances[dtype]
                ok = got.isnan() == want.isnan()
                close = torch.isclose(got[~want.isnan()], want[~want.isnan()], atol=atol, rtol=rtol)
                if not (ok.all() and close.all()):
                    problems.append(f"{dtype} case {k}: outside the op's tolerance of the reference")
            if d > 1:
                problems.append(f"{dtype} case {k}: {d} ulps from the reference")
        seen[str(dtype)] = worst
    return problems, seen


def table_problems(half: int, device: str) -> tuple[list[str], dict]:
    """``rope_cos_sin`` at large positions against the reference (see the module docstring)."""
    from deepinfer_core.ops.registry import get_op
    from deepinfer_core.ops.rope import rope_cos_sin as reference

    fn, spec = _tables_fn(), get_op("rope_cos_sin")
    g = torch.Generator().manual_seed(7)
    positions = torch.cat([torch.tensor([0, 1, 65535, 999_999, 1_000_000, (1 << 20) - 1]),
                           torch.randint(0, 1 << 20, (9,), generator=g)])  # fmt: skip
    width = 2 * half
    inv = 1.0 / (10000.0 ** (torch.arange(0, width, 2).float() / width))
    inv_compress = 1.0 / (160000.0 ** (torch.arange(0, width, 2).float() / width))
    calls = [
        (positions, inv, 1.0),
        (positions, inv_compress, 0.1 * math.log(16) + 1.0),
        (positions.to(torch.int32), inv, 0.5),
        (torch.stack([positions, positions], 1)[:, 1], torch.stack([inv, inv], 1)[:, 0], 1.0),  # strided
        (positions[:0], inv, 1.0),  # no tokens
    ]
    problems, seen = [], {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        atol, rtol = spec.tolerances[dtype]
        worst = 0
        for k, (pos, freqs, scale) in enumerate(calls):
            args = (pos.to(device), freqs.to(device), scale, dtype)
            got, want = fn(*args), reference(*args)
            for name, a, b in zip(("cos", "sin"), got, want, strict=True):
                if a.dtype != dtype or a.shape != (pos.shape[0], half) or not a.is_contiguous():
                    problems.append(f"{dtype} call {k} {name}: got {a.dtype} {tuple(a.shape)} {a.stride()}")
                    continue
                worst = max(worst, ulp_distance(a, b))
                if not torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol):
                    err = (a.float() - b.float()).abs().max().item()
                    problems.append(f"{dtype} call {k} {name}: max abs err {err:.3g}")
        seen[str(dtype)] = worst
    return problems, seen


def rope_heads_problems(device: str) -> list[str]:
    """``apply_rope`` at every count of heads a program (a strided rope-only view and whole
    vectors with pass-through channels) against its default launch, bit for bit."""
    from deepinfer_cuda_sm100.kernels.rope import apply_rope

    g = torch.Generator().manual_seed(3)
    cos, sin = (torch.randn(5, 8, generator=g).to(device) for _ in range(2))
    wide = torch.randn(5, 12, 48, generator=g).to(torch.bfloat16).to(device)
    problems = []
    for label, x in (("whole rows", wide), ("rope slice", wide[..., -16:])):
        want = apply_rope(x, cos, sin)
        for heads in (1, 2, 4, 8, 16):
            if not torch.equal(apply_rope(x, cos, sin, heads_per_program=heads), want):
                problems.append(f"{label}: {heads} heads a program differ from the default launch")
    return problems


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    report: dict = {"interpreted": _common.INTERPRETED}
    report["swiglu"], report["swiglu_ulps"] = swiglu_edge_problems(1100, "cpu", fp32_against_formula=True)
    report["tables"], report["table_ulps"] = table_problems(32, "cpu")
    report["rope_heads"] = rope_heads_problems("cpu")
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernels (~5 s)


@slow
def test_kernels_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
def test_interpreter_swiglu_at_the_limit_edges(report):
    print("swiglu: largest ulp distance from the reference:", report["swiglu_ulps"])
    assert not report["swiglu"], "\n".join(report["swiglu"])
    assert report["swiglu_ulps"]["torch.bfloat16"] <= 1 and report["swiglu_ulps"]["torch.float16"] <= 1


@slow
def test_interpreter_rope_tables_at_large_positions(report):
    print("rope_cos_sin: largest ulp distance from the reference:", report["table_ulps"])
    assert not report["tables"], "\n".join(report["tables"])


# ---------------------------------------------------------------------------------------------
# supports (no Triton kernel runs)


@pytest.mark.parametrize(
    ("op", "args", "reason"),
    [
        ("swiglu", (torch.ones(2, 8), torch.ones(2, 8).bfloat16(), 10.0), "differs from gate dtype"),
        ("swiglu", (torch.ones(2, 8), torch.ones(2, 6), 10.0), "up has shape (2, 6)"),
        ("swiglu", (torch.ones(2, 2, 8), torch.ones(2, 2, 8), 10.0), "has 3 dims"),
        ("swiglu", (torch.ones(2, 8).double(), torch.ones(2, 8).double(), 10.0), "dtype torch.float64"),
        ("swiglu", (torch.ones(2, 8), torch.ones(2, 8), torch.tensor(10.0)), "not a number"),
        ("rope_cos_sin", (torch.ones(4), torch.ones(8), 1.0, torch.float32), "integer tensor"),
        ("rope_cos_sin", (torch.ones(4, 2).long(), torch.ones(8), 1.0, torch.float32), "integer tensor"),
        ("rope_cos_sin", (torch.arange(4), torch.ones(8, 1), 1.0, torch.float32), "inv_freq has 2 dims"),
        ("rope_cos_sin", (torch.arange(4), torch.arange(8), 1.0, torch.float32), "not a floating-point"),
        ("rope_cos_sin", (torch.arange(4), torch.ones(8), 1.0, torch.float64), "dtype torch.float64"),
    ],
)
def test_refusals_name_the_reason(op, args, reason):
    from deepinfer_cuda_sm100.ops import make_supports

    verdict = make_supports(interpreted=True)[op](*args)
    assert isinstance(verdict, str) and reason in verdict, verdict


def test_the_v4_flash_cases_are_supported():
    """The GPU tier's cases pass ``supports`` (the interpreter's predicates on CPU tensors: the
    same checks of shapes, dtypes and strides)."""
    from deepinfer_cuda_sm100.cases import V4_FLASH, own_cases
    from deepinfer_cuda_sm100.ops import make_supports

    supports = make_supports(interpreted=True)
    for op in ("swiglu", "rope_cos_sin"):
        for args, kwargs in own_cases(V4_FLASH)[op](torch.Generator().manual_seed(0), torch.bfloat16):
            assert supports[op](*args, **kwargs) is True


# ---------------------------------------------------------------------------------------------
# compile


@slow
@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_the_gpu(arch, monkeypatch):
    """Both kernels at V4-Flash shapes, in bf16 and fp32, compile for ``sm_<arch>`` (launch
    arguments recorded from CPU tensors; no kernel runs)."""
    from cuda_sm100_checks import compile_launch, record_launches

    if compile_problem() is not None:
        pytest.skip(compile_problem())
    from deepinfer_cuda_sm100.kernels import rope as kr
    from deepinfer_cuda_sm100.kernels import swiglu as ks

    launches = record_launches(monkeypatch, ks, ("_swiglu_kernel",))
    record_launches(monkeypatch, kr, ("_cos_sin_kernel",), launches)
    inv = torch.ones(32)
    for dtype in (torch.bfloat16, torch.float32):
        fused = torch.empty(64, 256 + 2 * 2048, dtype=dtype)
        ks.swiglu(fused[:, 256:2304], fused[:, 2304:], 10.0)
        kr.rope_cos_sin(torch.zeros(7, dtype=torch.int64), inv, 1.0, dtype)
    monkeypatch.undo()
    assert len(launches) == 4
    for kernel, args, kwargs in launches:
        kwargs = {k: v for k, v in kwargs.items() if k != "enable_reflect_ftz"}  # not a constexpr
        ptx = compile_launch(kernel, args, kwargs, arch).asm["ptx"]
        if kernel is ks._swiglu_kernel:
            assert "div.rn.f32" in ptx, "silu's division is not IEEE"


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
def test_gpu_swiglu_at_the_limit_edges():
    problems, seen = swiglu_edge_problems(2048, "cuda", fp32_against_formula=False)
    print("swiglu on the GPU: largest ulp distance from the reference:", seen)
    assert not problems, "\n".join(problems)


@slow
def test_interpreter_rope_at_any_heads_a_program(report):
    assert not report["rope_heads"], "\n".join(report["rope_heads"])


def test_rope_refuses_heads_a_program_not_a_power_of_two():
    from deepinfer_cuda_sm100.kernels.rope import apply_rope

    with pytest.raises(ValueError, match="heads_per_program=3, not a power of two"):
        apply_rope(torch.zeros(2, 3, 8), torch.zeros(2, 2), torch.zeros(2, 2), heads_per_program=3)


@needs_cuda
def test_gpu_rope_at_any_heads_a_program():
    problems = rope_heads_problems("cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_rope_tables_at_large_positions():
    problems, seen = table_problems(32, "cuda")
    print("rope_cos_sin on the GPU: largest ulp distance from the reference:", seen)
    assert not problems, "\n".join(problems)


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
