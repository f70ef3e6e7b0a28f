"""The ``cuda_sm100`` greedy-sampling kernel (``argmax_rows``) against ``torch.argmax``.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_argmax.py --interpreter-report`` prints a JSON report and each test below reads one part
of it.  It runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` holding the op: the core's
  cases and the kernel's (:data:`deepinfer_cuda_sm100.sampling_ops.SMALL_ROWS`) in float32,
  bfloat16 and float16, in the default and the batch-invariant mode (indices exactly the
  reference's);
- the edges (:func:`edge_problems`), every index bitwise ``torch.argmax``'s and, where the case
  fixes it, the expected one: the maximum tied across chunk boundaries and within a lane's
  tiles, whole rows tied, signed zeros, the first NaN (across chunks, in column 0, above
  ``+inf``), the first ``+inf``, rows of ``-inf``, widths of 1, 2, 31..33, around a tile and a
  chunk and a ragged multi-chunk width, one and several rows, strided and transposed rows, no rows;
- batch invariance: a row's index alone and within batches.

**Compile** (no GPU needed): both kernels compile for sm_90 and sm_100, a chunk's fp32 loads as
16-byte vectors.

**GPU** (skipped without CUDA): conformance at :data:`~deepinfer_cuda_sm100.sampling_ops.V4_FLASH_ROWS`,
the edges, V-Flash-sized rows (``B`` in 1, 64, 256; ``V = 129,280``) bitwise ``torch.argmax``'s
in fp32, bf16 and fp16, and the replay of a captured CUDA graph on new logits.
"""

from __future__ import annotations

import json
import os
import sys

import cuda_sm100_checks as checks
import pytest
import torch
from cuda_sm100_checks import compile_problem, failed_rows

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

OP = "argmax_rows"
VOCAB = 129280  # V-Flash's
NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def _impl():
    from deepinfer_cuda_sm100.sampling_ops import sampling_ops

    return sampling_ops()[OP]


def _conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """The conformance suite on the op alone, in the default and the batch-invariant mode."""
    from cuda_sm100_checks import op_conformance_rows

    return op_conformance_rows("cuda_sm100_argmax", OP, _impl, device, dtypes)


def _planted(width: int, rows: list[dict[int, float]], fill: float = 0.0) -> torch.Tensor:
    """``[len(rows), width]`` of ``fill`` with each row's ``{column: value}`` planted."""
    x = torch.full((len(rows), width), fill)
    for i, row in enumerate(rows):
        for col, value in row.items():
            x[i, col] = value
    return x


def edges() -> list[tuple[str, torch.Tensor, list[int] | None]]:
    """``(label, x, expected indices or None)`` on the CPU, float32 (see the module docstring)."""
    from deepinfer_cuda_sm100.kernels.argmax import CHUNK, MAX_BLOCK

    c, b = CHUNK, MAX_BLOCK
    width = 3 * c + 77
    g = torch.Generator().manual_seed(13)
    out: list[tuple[str, torch.Tensor, list[int] | None]] = []
    out.append(
        (
            "ties across chunk boundaries",
            _planted(width, [{c: 9, c - 1: 9}, {2 * c: 9, c + 1: 9}, {width - 1: 9, 3 * c: 9}, {}]),
            [c - 1, c + 1, 3 * c, 0],
        )
    )
    out.append(
        (
            "ties in one lane's tiles",
            _planted(width, [{5 + b: 9, 5 + 2 * b: 9, 5: 9}, {3 + 3 * b: 9}]),
            [5, 3 + 3 * b],
        )
    )
    out.append(("signed zeros", _planted(50, [{0: -0.0, 1: 0.0}, {0: -1.0, 1: -0.0, 2: 0.0}], -2.0), [0, 1]))
    nan_rows = [{2 * c + 3: NAN, c + 7: NAN}, {0: NAN, 9: 6e4}, {9: INF, 3 * c + 5: NAN}, {width - 1: NAN}]
    out.append(("first NaN", _planted(width, nan_rows, -1.0), [c + 7, 0, 3 * c + 5, width - 1]))
    out.append(
        ("first +inf", _planted(width, [{9000: INF, 100: INF, 50: 6e4}, {width - 1: INF}]), [100, width - 1])
    )
    out.append(("-inf rows", _planted(width, [{}, {width - 1: -6e4}, {c: -INF}], -INF), [0, width - 1, 0]))
    for v in (1, 2, 31, 32, 33, b - 1, b + 1, c - 1, c, c + 1, 2 * c + 1, width):
        x = torch.randint(-3, 3, (3, v), generator=g).float()  # ties everywhere
        out.append((f"V={v}", x, None))
        out.append((f"V={v} random", torch.randn(2, v, generator=g), None))
    out.append(("37 rows", torch.randn(37, 5000, generator=g), None))
    out.append(("a strided view", torch.randn(5, width + 40, generator=g)[:, 17 : 17 + width], None))
    out.append(("transposed rows", torch.randn(c + 9, 6, generator=g).t(), None))
    out.append(("no rows", torch.randn(0, 300, generator=g), []))
    return out


def edge_problems(device: str, dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[str]:
    """Every edge whose indices differ from ``torch.argmax``'s or the expected ones, or whose
    output is not a new ``[B]`` int64 tensor; refusals by ``supports`` count too."""
    impl = _impl()
    problems = []
    for dtype in dtypes:
        for label, x, want in edges():
            x = x.to(dtype).to(device)
            tag = f"{label} {dtype}"
            verdict = impl.supports(x)
            if verdict is not True:
                problems.append(f"{tag}: refused: {verdict}")
                continue
            got, ref = impl.fn(x), torch.argmax(x, dim=-1)
            if got.dtype != torch.int64 or tuple(got.shape) != (x.shape[0],) or got.device != x.device:
                problems.append(f"{tag}: got {got.dtype} {tuple(got.shape)} on {got.device}")
            elif not torch.equal(got, ref):
                problems.append(f"{tag}: {got.tolist()[:8]} != torch.argmax's {ref.tolist()[:8]}")
            elif want is not None and got.tolist() != want:
                problems.append(f"{tag}: {got.tolist()} != expected {want}")
    return problems


def invariance_problems(device: str) -> list[str]:
    """A row's index is the same alone and within batches of several sizes."""
    fn = _impl().fn
    g = torch.Generator().manual_seed(4)
    x = (torch.randint(-8, 8, (19, 9000), generator=g) / 4).to(device)
    alone = [fn(x[i : i + 1]) for i in range(19)]
    problems = []
    for n in (2, 7, 19):
        out = fn(x[:n])
        problems += [
            f"row {i} differs in {n} rows" for i in range(n) if not torch.equal(out[i : i + 1], alone[i])
        ]
    return problems


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", DTYPES)
    report["edges"] = edge_problems("cpu")
    report["invariance"] = invariance_problems("cpu")
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernels
test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared tests
test_interpreter_conformance = checks.test_interpreter_conformance


@slow
def test_interpreter_edges_are_torch_argmax(report):
    assert not report["edges"], "\n".join(report["edges"])


@slow
def test_interpreter_batch_invariance(report):
    assert not report["invariance"], "\n".join(report["invariance"])


# ---------------------------------------------------------------------------------------------
# launch shapes and supports (no kernel runs)


def test_kernel_and_ops_constants_agree():
    from deepinfer_cuda_sm100 import sampling_ops
    from deepinfer_cuda_sm100.kernels import argmax

    assert argmax.MAX_COLS == sampling_ops.MAX_COLS and argmax.CHUNK == sampling_ops.CHUNK
    assert argmax.CHUNK % argmax.MAX_BLOCK == 0


def test_chunks_follow_the_width_only():
    from deepinfer_cuda_sm100.kernels.argmax import CHUNK, chunk_cols

    assert [chunk_cols(v) for v in (1, 32, 33, 1000, CHUNK, CHUNK + 1, VOCAB)] == [32, 32, 64, 1024] + [
        CHUNK
    ] * 3
    assert -(-VOCAB // chunk_cols(VOCAB)) == 32  # programs per V-Flash row


def _supports(interpreted: bool):
    from deepinfer_cuda_sm100.sampling_ops import make_supports

    return make_supports(interpreted)


def test_supports_takes_every_float_dtype_and_layout():
    sup = _supports(True)
    for dtype in DTYPES:
        assert sup(torch.zeros(3, 700, dtype=dtype)) is True
    assert sup(torch.zeros(3, 700)[:, 5:600]) is True
    assert sup(torch.zeros(700, 3).t()) is True
    assert sup(torch.zeros(0, 7)) is True and sup(torch.zeros(4, 1)) is True


@pytest.mark.parametrize(
    ("x", "reason"),
    [
        (torch.zeros(3, 7, dtype=torch.float64), "dtype torch.float64"),
        (torch.zeros(3, 7, dtype=torch.int64), "dtype torch.int64"),
        (torch.zeros(7), "has 1 dims"),
        (torch.zeros(2, 3, 7), "has 3 dims"),
        (torch.zeros(3, 0), "rows of 0 columns"),
        (torch.zeros(1, 1).expand(1, (1 << 24) + 1), "rows of 16777217 columns"),
        ([[1.0]], "not a tensor"),
    ],
)
def test_supports_refuses_with_the_reason(x, reason):
    verdict = _supports(True)(x)
    assert isinstance(verdict, str) and reason in verdict, verdict


def test_compiled_supports_takes_cuda_tensors_only():
    verdict = _supports(False)(torch.zeros(2, 8))
    assert isinstance(verdict, str) and "GPU" in verdict


def test_the_v4_flash_cases_are_supported():
    """The GPU tier's own cases pass ``supports`` (the interpreter's predicate on CPU tensors:
    the same checks of shapes and dtypes)."""
    from deepinfer_cuda_sm100.sampling_ops import V4_FLASH_ROWS, argmax_cases

    cases = argmax_cases(V4_FLASH_ROWS)(torch.Generator().manual_seed(0), torch.bfloat16)
    assert len(cases) == 6 and all(_supports(True)(*args) is True for args, _ in cases)


# ---------------------------------------------------------------------------------------------
# compile for the GPU (no GPU needed)


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_the_gpu(arch, monkeypatch):
    """Both stages at V-Flash's width, fp32 and bf16, compile for ``sm_<arch>`` (launch
    arguments recorded from CPU tensors; no kernel runs); contiguous rows load in 16-byte vectors."""
    from cuda_sm100_checks import compile_launch, record_launches
    from deepinfer_cuda_sm100.kernels import argmax

    launches = record_launches(monkeypatch, argmax, ("_chunk_kernel", "_rows_kernel"))
    for dtype in (torch.float32, torch.bfloat16):
        argmax.argmax_rows(torch.empty(64, VOCAB, dtype=dtype))
    argmax.argmax_rows(torch.empty(8, 1000))  # one chunk a row: stage 1 writes the indices
    monkeypatch.undo()
    assert [k.fn.__name__ for k, _, _ in launches] == ["_chunk_kernel", "_rows_kernel"] * 2 + [
        "_chunk_kernel"
    ]
    for kernel, args, kwargs in launches:
        ptx = compile_launch(kernel, args, kwargs, arch).asm["ptx"]
        if kernel is argmax._chunk_kernel and args[4] == VOCAB:  # rows 16-byte aligned
            assert "ld.global.v4.b32" in ptx, "a chunk's loads are not 16-byte vectors"


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_conformance(dtype):
    rows = _conformance("cuda", (dtype,))
    assert any(r["own"] and r["status"] == "passed" for r in rows)
    bad = failed_rows(rows)
    assert not bad, "\n".join(bad)


@needs_cuda
def test_gpu_edges_and_invariance():
    problems = edge_problems("cuda") + invariance_problems("cuda")
    assert not problems, "\n".join(problems)


def _vflash_logits(rows: int, seed: int) -> torch.Tensor:
    """``[rows, V]`` fp32 logits on the GPU with NaN, ``+inf``, ``-inf`` rows and ties planted."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, VOCAB, device="cuda", generator=g) * 4
    if rows > 1:
        x[1, [70000, 5000]] = x[1].max() + 1  # tied maximum in two chunks
    if rows > 4:
        x[2, [90000, 4096]] = NAN
        x[3] = -INF
        x[4, [129279, 17]] = INF
    return x


@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_v4_flash_rows_are_torch_argmax(rows):
    impl = _impl()
    for dtype in DTYPES:
        x = _vflash_logits(rows, rows).to(dtype)
        assert impl.supports(x) is True
        got, want = impl.fn(x), torch.argmax(x, dim=-1)
        assert torch.equal(got, want), f"{dtype}: {int((got != want).sum())} of {rows} rows differ"


@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_graph_replay(rows):
    """Captured in a CUDA graph (on a side stream, after a warm call), replayed on new logits
    written in place: each replay's indices are ``torch.argmax``'s of the new logits."""
    fn = _impl().fn
    x = _vflash_logits(rows, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn(x)  # warm on the capturing stream
        with torch.cuda.graph(graph, stream=stream):
            out = fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(3):
        x.copy_(_vflash_logits(rows, 100 + replay))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.argmax(x, dim=-1)), f"replay {replay}: differs from torch.argmax"


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
