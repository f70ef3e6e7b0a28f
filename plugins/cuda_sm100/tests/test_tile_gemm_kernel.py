"""The ``cuda_sm100`` GEMM of batch-invariant mode (``tile_matmul``).

**Interpreter** (a child started with ``TRITON_INTERPRET=1``: ``python
test_tile_gemm_kernel.py --interpreter-report`` prints a JSON report each test reads a part
of): the conformance suite on the op alone (the core's cases and the kernel's own, float32,
bfloat16 and float16), and the invariance itself: item ``i`` (and each of its rows) of a call
on ``n`` items is bitwise the call on item ``i`` alone, for shared (stride-0) and per-item
weights.

**GPU** (skipped without CUDA): the same at DeepSeek-V4-Flash widths and up to 300 items
(the kernel's launch shape never changes; cuBLAS's does, which is why the op exists), and the
replay of a captured CUDA graph.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from cuda_sm100_checks import failed_rows

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

OP = "tile_matmul"


def _impl():
    from deepinfer_cuda_sm100.ops import load_ops

    return load_ops()[OP]


def _conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    from cuda_sm100_checks import conformance_rows

    from deepinfer_core.backends import BackendSpec

    spec = BackendSpec(name="cuda_sm100_tile", device_type=device, ops=lambda: {OP: _impl()})
    return conformance_rows(spec, dtypes)


def invariance_problems(
    device: str, dtype: torch.dtype, k: int, n_out: int, items: tuple[int, ...]
) -> list[str]:
    """Item ``i`` of calls on ``n`` items (shared and per-item weights) against item ``i`` alone."""
    fn = _impl().fn
    g = torch.Generator().manual_seed(5)
    most = max(items)
    a = torch.randn(most, 64, k, generator=g).to(dtype).to(device)
    own = (torch.randn(most, n_out, k, generator=g) * k**-0.5).to(dtype).to(device)
    shared = (torch.randn(n_out, k, generator=g) * k**-0.5).to(dtype).to(device)
    problems = []
    for label, b in (("per-item", own), ("shared", shared.unsqueeze(0).expand(most, -1, -1))):
        alone = [fn(a[i : i + 1], b[i : i + 1]) for i in range(most)]
        for n in items:
            out = fn(a[:n], b[:n])
            bad = [i for i in range(n) if not torch.equal(out[i : i + 1], alone[i])]
            if bad:
                problems.append(f"{label} weights, {n} items: items {bad[:5]} differ from alone")
        rows = fn(a[:1, :7], b[:1])  # 7 rows of a tile: the same bits as inside the full tile
        if not torch.equal(rows, alone[0][:, :7]):
            problems.append(f"{label} weights: the first 7 rows alone differ from the full tile's")
    return problems


def interpreter_report() -> dict:
    """Run the checks in the interpreter (this process has ``TRITON_INTERPRET=1``)."""
    from deepinfer_cuda_sm100.kernels import _common

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return {
        "interpreted": _common.INTERPRETED,
        "conformance": _conformance("cpu", dtypes),
        "invariance": [
            f"{dt}: {p}"
            for dt in (torch.float32, torch.bfloat16)
            for p in invariance_problems("cpu", dt, 72, 40, (1, 2, 3))
        ],
    }


@pytest.mark.slow
def test_conformance_in_interpreter(report):
    assert report["interpreted"]
    rows = report["conformance"]
    assert any(r["own"] for r in rows) and any(not r["own"] for r in rows), rows
    bad = failed_rows(rows)
    assert not bad, "; ".join(bad)


@pytest.mark.slow
def test_invariance_in_interpreter(report):
    assert not report["invariance"], "; ".join(report["invariance"])


# ---------------------------------------------------------------------------------------------
# GPU


gpu = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conformance_on_gpu(dtype):
    rows = _conformance("cuda", (dtype,))
    bad = failed_rows(rows)
    assert rows and not bad, "; ".join(bad)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_invariance_on_gpu(dtype):
    problems = invariance_problems("cuda", dtype, 4096, 1024, (1, 2, 3, 16, 64, 133, 300))
    assert not problems, "; ".join(problems)


@gpu
def test_graph_replay_on_gpu():
    fn = _impl().fn
    a = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    fn(a, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(a, b)
    a.copy_(torch.randn_like(a))
    graph.replay()
    assert torch.equal(out, fn(a, b))


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
