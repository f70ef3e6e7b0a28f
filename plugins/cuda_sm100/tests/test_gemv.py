"""The dense GEMV (:mod:`deepinfer_cuda_sm100.kernels.gemv`): ``linear`` on a plain weight at
decode widths, against the reference ``F.linear`` and the float64 product.

**Interpreter** (a child with ``TRITON_INTERPRET=1``, as every kernel test here): both kernels
(one row; 2 to 16 rows) at ragged weight-row counts, within the op's tolerance of ``F.linear``
and no further from the float64 product than twice the reference's distance; a row's result does
not depend on the other rows of its call.

**Here**: which calls the backend's ``linear`` gives the GEMV (``supports``: where the shipped
table measured it faster than cuBLAS: the LM head at 1 to 16 rows, the narrow plain weights at
one row; on the kernels' device, not in the batch-invariant mode) and the reason it names for
the others; the one-row programs' rows; both kernels compile for sm_90 and, with PDL, wait for
the kernel before them ahead of their first global load.

**GPU**: V4-Flash's LM head (``129280 x 4096``) at 1, 4, 16 rows against the reference, through
the backend's op table, and replayed in a CUDA graph bitwise.
"""

from __future__ import annotations

import json
import os
import sys

import cuda_sm100_checks as checks
import pytest
import torch
import torch.nn.functional as F
from cuda_sm100_checks import compile_problem
from deepinfer_cuda_sm100.ops import PLAIN_WEIGHT_REFUSAL

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

SMALL = ((1, 40, 2048), (1, 9, 1024), (2, 72, 512), (5, 40, 256), (16, 130, 768))
"""``(rows, N, K)`` interpreter cases: N ragged against both kernels' row blocks."""
HEAD = (129280, 4096)
"""V4-Flash's LM head ``N x K``."""


def _bf16(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.bfloat16)


def _operands(m: int, n: int, k: int, device: str, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 7 * m + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x.to(device), w.to(device)


def accuracy_problems(device: str, shapes, dtype=torch.bfloat16) -> list[str]:
    """Each shape's GEMV within the op's tolerance of ``F.linear`` and no further from the
    float64 product than twice ``F.linear``'s distance (plus one rounding of the output)."""
    from deepinfer_cuda_sm100.kernels.gemv import gemv

    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    problems = []
    for m, n, k in shapes:
        x, w = _operands(m, n, k, device, dtype)
        got, want = gemv(x, w), F.linear(x, w)
        if got.shape != (m, n) or got.dtype != dtype:
            problems.append(f"M={m} {n}x{k}: {tuple(got.shape)} {got.dtype}")
            continue
        if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
            problems.append(f"M={m} {n}x{k}: off F.linear by {(got.float() - want.float()).abs().max():.3g}")
        exact = x.double() @ w.double().t()
        ulp = exact.abs().max().item() * 2.0**-8  # one bf16 rounding of the largest output
        err, ref = (got.double() - exact).abs().max().item(), (want.double() - exact).abs().max().item()
        if err > 2 * ref + ulp:
            problems.append(f"M={m} {n}x{k}: {err:.3g} from the float64 product, F.linear {ref:.3g}")
    return problems


def row_independence_problems(device: str) -> list[str]:
    """A row of a 2-to-16-row call gives the same bits as in a call of other rows around it."""
    from deepinfer_cuda_sm100.kernels.gemv import gemv

    x, w = _operands(16, 72, 512, device)
    full = gemv(x, w)
    parts = ((0, 2), (3, 8), (9, 16))
    return [f"rows {a}:{b} differ" for a, b in parts if not torch.equal(gemv(x[a:b], w), full[a:b])]


def interpreter_report() -> dict:
    """The interpreter checks, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {
        "interpreted": _common.INTERPRETED,
        "accuracy": accuracy_problems("cpu", SMALL),
        "rows": row_independence_problems("cpu"),
    }


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernels
test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted


@slow
def test_interpreter_gemv_is_as_accurate_as_the_reference(report):
    assert not report["accuracy"], "\n".join(report["accuracy"])


@slow
def test_interpreter_a_rows_result_does_not_depend_on_the_other_rows(report):
    assert not report["rows"], "\n".join(report["rows"])


def _linear_supports(interpreted: bool = True):
    from deepinfer_cuda_sm100.ops import make_supports

    return make_supports(interpreted)["linear"]


@pytest.fixture(scope="module")
def head() -> torch.Tensor:
    """V4-Flash's LM head, unwritten (the checks read shapes, dtypes and strides only)."""
    return torch.empty(*HEAD, dtype=torch.bfloat16)


def test_supports_takes_the_gemv_where_the_table_measured_it_faster(head):
    """The shipped SM90 table holds the head at 1, 2, 4 and 16 rows, the GEMV faster there: those
    calls, and the rows between them, take it; a narrow plain weight (a compressor's 2048 x 4096)
    takes it at one row only, where it was faster; other weights, dtypes and row counts keep
    cuBLAS (through the reference), with the reason."""
    from deepinfer_cuda_sm100.gemm_dispatch import dense_refusal

    sup = _linear_supports()
    for rows in (1, 2, 4, 9, 16):
        assert sup(_bf16(rows, HEAD[1]), head) is True, rows
    assert sup(_bf16(2, 3, HEAD[1]), head) is True  # [..., K] rows
    narrow = _bf16(2048, 4096)
    assert sup(_bf16(1, 4096), narrow) is True
    for rows in (2, 4, 16):
        assert "cuBLAS, as measured" in dense_refusal(_bf16(rows, 4096), narrow, interpreted=True), rows
    unmeasured = [
        (_bf16(1, 4096), _bf16(8192, 4096)),  # a weight the table has no point of
        (torch.empty(1, 4096, dtype=torch.float16), head.view(torch.float16)),  # fp16: unmeasured
    ]
    for x, w in unmeasured:
        assert "cuBLAS, as measured" in dense_refusal(x, w, interpreted=True)
        assert sup(x, w) == PLAIN_WEIGHT_REFUSAL
    assert "17 rows" in dense_refusal(_bf16(17, HEAD[1]), head, interpreted=True)


def test_a_plain_grouped_projection_keeps_the_reference(head):
    """``grouped_linear`` is block diagonal, not one ``linear``: a plain weight goes to the
    reference's batched GEMM even at a weight and row count the GEMV's table holds."""
    from deepinfer_cuda_sm100.ops import make_supports

    x = _bf16(1, 1, HEAD[1])
    assert _linear_supports()(x[:, 0], head) is True
    assert make_supports(True)["grouped_linear"](x, head) == PLAIN_WEIGHT_REFUSAL


@pytest.mark.parametrize(
    ("x", "w", "reason"),
    [
        (_bf16(17, 1024), _bf16(8192, 1024), "17 rows"),
        (_bf16(1, 1000), _bf16(8192, 1000), "K=1000"),
        (torch.empty(2, 1024), torch.empty(8192, 1024), "torch.float32"),
        (_bf16(1, 1024), torch.empty(8192, 1024, dtype=torch.float16), "both alike"),
        (_bf16(1, 1024), _bf16(8192, 2048)[:, ::2], "strides"),
        (_bf16(1, 1024), _bf16(8192, 512), "do not form"),
    ],
)
def test_gemv_problem_names_what_it_refuses(x, w, reason):
    from deepinfer_cuda_sm100.kernels.gemv import gemv_problem

    verdict = gemv_problem(x, w, interpreted=True)
    assert isinstance(verdict, str) and reason in verdict, verdict
    assert _linear_supports()(x, w) == PLAIN_WEIGHT_REFUSAL  # the reference's cuBLAS serves it


def test_one_row_programs_spread_narrow_weights_over_the_sms():
    from deepinfer_cuda_sm100.kernels.gemv import ROW_BLOCK_N, row_block_n

    assert row_block_n(HEAD[0], 132) == ROW_BLOCK_N
    assert [row_block_n(n, 132) for n in (2048, 1024, 512, 64)] == [4, 2, 1, 1]
    for n in (64, 300, 2048, 5000, HEAD[0]):
        block = row_block_n(n, 132)
        assert block == 1 or n >= 2 * 132 * block


def test_the_batch_invariant_mode_and_other_devices_keep_the_reference():
    from deepinfer_cuda_sm100.kernels.gemv import gemv_problem

    from deepinfer_core.ops.modes import batch_invariant_mode

    x, w = torch.empty(1, 1024, dtype=torch.bfloat16), torch.empty(8192, 1024, dtype=torch.bfloat16)
    with batch_invariant_mode():
        assert "batch-invariant" in gemv_problem(x, w, interpreted=True)
    assert "GPU" in gemv_problem(x, w, interpreted=False)  # CPU tensors, compiled kernels


def test_bench_rows_become_table_points():
    """``bench_dense_gemv.py --write-choices``: a shape's cuBLAS and GEMV times become one point
    (ms); a shape the GEMV did not time and the sweep's rows do not."""
    from cuda_sm100_checks import choice_writers
    from deepinfer_cuda_sm100 import kernel_choice

    rows = [
        {"n": 2048, "k": 4096, "m": 1, "path": "cublas", "us": 12.0},
        {"n": 2048, "k": 4096, "m": 1, "path": "gemv", "us": 7.5},
        {"n": 2048, "k": 4096, "m": 1, "path": "sweep_row", "us": 7.0},
        {"n": 64, "k": 4096, "m": 1, "path": "cublas", "us": 5.0},
    ]
    points = choice_writers().dense_points(rows)
    assert points == [
        {"op": "linear_dense", "kind": "w16", "dtype": "bfloat16", "heads": 2048, "head_dim": 4096,
         "tokens": 1, "keys": 4096, "ms": {"cublas": 0.012, "triton": 0.0075}}
    ]  # fmt: skip
    table = tuple(kernel_choice.Point(**p) for p in points)
    pick = kernel_choice.choose(
        "linear_dense", "w16", "bfloat16", 2048, 4096, 1, 4096, "sm90",
        frozenset({"cublas", "triton"}), points=table, default="cublas",
    )  # fmt: skip
    assert pick == "triton"


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("rows", [1, 4])
def test_the_kernels_compile_for_sm90_and_wait_before_their_loads(rows, monkeypatch):
    """The head's shape, bf16 (launch arguments recorded from CPU tensors; no kernel runs); with
    PDL the grid-dependency wait comes before the first global load."""
    from cuda_sm100_checks import compile_launch, record_launches
    from deepinfer_cuda_sm100.kernels import gemv

    monkeypatch.setattr(gemv, "pdl_args", lambda: {"USE_PDL": True})
    launches = record_launches(monkeypatch, gemv, ("_gemv_row_kernel", "_gemv_dot_kernel"))
    gemv.gemv(torch.empty(rows, HEAD[1], dtype=torch.bfloat16), torch.empty(*HEAD, dtype=torch.bfloat16))
    monkeypatch.undo()
    assert len(launches) == 1
    kernel, args, kwargs = launches[0]
    ptx = compile_launch(kernel, args, kwargs, 90).asm["ptx"]
    loads = [ptx.find(op) for op in ("ld.global", "cp.async") if op in ptx]  # the dot kernel: cp.async
    assert loads and "griddepcontrol.wait" in ptx and ptx.index("griddepcontrol.wait") < min(loads)


needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
def test_gpu_the_head_through_the_backend_matches_the_reference():
    """V4-Flash's head at 1, 4 and 16 rows: the backend's ``linear`` runs the GEMV (its bits),
    which is as accurate as the reference; the small interpreter shapes too."""
    from deepinfer_cuda_sm100.kernels.gemv import gemv
    from deepinfer_cuda_sm100.ops import load_ops

    from deepinfer_core.ops.table import OpTable

    table = OpTable({"linear": load_ops()["linear"]}, backend="cuda_sm100")
    problems = accuracy_problems("cuda", [(m, *HEAD) for m in (1, 4, 16)] + list(SMALL))
    for m in (1, 4, 16):
        x, w = _operands(m, *HEAD, "cuda")
        if not torch.equal(table.linear(x, w), gemv(x, w)):
            problems.append(f"M={m}: the backend's linear is not the GEMV")
    problems += row_independence_problems("cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_graph_replay_is_bitwise():
    from deepinfer_cuda_sm100.kernels.gemv import gemv

    for m in (1, 4):
        x, w = _operands(m, *HEAD, "cuda")
        gemv(x, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv(x, w)
        x.copy_(torch.randn(m, HEAD[1], device="cuda").to(x.dtype))
        graph.replay()
        assert torch.equal(out, gemv(x, w)), f"M={m}: the replay differs"


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
