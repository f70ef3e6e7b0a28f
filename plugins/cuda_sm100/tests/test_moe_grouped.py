"""The grouped-GEMM ``moe_experts`` path (``kernels/moe_grouped.py``) and its dispatch.

**Interpreter** (a child with ``TRITON_INTERPRET=1``, ``python test_moe_grouped.py
--interpreter-report``; ``torch._grouped_mm`` runs on the CPU):

- the whole op on FP4 stacks (ue8m0 and float32 scales) and on plain bf16 stacks, with padding
  ids (``-1`` and ``E``), a duplicated expert, a shared expert and one slot, against the
  reference op within its tolerances, and bitwise equal on FP4 stacks and on their dequantised
  copies (the dequantisation is :meth:`QuantizedTensor.dequantize`'s bits);
- the combine's weighted rows (``combine_pairs(rows=, weights=)``) bitwise equal to the down
  kernel's epilogue followed by the plain combine: each row times its weight rounded to the
  dtype, rounded once, gathered at its pair;
- the sorted pairs: stable by expert, each pair's sorted row its inverse permutation, the ends
  the counts' running sum.

**Here** (no kernel runs): the refusals, the dispatcher's choice (a table point of
``cublas_grouped`` routes FP4 and plain bf16 calls there; never in the batch-invariant mode,
never past the pair counts it was timed at) and ``bench_moe.py``'s rows as table points.

**GPU** (marked ``gpu``): V4-Flash widths (64 experts, top-6) against the reference at 256 and
2,048 tokens, FP4 bitwise its dequantised copy, and a captured CUDA graph's replay bitwise
equal to the eager call.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from deepinfer_core.ops.modes import batch_invariant_mode

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

from deepinfer_cuda_sm100 import kernel_choice, moe_dispatch  # noqa: E402
from test_moe_dequant import _call, _fp4, _routing  # noqa: E402

GROUPED = moe_dispatch.GROUPED
slow = pytest.mark.slow  # they read the report of a fresh interpreter


# ---------------------------------------------------------------------------------------------
# the interpreter child

OP_CASES = (
    # (label, T, D, I, E, k, stacks, shared, padding)
    ("FP4, ue8m0 scales, padding ids, shared", 24, 128, 64, 8, 3, "ue8m0", True, True),
    ("FP4, float32 scales", 17, 64, 96, 6, 2, "fp32", False, False),
    ("plain bf16 stacks, padding ids", 20, 64, 32, 5, 2, "bf16", True, True),
    ("one slot, one token", 1, 64, 32, 4, 1, "ue8m0", False, False),
)


def op_problems() -> list[str]:
    """Each of :data:`OP_CASES` against the reference op (and FP4 bitwise its dequantised copy)."""
    from deepinfer_cuda_sm100.kernels import moe_grouped

    from deepinfer_core.ops.moe import moe_experts as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    g = torch.Generator().manual_seed(5)
    problems = []
    for label, t, d, i, e, k, stacks, shared, padding in OP_CASES:
        gate_up, down = _fp4(g, e, 2 * i, d, "fp32" if stacks == "bf16" else stacks), _fp4(g, e, d, i)
        dense = (gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16))
        if stacks == "bf16":
            gate_up, down = dense
        ids, weights = _routing(g, t, e, k)
        if padding:
            ids[0, 0], ids[1, :], ids[2, k - 1] = -1, -1, e
            ids[3, 1] = ids[3, 0]  # a duplicated expert: both slots count
        x = torch.randn(t, d, generator=g).to(torch.bfloat16)
        sh = torch.randn(t, d, generator=g).to(torch.bfloat16) if shared else None
        got = moe_grouped.moe_experts(x, ids, weights, gate_up, down, 10.0, sh)
        if stacks != "bf16" and not torch.equal(
            got, moe_grouped.moe_experts(x, ids, weights, *dense, 10.0, sh)
        ):
            problems.append(f"{label}: FP4 stacks differ from their dequantised copies")
        ref = reference(x, ids, weights, gate_up, down, 10.0, sh).float()
        atol, rtol = DEFAULT_TOLERANCES[torch.bfloat16]
        if not torch.allclose(got.float(), ref, atol=atol * max(1.0, ref.abs().max().item()), rtol=rtol):
            problems.append(f"{label}: outside the reference's tolerances")
    return problems


def combine_problems() -> list[str]:
    """The weighted combine against the down kernel's epilogue and the plain combine."""
    from deepinfer_cuda_sm100.kernels import moe

    g = torch.Generator().manual_seed(9)
    problems = []
    for t, k, e, shared in ((7, 3, 5, True), (4, 1, 2, False)):
        ids, weights = _routing(g, t, e, k)
        ids[0, 0] = -1
        y = torch.randn(t * k, 48, generator=g).to(torch.bfloat16)
        rows = torch.randperm(t * k, generator=g).to(torch.int32)
        epilogue = (y[rows.long()].float() * weights.reshape(-1, 1).to(torch.bfloat16).float()).to(
            torch.bfloat16
        )
        sh = torch.randn(t, 48, generator=g).to(torch.bfloat16) if shared else None
        want = moe.combine_pairs(epilogue, ids, e, False, sh, torch.empty(t, 48, dtype=torch.bfloat16))
        got = moe.combine_pairs(y, ids, e, False, sh, torch.empty(t, 48, dtype=torch.bfloat16), rows, weights)
        if not torch.equal(got, want):
            problems.append(f"T={t} k={k}: the weighted combine differs from epilogue + combine")
    return problems


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {"interpreted": _common.INTERPRETED, "op": op_problems(), "combine": combine_problems()}


@slow
def test_kernels_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
def test_interpreter_op_matches_the_reference(report):
    assert not report["op"], "\n".join(report["op"])


@slow
def test_interpreter_weighted_combine_is_the_down_epilogue_then_the_combine(report):
    assert not report["combine"], "\n".join(report["combine"])


# ---------------------------------------------------------------------------------------------
# sorted pairs, refusals, dispatch (torch ops only)


def test_sorted_pairs_are_stable_by_expert_with_inverse_rows_and_running_ends():
    from deepinfer_cuda_sm100.kernels.moe_grouped import sorted_pairs

    ids = torch.tensor([[2, 0], [-1, 2], [0, 5], [1, 2]])
    order, rows, ends = sorted_pairs(ids, 4)
    # experts of the pairs 0..7: 2 0 (-1 -> 0) 2 0 (5 -> 0) 1 2
    assert order.tolist() == [1, 2, 4, 5, 6, 0, 3, 7]
    assert torch.equal(rows[order], torch.arange(8, dtype=torch.int32))
    assert ends.tolist() == [4, 5, 8, 8] and ends.dtype == torch.int32


def test_grouped_problem_names_what_it_refuses():
    from deepinfer_cuda_sm100.kernels.moe_grouped import grouped_problem, moe_experts

    g = torch.Generator().manual_seed(1)
    x, _, _, gu, dn, _ = _call()
    assert grouped_problem(x, gu, dn) is None
    assert grouped_problem(x, torch.zeros(8, 256, 256, dtype=torch.bfloat16), dn) is None
    cases = {
        "one dtype": grouped_problem(x, torch.zeros(8, 256, 256), dn),
        "over the 0.0 GiB scratch": grouped_problem(x, gu, dn, scratch_bytes=1 << 20),
        "multiples of 8": grouped_problem(
            torch.zeros(1, 36, dtype=torch.bfloat16), _fp4(g, 2, 8, 36, "fp32", 4), dn
        ),
        "scale groups of 24": grouped_problem(x, _fp4(g, 8, 256, 240, "fp32", 24), dn),
    }
    for needle, verdict in cases.items():
        assert isinstance(verdict, str) and needle in verdict, (needle, verdict)
    with pytest.raises(ValueError, match="one dtype"):
        moe_experts(x, *_call()[1:3], torch.zeros(8, 256, 256), dn, 10.0)


def test_grouped_supports_needs_a_cuda_device_of_sm90_or_sm100(monkeypatch):
    assert "sm_90 / sm_100" in moe_dispatch.grouped_supports(*_call())
    monkeypatch.setattr(moe_dispatch, "grouped_device_problem", lambda device: None)
    assert moe_dispatch.grouped_supports(*_call()) is True
    assert "float16" in moe_dispatch.grouped_supports(*_call(dtype=torch.float16))
    assert "no (token, slot) pairs" in moe_dispatch.grouped_supports(*_call(t=0))


def _point(kind: str, pairs: int, triton: float, grouped: float):
    return kernel_choice.Point(
        "moe_experts", kind, "bfloat16", 256, 128, pairs, 8, {"triton": triton, GROUPED: grouped}
    )


POINTS = tuple(
    p
    for kind in ("fp4", moe_dispatch.PLAIN_KIND)
    for p in (_point(kind, 6, 0.05, 0.50), _point(kind, 1536, 2.0, 1.0), _point(kind, 6144, 8.0, 3.0))
)
"""The grouped GEMMs slow at one token, fastest from 256 tokens (top-6) to 1024, on both kinds."""


@pytest.fixture
def table(monkeypatch):
    """The calls here run as on a CUDA device of sm_90 whose table holds :data:`POINTS`."""
    from cuda_sm100_checks import sm90_moe_table

    yield from sm90_moe_table(monkeypatch, POINTS)


@pytest.mark.parametrize("stacks", ["fp4", "bf16"])
def test_a_table_point_routes_the_call_to_the_grouped_gemms(table, monkeypatch, stacks):
    from deepinfer_cuda_sm100.kernels import moe_grouped

    def call(**kw):
        if stacks == "bf16":
            kw |= {"gate_up": torch.zeros(8, 256, 256, dtype=torch.bfloat16)}
            kw |= {"down": torch.zeros(8, 256, 128, dtype=torch.bfloat16)}
        return _call(**kw)

    monkeypatch.setattr(moe_grouped, "moe_experts", lambda *args: "grouped")
    fn = moe_dispatch.make_moe_experts(lambda *args: "triton")
    assert fn(*call(t=256)) == "grouped" and fn(*call(t=1024)) == "grouped"
    assert fn(*call(t=1)) == "triton"  # measured slower there
    assert fn(*call(t=8192)) == "triton"  # past its timed pairs: never extrapolated
    assert fn(*call(t=256, dtype=torch.float16)) == "triton"  # a call it does not take
    with batch_invariant_mode(True):
        assert fn(*call(t=256)) == "triton"


def test_choice_kind_of_plain_stacks():
    assert moe_dispatch.choice_kind(torch.zeros(2, 4, 4, dtype=torch.bfloat16)) == moe_dispatch.PLAIN_KIND


def test_bench_rows_with_grouped_times_become_points_of_both_kinds():
    from cuda_sm100_checks import choice_writers

    writers = choice_writers()
    rows = [
        {"T": 256, "triton_fp4_us": 2000.0, "cublas_grouped_fp4_us": 1000.0}
        | {"triton_bf16_us": 1500.0, "cublas_grouped_bf16_us": 800.0},
        {"T": 1, "triton_fp4_us": 50.0, "triton_bf16_us": 40.0},
    ]
    fp4 = writers.moe_points(rows, 256, 128, 8, 6)
    assert [(p["tokens"], p["kind"], p["ms"]) for p in fp4] == [(1536, "fp4", {"triton": 2.0, GROUPED: 1.0})]
    plain = writers.moe_plain_points(rows, 256, 128, 8, 6)
    assert [(p["tokens"], p["kind"], p["ms"]) for p in plain] == [
        (1536, "bf16", {"triton": 1.5, GROUPED: 0.8})
    ]


# ---------------------------------------------------------------------------------------------
# GPU

V4_D, V4_I, V4_K, V4_E = 4096, 2048, 6, 64


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["ue8m0", "fp32"])
def test_gpu_v4_flash_widths_match_the_reference(scales):
    from deepinfer_cuda_sm100.kernels import moe_grouped
    from test_moe_kernel import _random_fp4

    from deepinfer_core.ops.moe import moe_experts as reference

    gate_up, down = _random_fp4(V4_E, 2 * V4_I, V4_D, scales), _random_fp4(V4_E, V4_D, V4_I, scales)
    dense = (gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16))
    for t in (256, 2048):
        g = torch.Generator().manual_seed(t)
        ids, weights = (v.cuda() for v in _routing(g, t, V4_E, V4_K))
        x = torch.randn(t, V4_D, generator=g).to(torch.bfloat16).cuda()
        shared = torch.randn(t, V4_D, generator=g).to(torch.bfloat16).cuda()
        got = moe_grouped.moe_experts(x, ids, weights, gate_up, down, 10.0, shared)
        assert torch.equal(got, moe_grouped.moe_experts(x, ids, weights, *dense, 10.0, shared))
        want = reference(x, ids, weights, *dense, 10.0, shared).float()
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_grouped_gemms_replay_in_a_cuda_graph_bitwise():
    from cuda_sm100_checks import replayed
    from deepinfer_cuda_sm100.kernels import moe_grouped
    from test_moe_kernel import _random_fp4

    gate_up, down = _random_fp4(V4_E, 2 * V4_I, V4_D, "ue8m0"), _random_fp4(V4_E, V4_D, V4_I, "ue8m0")
    g = torch.Generator().manual_seed(5)
    ids, weights = (v.cuda() for v in _routing(g, 512, V4_E, V4_K))
    x = torch.randn(512, V4_D, generator=g).to(torch.bfloat16).cuda()
    eager = moe_grouped.moe_experts(x, ids, weights, gate_up, down, 10.0)
    assert torch.equal(replayed(lambda: moe_grouped.moe_experts(x, ids, weights, gate_up, down, 10.0)), eager)


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
