"""The ``cuda_sm100`` token embedding (``embedding``) against ``F.embedding``.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_embedding.py --interpreter-report`` prints a JSON report and each test below reads one part
of it.  It runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` holding the op: the core's
  cases and the kernel's (:data:`deepinfer_cuda_sm100.embedding_ops.SMALL_TABLE`) in float32,
  bfloat16 and float16, in the default and the batch-invariant mode;
- the edges (:func:`edge_problems`): every row bitwise ``F.embedding``'s (signed zeros, NaN and
  infinities copied as they are, the table's first and last rows, repeated ids, int32 and
  strided ids, tables with a row stride of their own and column-major, widths around a column
  tile, no tokens), and an id outside the table reading nothing (zeros).

**Compile** (no GPU needed): the kernel compiles for sm_90 and sm_100 and, with PDL, waits for
the kernel before it ahead of its first global load.

**GPU** (skipped without CUDA): conformance at
:data:`~deepinfer_cuda_sm100.embedding_ops.V4_FLASH_TABLE`, the edges, and the replay of a
captured CUDA graph on new ids.
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

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

OP = "embedding"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_impl = checks.op_impl("embedding_ops", "embedding_ops", OP)
_conformance = checks.op_conformance("cuda_sm100_embedding", OP, _impl)  # both modes, the op alone


def _table(vocab: int, width: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    w = torch.randn(vocab, width, generator=torch.Generator().manual_seed(vocab + width)).to(dtype)
    specials = torch.tensor([-0.0, float("nan"), float("inf"), 0.0], dtype=dtype)
    w[0, : min(width, 4)] = specials[: min(width, 4)]
    w[-1, -min(width, 2) :] = torch.tensor([float("-inf"), -0.0], dtype=dtype)[-min(width, 2) :]
    return w.to(device)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN and signed zeros compared as bits)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return got.numel() == 0 or torch.equal(
        got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    )


def edge_problems(device: str, dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[str]:
    """Every edge's rows against ``F.embedding``'s, bit for bit (see the module docstring)."""
    fn = _impl().fn
    problems = []
    for dtype in dtypes:
        for width in (1, 31, 1024, 1025, 1500):
            w = _table(40, width, dtype, device)
            cases = {
                "edges": torch.tensor([0, 39, 7, 7, 0], device=device),
                "int32": torch.tensor([3, 39, 0], dtype=torch.int32, device=device),
                "strided": torch.arange(40, device=device).flip(0)[::3],
                "none": torch.zeros(0, dtype=torch.long, device=device),
            }
            for name, ids in cases.items():
                got, want = fn(ids, w), F.embedding(ids.long(), w)
                if not _same_bits(got, want):
                    problems.append(f"{dtype} D={width} {name}: differs from F.embedding")
        wide = _table(40, 96, dtype, device)
        view = torch.cat([wide, wide], dim=1)[:, 96:]  # rows of a wider buffer
        ids = torch.tensor([1, 38, 2], device=device)
        if not _same_bits(fn(ids, view), F.embedding(ids, view)):
            problems.append(f"{dtype}: a table with a row stride of its own differs")
        columns = wide.t().contiguous().t()  # a column stride of 40
        if not _same_bits(fn(ids, columns), F.embedding(ids, columns)):
            problems.append(f"{dtype}: a column-major table differs")
        outside = fn(torch.tensor([40, -1, 5], device=device), _table(40, 33, dtype, device))
        if outside[:2].abs().max() != 0 or not _same_bits(outside[2], _table(40, 33, dtype, device)[5]):
            problems.append(f"{dtype}: an id outside the table did not give zeros")
    return problems


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {
        "interpreted": _common.INTERPRETED,
        "conformance": _conformance("cpu", DTYPES),
        "edges": edge_problems("cpu"),
    }


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernel
test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared tests
test_interpreter_conformance = checks.test_interpreter_conformance


@slow
def test_interpreter_edges_are_f_embedding(report):
    assert not report["edges"], "\n".join(report["edges"])


def _supports(interpreted: bool):
    from deepinfer_cuda_sm100.embedding_ops import make_supports

    return make_supports(interpreted)


def test_supports_takes_integer_ids_and_float_tables():
    sup = _supports(True)
    for dtype in DTYPES:
        assert sup(torch.zeros(3, dtype=torch.long), torch.zeros(10, 8, dtype=dtype)) is True
    assert sup(torch.zeros(6, dtype=torch.int32)[::2], torch.zeros(10, 16)[:, 4:12]) is True


@pytest.mark.parametrize(
    ("ids", "weight", "reason"),
    [
        (torch.zeros(3), torch.zeros(10, 8), "ids dtype torch.float32"),
        (torch.zeros(2, 3, dtype=torch.long), torch.zeros(10, 8), "ids has 2 dims"),
        (
            torch.zeros(3, dtype=torch.long),
            torch.zeros(10, 8, dtype=torch.float64),
            "weight dtype torch.float64",
        ),
        (torch.zeros(3, dtype=torch.long), torch.zeros(10, 8, 2), "weight has 3 dims"),
        ([1, 2], torch.zeros(10, 8), "not a tensor"),
    ],
)
def test_supports_refuses_with_the_reason(ids, weight, reason):
    verdict = _supports(True)(ids, weight)
    assert isinstance(verdict, str) and reason in verdict, verdict


def test_compiled_supports_takes_cuda_tensors_only():
    verdict = _supports(False)(torch.zeros(2, dtype=torch.long), torch.zeros(4, 8))
    assert isinstance(verdict, str) and "GPU" in verdict


def test_the_backend_provides_the_op():
    from deepinfer_cuda_sm100.ops import PROVIDED_OPS

    assert OP in PROVIDED_OPS


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_the_kernel_compiles_for_the_gpu_and_waits_before_its_loads(arch, monkeypatch):
    """At V4-Flash's width, bf16 (launch arguments recorded from CPU tensors; no kernel runs);
    with PDL the grid-dependency wait comes before the first global load."""
    from cuda_sm100_checks import compile_launch, record_launches
    from deepinfer_cuda_sm100.kernels import embedding

    monkeypatch.setattr(embedding, "pdl_args", lambda: {"USE_PDL": True})
    launches = record_launches(monkeypatch, embedding, ("_embedding_kernel",))
    embedding.embedding(torch.zeros(4, dtype=torch.long), torch.empty(1000, 4096, dtype=torch.bfloat16))
    monkeypatch.undo()
    assert len(launches) == 1
    kernel, args, kwargs = launches[0]
    ptx = compile_launch(kernel, args, kwargs, arch).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
def test_gpu_conformance_and_edges():
    """The kernel's own and the core's cases in fp32 and bf16, both modes; the edges."""
    problems = checks.conformance_problems(_conformance("cuda", (torch.float32, torch.bfloat16)))
    problems += edge_problems("cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_graph_replay():
    """Captured in a CUDA graph, replayed on new ids written in place: each replay's rows are
    ``F.embedding``'s of the new ids."""
    fn = _impl().fn
    w = _table(16384, 4096, torch.bfloat16, "cuda")
    ids = torch.randint(0, 16384, (64,), device="cuda")
    fn(ids, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(ids, w)
    for replay in range(3):
        ids.copy_(torch.randint(0, 16384, (64,), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bits(out, F.embedding(ids, w)), f"replay {replay}: differs from F.embedding"


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
