"""The dequantised-experts ``moe_experts`` path (``kernels/moe_dequant.py``) and its dispatch.

**Interpreter** (a child with ``TRITON_INTERPRET=1``, ``python test_moe_dequant.py
--interpreter-report``):

- :func:`~deepinfer_cuda_sm100.kernels.moe_dequant.dequantize_experts` bitwise against
  :meth:`QuantizedTensor.dequantize` (the reference's dequantisation): float32 and ue8m0 scales
  (with the bytes 0 and 255, read as torch reads them: ``2**-127`` and NaN), scale groups of
  16, 32 and 64, widths that are not multiples of the tiles, a slice of experts, bfloat16 and
  float16;
- the whole op bitwise against the Triton path on the dequantised stacks, with the experts
  dequantised one, two or all at a time (the scratch budget), in the default and the batch-
  invariant mode, with padding ids (``-1`` and ``E``) and a shared expert, at the default launch
  sizes and two others (:class:`~deepinfer_cuda_sm100.kernels.moe.TileLaunch`); and against the
  reference op within its tolerances.

**Here** (no kernel runs): the group sizes, the refusals and the dispatcher's choice (a table
point of ``triton_dequant`` routes a call there; never in the batch-invariant mode, never past
the pair counts it was timed at).

**GPU** (marked ``gpu``): V4-Flash widths (64 experts, top-6, ue8m0 and float32 scales) bitwise
against the Triton path on the dequantised stacks at 256 and 2048 tokens, every launch of
``bench_moe.py --tile-sweep`` against the reference, and a captured CUDA graph's replay bitwise
equal to the eager call.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from deepinfer_core.ops.modes import batch_invariant_mode
from deepinfer_core.weights.quant import QuantizedTensor

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

from deepinfer_cuda_sm100 import kernel_choice, moe_dispatch  # noqa: E402

DEQUANT = moe_dispatch.DEQUANT
slow = pytest.mark.slow  # they read the report of a fresh interpreter


def _fp4(g, e: int, out: int, inp: int, scales: str = "ue8m0", group: int = 32) -> QuantizedTensor:
    from deepinfer_core.ops._cases import randn_fp4

    return randn_fp4(g, e, out, inp, scale=inp**-0.5, group=group, scale_dtype=scales)


def _routing(g, t: int, e: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return ids, 1.5 * w / w.sum(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# the interpreter child

DEQUANT_CASES = (
    # (label, E, out, in, scales, group, dtype, start, count)
    ("ue8m0, groups of 32", 3, 40, 160, "ue8m0", 32, torch.bfloat16, 0, 3),
    ("float32 scales, a slice of experts", 4, 24, 96, "fp32", 32, torch.bfloat16, 1, 2),
    ("groups of 16, float16", 2, 17, 64, "fp32", 16, torch.float16, 0, 2),
    ("groups of 64, wide rows", 2, 8, 640, "ue8m0", 64, torch.bfloat16, 1, 1),
)


def dequantize_problems() -> list[str]:
    """Each of :data:`DEQUANT_CASES` (and ue8m0 bytes 0 and 255) against ``dequantize``."""
    from deepinfer_cuda_sm100.kernels.moe_dequant import dequantize_experts

    g = torch.Generator().manual_seed(3)
    problems = []
    for label, e, out, inp, scales, group, dtype, start, count in DEQUANT_CASES:
        w = _fp4(g, e, out, inp, scales, group)
        if scales == "ue8m0":  # the extreme bytes: 2**-127 and NaN in torch
            raw = w.scale.view(torch.uint8)
            raw[0, 0, 0], raw[-1, -1, -1] = 0, 255
        scratch = torch.full((count + 1, out, inp), 7.0, dtype=dtype)
        got = dequantize_experts(w, start, count, scratch)
        want = w.dequantize(dtype)[start : start + count]
        nan = want.isnan()  # (NaN where the scale byte is 255; its payload bits are not compared)
        same = torch.equal(got.isnan(), nan) and torch.equal(
            got[~nan].view(torch.int16), want[~nan].view(torch.int16)
        )
        if not same or not (scratch[count] == 7).all():
            problems.append(f"{label}: not bitwise dequantize(), or wrote past its experts")
    return problems


OP_CASES = (
    # (label, T, D, I, E, k, scales, scratch experts, shared, padding, batch-invariant, launch)
    ("all experts at once", 20, 256, 128, 8, 3, "ue8m0", 8, True, True, False, ()),
    ("one expert at a time", 20, 256, 128, 8, 3, "fp32", 1, False, True, False, ()),
    ("three at a time (uneven: 3, 3, 2)", 40, 128, 64, 8, 2, "ue8m0", 3, True, False, False, ()),
    ("tiles of 32 rows, two at a time", 160, 64, 64, 4, 2, "fp32", 2, False, False, False, ()),
    ("batch-invariant mode, two at a time", 12, 128, 64, 6, 3, "ue8m0", 2, True, True, True, ()),
    ("launch: 32 rows, 32 columns, K 32", 30, 128, 64, 4, 2, "fp32", 2, True, True, False, (32, 32, 32, 4)),
    ("launch: 64 rows, 128 columns", 12, 256, 128, 4, 2, "ue8m0", 4, False, False, False, (64, 128, None, 8)),
)  # fmt: skip


def op_problems() -> list[str]:
    """Each of :data:`OP_CASES` bitwise against the Triton path on the dequantised stacks (with
    the same launch sizes) and within the reference op's tolerances."""
    from deepinfer_cuda_sm100.kernels import moe, moe_dequant

    from deepinfer_core.ops.moe import moe_experts as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    g = torch.Generator().manual_seed(11)
    problems = []
    for label, t, d, i, e, k, scales, fit, shared, padding, bi, sizes in OP_CASES:
        launch = moe.TileLaunch(*sizes)
        gate_up, down = _fp4(g, e, 2 * i, d, scales), _fp4(g, e, d, i, scales)
        ids, weights = _routing(g, t, e, k)
        if padding:
            ids[0, 0], ids[1, :], ids[2, k - 1] = -1, -1, e
        x = torch.randn(t, d, generator=g).to(torch.bfloat16)
        sh = torch.randn(t, d, generator=g).to(torch.bfloat16) if shared else None
        budget = fit * (2 * i * d + d * i) * 2
        if moe_dequant.experts_per_group(gate_up, down, torch.bfloat16, budget) != -(-e // -(-e // fit)):
            problems.append(f"{label}: group size")
        with batch_invariant_mode(bi):
            got = moe_dequant.moe_experts(x, ids, weights, gate_up, down, 10.0, sh, budget, launch)
            dense = (gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16))
            want = moe.moe_experts(x, ids, weights, *dense, 10.0, sh, launch)
        if not torch.equal(got, want):
            problems.append(f"{label}: differs from the Triton path on the dequantised stacks")
        ref = reference(x, ids, weights, gate_up, down, 10.0, sh).float()
        atol, rtol = DEFAULT_TOLERANCES[torch.bfloat16]
        if not torch.allclose(got.float(), ref, atol=atol * max(1.0, ref.abs().max().item()), rtol=rtol):
            problems.append(f"{label}: outside the reference's tolerances")
    return problems


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {"interpreted": _common.INTERPRETED, "dequantize": dequantize_problems(), "op": op_problems()}


@slow
def test_kernel_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
def test_interpreter_dequantisation_is_bitwise_the_reference(report):
    assert not report["dequantize"], "\n".join(report["dequantize"])


@slow
def test_interpreter_op_is_bitwise_the_triton_path_on_dequantised_stacks(report):
    assert not report["op"], "\n".join(report["op"])


# ---------------------------------------------------------------------------------------------
# group sizes, refusals, dispatch (no kernel runs)


def _call(t=1, d=256, i=128, e=8, k=6, dtype=torch.bfloat16, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(t, d, dtype=dtype)
    ids = torch.arange(k).repeat(t, 1) % e
    w = torch.ones(t, k)
    gate_up = kw["gate_up"] if "gate_up" in kw else _fp4(g, e, 2 * i, d)
    return x, ids, w, gate_up, kw["down"] if "down" in kw else _fp4(g, e, d, i), 10.0


def test_groups_split_the_experts_evenly_within_the_budget():
    from deepinfer_cuda_sm100.kernels.moe_dequant import experts_per_group

    gate_up, down = torch.empty(64, 4096, 4096), torch.empty(64, 4096, 2048)
    per_expert = 3 * 4096 * 2048 * 2  # both stacks of one expert in bf16: 48 MiB
    assert experts_per_group(gate_up, down, torch.bfloat16, 64 * per_expert) == 64
    assert experts_per_group(gate_up, down, torch.bfloat16, 21 * per_expert + 1) == 16  # 64 / ceil(64 / 21)
    assert experts_per_group(gate_up, down, torch.bfloat16, per_expert - 1) == 1
    assert experts_per_group(gate_up, down, torch.bfloat16) == 16  # 1 GiB: 21 fit, groups of 16
    assert experts_per_group(gate_up[:0], down[:0], torch.bfloat16) == 0


def test_dequant_supports_fp4_bfloat16_calls_and_names_what_it_refuses():
    g = torch.Generator().manual_seed(1)
    assert moe_dispatch.dequant_supports(*_call()) is True
    assert moe_dispatch.dequant_supports(*_call(t=300, gate_up=_fp4(g, 8, 256, 256, "fp32", 64))) is True
    plain = torch.zeros(8, 256, 128, dtype=torch.bfloat16)
    cases = {
        "x dtype torch.float16": _call(dtype=torch.float16),
        "down is not an FP4": _call(down=plain),
        "groups of 24": _call(gate_up=_fp4(g, 8, 256, 240, "fp32", 24), d=240),
        "no (token, slot) pairs": _call(t=0),
    }
    for needle, args in cases.items():
        verdict = moe_dispatch.dequant_supports(*args)
        assert isinstance(verdict, str) and needle in verdict, (needle, verdict)


def test_the_op_refuses_plain_stacks_and_other_dtypes():
    from deepinfer_cuda_sm100.kernels.moe_dequant import dequantize_experts, moe_experts

    x, ids, w, gu, dn, lim = _call()
    with pytest.raises(ValueError, match="down is not an FP4"):
        moe_experts(x, ids, w, gu, torch.zeros(8, 256, 128, dtype=torch.bfloat16), lim)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        dequantize_experts(dn, 0, 1, torch.empty(1, 256, 128))
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_experts(dn, 0, 2, torch.empty(1, 256, 128, dtype=torch.bfloat16))
    shared = torch.randn(1, 256).to(torch.bfloat16)
    assert torch.equal(moe_experts(x, ids[:, :0], w[:, :0], gu, dn, lim, shared), shared)


def _point(pairs: int, triton: float, dequant: float | None = None, tilelang: float | None = None):
    ms = {"triton": triton} | ({} if dequant is None else {DEQUANT: dequant})
    ms |= {} if tilelang is None else {"tilelang": tilelang}
    return kernel_choice.Point("moe_experts", "fp4", "bfloat16", 256, 128, pairs, 8, ms)


POINTS = (_point(6, 0.05, 0.50), _point(1536, 2.0, 1.0), _point(6144, 8.0, 3.0))
"""The dequantised experts slow at one token, fastest from 256 tokens (top-6) to 1024."""


@pytest.fixture
def table(monkeypatch):
    """The calls here run as on a CUDA device of sm_90 whose table holds :data:`POINTS`."""
    from cuda_sm100_checks import sm90_moe_table

    yield from sm90_moe_table(monkeypatch, POINTS)


def test_a_table_point_routes_the_call_to_the_dequantised_experts(table, monkeypatch):
    from deepinfer_cuda_sm100.kernels import moe_dequant

    monkeypatch.setattr(moe_dequant, "moe_experts", lambda *args: "dequant")
    fn = moe_dispatch.make_moe_experts(lambda *args: "triton")
    assert fn(*_call(t=256)) == "dequant" and fn(*_call(t=1024)) == "dequant"
    assert fn(*_call(t=1)) == "triton"  # measured slower there
    assert fn(*_call(t=8192)) == "triton"  # past its timed pairs: never extrapolated
    assert fn(*_call(t=256, dtype=torch.float16)) == "triton"  # a call it does not take
    with batch_invariant_mode(True):
        assert fn(*_call(t=256)) == "triton"


def test_bench_rows_with_dequant_times_become_points():
    """``bench_moe.py --write-choices``: a row's dequantised-experts time becomes the point's
    ``triton_dequant`` entry; a row with it alone is a point too."""
    from cuda_sm100_checks import choice_writers

    writers = choice_writers()
    rows = [
        {"T": 256, "triton_fp4_us": 2000.0, "tilelang_fp4_us": 1500.0, "triton_dequant_fp4_us": 1000.0},
        {"T": 1024, "triton_fp4_us": 8000.0, "triton_dequant_fp4_us": 3000.0},
        {"T": 1, "triton_fp4_us": 50.0},
    ]
    dicts = writers.moe_points(rows, 256, 128, 8, 6)
    assert [p["tokens"] for p in dicts] == [1536, 6144]
    assert dicts[0]["ms"] == {"triton": 2.0, "tilelang": 1.5, DEQUANT: 1.0}
    assert dicts[1]["ms"] == {"triton": 8.0, DEQUANT: 3.0}


# ---------------------------------------------------------------------------------------------
# GPU

V4_D, V4_I, V4_K, V4_E = 4096, 2048, 6, 64


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["ue8m0", "fp32"])
def test_gpu_v4_flash_widths_bitwise_the_triton_path_on_dequantised_stacks(scales):
    from deepinfer_cuda_sm100.kernels import moe, moe_dequant
    from test_moe_kernel import _random_fp4

    from deepinfer_core.ops.moe import moe_experts as reference

    gate_up, down = _random_fp4(V4_E, 2 * V4_I, V4_D, scales), _random_fp4(V4_E, V4_D, V4_I, scales)
    dense = (gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16))
    for t in (256, 2048):
        g = torch.Generator().manual_seed(t)
        ids, weights = (v.cuda() for v in _routing(g, t, V4_E, V4_K))
        x = torch.randn(t, V4_D, generator=g).to(torch.bfloat16).cuda()
        shared = torch.randn(t, V4_D, generator=g).to(torch.bfloat16).cuda()
        args = (x, ids, weights, gate_up, down, 10.0, shared)
        got = moe_dequant.moe_experts(*args)
        assert torch.equal(got, moe.moe_experts(x, ids, weights, *dense, 10.0, shared))
        want = reference(*args).float()
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_tile_sweep_launches_match_the_reference():
    """Every launch of ``bench_moe.py --tile-sweep``'s grid on V4-Flash bf16 stacks (the
    dequantised experts' plain-stack kernels) at 2048 tokens, against the reference."""
    import sys
    from pathlib import Path

    from deepinfer_cuda_sm100.kernels import moe
    from test_moe_kernel import _random_fp4

    from deepinfer_core.ops.moe import moe_experts as reference

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from tile_sweep import tile_launch_grid

    gate_up, down = _random_fp4(V4_E, 2 * V4_I, V4_D, "ue8m0"), _random_fp4(V4_E, V4_D, V4_I, "ue8m0")
    dense = (gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16))
    g = torch.Generator().manual_seed(7)
    ids, weights = (v.cuda() for v in _routing(g, 2048, V4_E, V4_K))
    x = torch.randn(2048, V4_D, generator=g).to(torch.bfloat16).cuda()
    want = reference(x, ids, weights, *dense, 10.0).float()
    scale = want.abs().max().item()
    for launch in tile_launch_grid():
        got = moe.moe_experts(x, ids, weights, *dense, 10.0, launch=launch).float()
        torch.testing.assert_close(
            got, want, atol=2e-2 * scale, rtol=2e-2, msg=lambda m, launch=launch: f"{launch}: {m}"
        )


@pytest.mark.gpu
def test_gpu_dequantised_experts_replay_in_a_cuda_graph_bitwise():
    from cuda_sm100_checks import replayed
    from deepinfer_cuda_sm100.kernels import moe_dequant
    from test_moe_kernel import _random_fp4

    gate_up, down = _random_fp4(V4_E, 2 * V4_I, V4_D, "ue8m0"), _random_fp4(V4_E, V4_D, V4_I, "ue8m0")
    g = torch.Generator().manual_seed(5)
    ids, weights = (v.cuda() for v in _routing(g, 512, V4_E, V4_K))
    x = torch.randn(512, V4_D, generator=g).to(torch.bfloat16).cuda()
    eager = moe_dequant.moe_experts(x, ids, weights, gate_up, down, 10.0)
    assert torch.equal(replayed(lambda: moe_dequant.moe_experts(x, ids, weights, gate_up, down, 10.0)), eager)


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
