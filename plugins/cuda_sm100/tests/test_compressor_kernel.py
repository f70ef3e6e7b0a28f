"""The ``cuda_sm100`` compressor kernel (``compress_entries``) against the reference op.

**Interpreter.**  ``TRITON_INTERPRET=1`` must be set before Triton is imported and must not
leak into this pytest process, so the interpreter checks run in a child: ``python
test_compressor_kernel.py --interpreter-report`` prints a JSON report and each test below
reads one part of it.  On the small shapes of :data:`deepinfer_cuda_sm100.cases.SMALL` it runs

- the conformance suite (``check_backend``) on a CPU ``BackendSpec`` holding the op: its own
  cases and the kernel's, in float32, bfloat16 and float16, in the default and the
  batch-invariant mode;
- batch invariance (bitwise): the entries of a slice of the windows, written alone into a
  fresh pool, against the same rows of the whole call;
- the launch shapes: windows read in one tile and in several (HCA's ``L = 128``), at the
  V4-Flash entry widths, within the op's tolerance;
- a fixed-shape step's padding windows (``live``): skipped, the real ones unchanged.

**GPU** (skipped without CUDA): the conformance suite at DeepSeek-V4-Flash shapes, batch
invariance and the replay of a captured CUDA graph.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from cuda_sm100_checks import failed_rows

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

OP = "compress_entries"


# ---------------------------------------------------------------------------------------------
# checks shared by the interpreter child and the GPU tests


def _impl():
    from deepinfer_cuda_sm100.ops import load_ops

    return load_ops()[OP]


def _cases(shapes, dtype: torch.dtype, device: str) -> list[tuple]:
    from deepinfer_cuda_sm100.cases import own_cases

    return [
        tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        for args, _ in own_cases(shapes)[OP](torch.Generator().manual_seed(0), dtype)
    ]


def _conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """The conformance suite on the op alone, in the default and the batch-invariant mode."""
    from cuda_sm100_checks import conformance_rows

    from deepinfer_core.backends import BackendSpec

    spec = BackendSpec(name="cuda_sm100_compressor", device_type=device, ops=lambda: {OP: _impl()})
    return conformance_rows(spec, dtypes)


def invariance_problems(shapes, dtype: torch.dtype, device: str) -> list[str]:
    """Each window's entry is bitwise the same computed with all the windows or with a slice."""
    from deepinfer_core.ops.modes import batch_invariant_mode

    fn = _impl().fn
    problems = []
    with batch_invariant_mode():
        for k, args in enumerate(_cases(shapes, dtype, device)):
            kv, gate, w, eps, pos, inv, scale, pool, dest = args
            m = kv.shape[0]
            full = fn(kv, gate, w, eps, pos, inv, scale, pool.clone(), dest)
            for a, b in ((0, 1), (max(m - 2, 0), m), (1, min(m, 4))):
                if a >= b:
                    continue
                part = fn(kv[a:b], gate[a:b], w, eps, pos[a:b], inv, scale, torch.zeros_like(pool), dest[a:b])
                if not torch.equal(full[dest[a:b]], part[dest[a:b]]):
                    problems.append(f"case {k}: windows {a}:{b} of {m} differ alone")
            untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
            untouched[dest] = False
            if not torch.equal(full[untouched], pool[untouched]):
                problems.append(f"case {k}: rows outside dest changed")
    return problems


def launch_problems(dtype: torch.dtype, device: str) -> list[str]:
    """One-tile and several-tile windows at the V4-Flash widths, within the op's tolerance."""
    from deepinfer_cuda_sm100.kernels.compressor import block_sizes

    from deepinfer_core.ops.compressor import compress_entries as reference
    from deepinfer_core.ops.registry import DEFAULT_TOLERANCES

    atol, rtol = DEFAULT_TOLERANCES[dtype]
    fn = _impl().fn
    g = torch.Generator().manual_seed(5)
    problems = []
    for m, length, d, rope in ((2, 8, 512, 64), (1, 128, 512, 64), (2, 128, 128, 64), (1, 300, 64, 16)):
        tiles = block_sizes(length, d)[2]
        gate = torch.randn(m, length, d, generator=g) * 3
        gate[0, : length // 2] = float("-inf")
        inv = 1.0 / (160000.0 ** (torch.arange(0, rope, 2).float() / rope))
        args = (
            torch.randn(m, length, d, generator=g).to(dtype),
            gate,
            1 + 0.1 * torch.randn(d, generator=g),
            1e-6,
            torch.randint(0, 1 << 20, (m,), generator=g),
            inv,
            1.0,
            torch.randn(m + 1, d, generator=g).to(dtype),
            torch.randperm(m + 1, generator=g)[:m],
        )
        call = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        got = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in call]).float()
        want = reference(*[a.clone() if isinstance(a, torch.Tensor) else a for a in call]).float()
        if not torch.allclose(got, want, atol=atol, rtol=rtol):
            err = (got - want).abs().max().item()
            problems.append(f"M={m} L={length} D={d} ({tiles} tiles): max abs err {err:.3g}")
    return problems


def padding_problems(dtype: torch.dtype, device: str) -> list[str]:
    """``live``: the windows before it are bitwise those of a call without it, the padding
    windows after it write nothing (their rows keep what they held); the reference, which
    may compute them, writes every row as without ``live``."""
    from deepinfer_core.ops.compressor import compress_entries as reference

    fn = _impl().fn
    g = torch.Generator().manual_seed(11)
    m, length, d, rope = 4, 8, 64, 16
    args = [
        torch.randn(m, length, d, generator=g).to(dtype),
        torch.randn(m, length, d, generator=g) * 3,
        1 + 0.1 * torch.randn(d, generator=g),
        1e-6,
        torch.randint(0, 1 << 16, (m,), generator=g),
        1.0 / (10000.0 ** (torch.arange(0, rope, 2).float() / rope)),
        1.0,
    ]
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    pool = torch.randn(m + 3, d, generator=g).to(dtype).to(device)
    dest = torch.randperm(m + 3, generator=g)[:m].to(device)
    full = fn(*args, pool.clone(), dest)
    problems = []
    for k in (0, 1, m):
        live = torch.tensor([k], device=device)
        got = fn(*args, pool.clone(), dest, live=live)
        want = full.clone()
        want[dest[k:]] = pool[dest[k:]]
        if not torch.equal(got, want):
            problems.append(f"live={k}: the real windows differ or a padding window was written")
        if not torch.equal(
            reference(*args, pool.clone(), dest, live=live), reference(*args, pool.clone(), dest)
        ):
            problems.append(f"live={k}: the reference depends on live")
    return problems


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.cases import SMALL
    from deepinfer_cuda_sm100.kernels import _common

    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", (torch.float32, torch.bfloat16, torch.float16))
    report["invariance"] = invariance_problems(SMALL, torch.bfloat16, "cpu")
    report["launches"] = launch_problems(torch.float32, "cpu") + launch_problems(torch.bfloat16, "cpu")
    report["padding"] = padding_problems(torch.bfloat16, "cpu")
    return report


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernel (~5 s)


@slow
def test_kernel_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
@pytest.mark.parametrize("mode", ["default", "bi"])
def test_interpreter_conformance(report, mode):
    rows = [r for r in report["conformance"] if r["mode"] == mode]
    assert any("own" in r["case"] for r in rows), "the kernel's own (V4-Flash-like) cases did not run"
    bad = failed_rows(rows)
    assert not bad, "\n".join(bad)


@slow
def test_interpreter_batch_invariance(report):
    assert not report["invariance"], "\n".join(report["invariance"])


@slow
def test_interpreter_launch_shapes(report):
    assert not report["launches"], "\n".join(report["launches"])


@slow
def test_interpreter_padding_windows_are_skipped(report):
    assert not report["padding"], "\n".join(report["padding"])


@slow
def test_block_sizes_depend_on_shapes_only():
    from deepinfer_cuda_sm100.kernels.compressor import MAX_DIM, block_sizes
    from deepinfer_cuda_sm100.ops import MAX_ENTRY_DIM

    assert MAX_ENTRY_DIM == MAX_DIM
    assert block_sizes(8, 512) == (8, 256, 1)  # CSA at V4-Flash: the window in one tile
    assert block_sizes(128, 512) == (8, 256, 16)  # HCA: sixteen tiles of eight rows
    assert block_sizes(8, 128) == (8, 64, 1)  # the indexer's keys


@slow
@pytest.mark.parametrize("arch", [90, 100])
def test_kernel_compiles_for_the_gpu(arch, monkeypatch):
    """CSA and HCA windows at V4-Flash widths, with and without ``live``: the kernel compiles
    for ``sm_<arch>`` (launch arguments recorded from CPU tensors; no kernel runs)."""
    from cuda_sm100_checks import compile_launch, compile_problem, record_launches

    if compile_problem() is not None:
        pytest.skip(compile_problem())
    from deepinfer_cuda_sm100.kernels import compressor as kc

    launches = record_launches(monkeypatch, kc, ("_compress_entries_kernel",))
    for m, length in ((64, 8), (64, 128)):
        kv, gate = torch.empty(m, length, 512, dtype=torch.bfloat16), torch.empty(m, length, 512)
        call = (kv, gate, torch.ones(512), 1e-6, torch.zeros(m, dtype=torch.int64), torch.ones(32), 1.0)
        pool, dest = torch.empty(2 * m, 512, dtype=torch.bfloat16), torch.arange(m)
        for live in (None, torch.tensor([3])):
            kc.compress_entries(*call, pool, dest, live=live)
    monkeypatch.undo()
    assert len(launches) == 4
    for kernel, args, kwargs in launches:
        compile_launch(kernel, args, kwargs, arch)


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
def test_gpu_conformance_at_v4_flash_shapes():
    rows = _conformance("cuda", (torch.float32, torch.bfloat16))
    assert any("own" in r["case"] for r in rows)
    bad = failed_rows(rows)
    assert not bad, "\n".join(bad)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_batch_invariance_and_launch_shapes(dtype):
    from deepinfer_cuda_sm100.cases import V4_FLASH

    problems = invariance_problems(V4_FLASH, dtype, "cuda") + launch_problems(dtype, "cuda")
    problems += padding_problems(dtype, "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_graph_replay():
    from deepinfer_cuda_sm100.cases import V4_FLASH

    fn = _impl().fn
    for k, args in enumerate(_cases(V4_FLASH, torch.bfloat16, "cuda")):
        kv, gate, w, eps, pos, inv, scale, pool, dest = args
        fn(*args)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        for replay in range(2):
            kv.copy_(torch.randn_like(kv))
            gate.copy_(torch.randn_like(gate))
            pos.copy_(torch.randint_like(pos, 0, 1 << 16))
            pool.zero_()
            graph.replay()
            eager = fn(kv, gate, w, eps, pos, inv, scale, torch.zeros_like(pool), dest)
            assert torch.equal(pool, eager), f"case {k}, replay {replay}: differs from an eager call"


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
