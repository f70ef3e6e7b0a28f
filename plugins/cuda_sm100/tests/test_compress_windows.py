"""The ``cuda_sm100`` compressor step (``compress_windows``) against the reference op.

**Interpreter** (a child with ``TRITON_INTERPRET=1``, as in ``test_compressor_kernel.py``), on
the small shapes of :data:`deepinfer_cuda_sm100.compressor_ops.SMALL_WINDOWS`:

- the conformance suite on the op alone (its own cases and the kernel's: CSA with carries and
  page snapshots, HCA, the indexer's keys, no window, a packed FP8 pool) in float32, bfloat16
  and float16: every state tensor the op writes is compared, not only the pool;
- the entries are bit for bit those of ``compress_entries``'s kernel on the reference's staged
  windows (the same entry code), and the buffers, carries and snapshots bit for bit the
  reference's;
- a fixed-shape step's padding windows (``live``): the real windows' writes unchanged, the
  padding windows' pool and carry rows untouched, every token still buffered.

**Compiles** for sm_90 and sm_100 (no GPU needed).  **GPU**: the same checks at V4-Flash widths
and the replay of a captured CUDA graph against eager calls.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from cuda_sm100_checks import failed_rows

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

OP = "compress_windows"


def _impl():
    from deepinfer_cuda_sm100.compressor_ops import compressor_ops

    return compressor_ops()[OP]


def _cases(shapes, dtype: torch.dtype, device: str) -> list[tuple[tuple, dict]]:
    from deepinfer_cuda_sm100.compressor_ops import window_cases

    from deepinfer_core.testing.compare import to_device

    dev = torch.device(device)
    return [
        (to_device(a, dev), to_device(k, dev))
        for a, k in window_cases(shapes)(torch.Generator().manual_seed(0), dtype)
    ]


def _copy(call: tuple[tuple, dict]) -> tuple[tuple, dict]:
    from deepinfer_core.testing.compare import to_device

    args, kwargs = call
    dev = args[0].device
    return to_device(args, dev), to_device(kwargs, dev)


def _conformance(device: str, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    from cuda_sm100_checks import conformance_rows

    from deepinfer_core.backends import BackendSpec

    spec = BackendSpec(name="cuda_sm100_windows", device_type=device, ops=lambda: {OP: _impl()})
    return conformance_rows(spec, dtypes)


def _staged_entries(args: tuple, kwargs: dict) -> torch.Tensor:
    """The pool as ``compress_entries``'s kernel writes it from the reference's staged windows."""
    from deepinfer_cuda_sm100.kernels.compressor import compress_entries

    from deepinfer_core.ops import compressor

    staged = {}
    real = compressor.compress_entries
    compressor.compress_entries = lambda *a: staged.setdefault("args", a)
    try:
        compressor.compress_windows(*args, **kwargs)
    finally:
        compressor.compress_entries = real
    return compress_entries(*staged["args"])


def bit_problems(shapes, dtype: torch.dtype, device: str) -> list[str]:
    """Entries bitwise the entry kernel's on the staged windows; state bitwise the reference's."""
    from deepinfer_core.ops.compressor import compress_windows as reference

    fn, problems = _impl().fn, []
    for k, call in enumerate(_cases(shapes, dtype, device)):
        args, kwargs = call
        if not isinstance(args[12], torch.Tensor) or args[5].shape[0] == 0:
            continue  # a packed pool / no window: the conformance suite covers them
        got = fn(*_copy(call)[0], **_copy(call)[1])
        want = reference(*_copy(call)[0], **_copy(call)[1])
        if not torch.equal(got[0], _staged_entries(*_copy(call))):
            problems.append(f"case {k}: entries differ from compress_entries' kernel on the staged windows")
        for i, (a, b) in enumerate(zip(got[1:], want[1:], strict=True)):
            if a is not None and not torch.equal(a, b):
                problems.append(f"case {k}: state output {i + 1} differs from the reference")
    return problems


def padding_problems(shapes, dtype: torch.dtype, device: str) -> list[str]:
    """``live``: real windows as without it, padding windows' pool and carry rows untouched."""
    fn, problems = _impl().fn, []
    args, kwargs = _cases(shapes, dtype, device)[0]  # CSA: carries and snapshots
    m = args[5].shape[0]
    full = fn(*_copy((args, kwargs))[0], **_copy((args, kwargs))[1])
    for live in range(min(m, 3)):
        a, k = _copy((args, kwargs))
        k["live"] = torch.tensor([live], device=args[0].device)
        got = fn(*a, **k)
        dest, rows, pages = args[13], kwargs["carry_rows"], kwargs["snap_page"]
        want = [x.clone() for x in full]
        kept = {0: (dest, args[12]), 3: (rows, kwargs["carry_kv"]), 4: (rows, kwargs["carry_gate"])}
        kept |= {5: (pages, kwargs["page_kv"]), 6: (pages, kwargs["page_gate"])}
        for i, (idx, before) in kept.items():
            want[i][idx[live:]] = before[idx[live:]]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if not torch.equal(g, w):
                problems.append(f"live={live}: output {i} is not the real windows' writes alone")
    return problems


def layout_problems(shapes, dtype: torch.dtype, device: str) -> list[str]:
    """Index tensors and ``bias`` as non-contiguous views, ``kv`` with a channel stride: the same
    bits as the contiguous call."""
    fn, problems = _impl().fn, []
    call = _cases(shapes, dtype, device)[0]  # CSA: carries and snapshots

    def view(x: torch.Tensor) -> torch.Tensor:  # the same values, every other element of a wider one
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]

    want = fn(*_copy(call)[0], **_copy(call)[1])
    for name in ("bias", "windows", "buf_rows", "dest", "kv", "prev", "carry_rows", "snap_page"):
        args, kwargs = _copy(call)
        position = {"bias": 4, "windows": 5, "buf_rows": 6, "dest": 13, "kv": 0}.get(name)
        if position is None:
            kwargs[name] = view(kwargs[name])
        else:
            args = (*args[:position], view(args[position]), *args[position + 1 :])
        if _impl().supports(*args, **kwargs) is not True:
            problems.append(f"{name} as a view: refused")
            continue
        got = fn(*args, **kwargs)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a is not None and not torch.equal(a, b):
                problems.append(f"{name} as a view: output {i} differs")
    return problems


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.compressor_ops import SMALL_WINDOWS
    from deepinfer_cuda_sm100.kernels import _common

    report: dict = {"interpreted": _common.INTERPRETED}
    report["conformance"] = _conformance("cpu", (torch.float32, torch.bfloat16, torch.float16))
    report["bits"] = bit_problems(SMALL_WINDOWS, torch.float32, "cpu") + bit_problems(
        SMALL_WINDOWS, torch.bfloat16, "cpu"
    )
    report["padding"] = padding_problems(SMALL_WINDOWS, torch.bfloat16, "cpu")
    report["layouts"] = layout_problems(SMALL_WINDOWS, torch.bfloat16, "cpu")
    return report


slow = pytest.mark.slow


@slow
def test_kernel_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@slow
@pytest.mark.parametrize("mode", ["default", "bi"])
def test_interpreter_conformance(report, mode):
    rows = [r for r in report["conformance"] if r["mode"] == mode]
    assert any("own" in r["case"] for r in rows), "the kernel's own cases did not run"
    bad = failed_rows(rows)
    assert not bad, "\n".join(bad)


@slow
def test_interpreter_entries_and_state_are_bitwise(report):
    assert not report["bits"], "\n".join(report["bits"])


@slow
def test_interpreter_padding_windows_are_skipped(report):
    assert not report["padding"], "\n".join(report["padding"])


@slow
def test_interpreter_views_give_the_same_bits(report):
    assert not report["layouts"], "\n".join(report["layouts"])


def test_supports_names_the_culprit():
    from deepinfer_cuda_sm100.compressor_ops import SMALL_WINDOWS, make_supports, window_cases

    supports = make_supports(interpreted=True)
    args, kwargs = window_cases(SMALL_WINDOWS)(torch.Generator().manual_seed(0), torch.bfloat16)[0]
    assert supports(*args, **kwargs) is True
    bad = list(args)
    bad[4] = args[4].to(torch.bfloat16)
    assert "bias" in supports(*bad, **kwargs)
    assert "carry_gate" in supports(*args, **{**kwargs, "carry_gate": kwargs["carry_gate"].bfloat16()})
    assert "snapshots" in supports(*args, **{**kwargs, "snap_page": None})
    assert "prev" in supports(*args, **{**kwargs, "prev": None})
    assert "on cuda" in make_supports(interpreted=False)(*args, **kwargs)


@slow
@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_the_gpu(arch, monkeypatch):
    """The three kernels at V4-Flash widths (CSA with snapshots and ``live``, HCA), compiled for
    ``sm_<arch>`` from launch arguments recorded on CPU tensors (no kernel runs)."""
    from cuda_sm100_checks import compile_launch, compile_problem, record_launches

    if compile_problem() is not None:
        pytest.skip(compile_problem())
    from deepinfer_cuda_sm100.compressor_ops import V4_FLASH_WINDOWS
    from deepinfer_cuda_sm100.kernels import compressor_windows as kw

    from deepinfer_core.ops.compressor import window_case

    names = ("_compress_windows_kernel", "_compress_carry_kernel", "_compress_buffer_kernel")
    launches = record_launches(monkeypatch, kw, names)
    g, s = torch.Generator().manual_seed(0), V4_FLASH_WINDOWS
    for ratio, overlap in ((s.csa, True), (s.hca, False)):
        args, kwargs = window_case(g, torch.bfloat16, 4, 4, ratio, s.head_dim, overlap, rope_dim=s.rope_dim)
        kw.compress_windows(*args, **kwargs, live=torch.tensor([2]))
    monkeypatch.undo()
    assert len(launches) == 5
    for kernel, args, kwargs in launches:
        compile_launch(kernel, args, kwargs, arch)


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu


@needs_cuda
def test_gpu_conformance_bits_and_padding():
    from deepinfer_cuda_sm100.compressor_ops import V4_FLASH_WINDOWS

    rows = _conformance("cuda", (torch.float32, torch.bfloat16))
    assert any("own" in r["case"] for r in rows)
    problems = failed_rows(rows)
    for dtype in (torch.float32, torch.bfloat16):
        problems += bit_problems(V4_FLASH_WINDOWS, dtype, "cuda")
    problems += padding_problems(V4_FLASH_WINDOWS, torch.bfloat16, "cuda")
    problems += layout_problems(V4_FLASH_WINDOWS, torch.bfloat16, "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_graph_replay():
    from deepinfer_cuda_sm100.compressor_ops import V4_FLASH_WINDOWS

    fn = _impl().fn
    for k, call in enumerate(_cases(V4_FLASH_WINDOWS, torch.bfloat16, "cuda")):
        start = _copy(call)
        args, kwargs = _copy(call)
        fn(*_copy(call)[0], **_copy(call)[1])  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*args, **kwargs)
        for state, first in zip((*args, *kwargs.values()), (*start[0], *start[1].values()), strict=True):
            if isinstance(state, torch.Tensor):
                state.copy_(first)  # the state as before the (captured, not run) call
        graph.replay()
        eager = fn(*_copy(start)[0], **_copy(start)[1])
        for i, (a, b) in enumerate(zip(out, eager, strict=True)):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"case {k}: output {i} of the replay differs from an eager call"
            elif a is not None:
                assert torch.equal(a.data, b.data), f"case {k}: the packed pool differs"


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
