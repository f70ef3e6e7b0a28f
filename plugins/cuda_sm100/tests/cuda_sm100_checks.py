"""Checks beyond the conformance suite, shared by the interpreter and the GPU tests.

- :func:`bitwise_problem`: whether two tensors are equal bit for bit, else a line with their
  largest difference.
- :func:`batch_invariance_problems`: a row's output is bitwise the same whether the op runs
  on the whole batch or on a slice of it (other batch sizes, other positions in a tile).
- :func:`graph_replay_problems`: an op captured in a CUDA graph and replayed on new input
  values gives bitwise what an eager call gives.
- :func:`replayed`: a call captured in a CUDA graph on a side stream and replayed once.
- :func:`conformance_rows`: the conformance suite on a backend spec in the default and the
  batch-invariant mode, flattened into JSON-able rows (the interpreter children report them).
- :func:`op_conformance_rows`: the same for a backend serving one op.
- :func:`failed_rows`: those rows that did not pass, as lines for an assertion message.
- :func:`interpreter_report`: run a test module's report in a fresh interpreter with
  ``TRITON_INTERPRET=1`` (it must be set before Triton is imported, and must not leak into
  a pytest session that also runs the GPU tests).
- :func:`test_kernel_ran_interpreted`, :func:`test_interpreter_conformance`: the tests of an
  interpreter report that a kernel's test module imports (pytest collects them there).
- :func:`compile_problem`, :func:`compile_launch`: why kernels cannot be compiled ahead of
  time for a GPU here, and a kernel compiled for ``sm_<arch>`` as a recorded launch would
  specialise it (no GPU needed); :func:`record_launches`: a module's kernels replaced by
  recorders of their launches (CPU tensors, no kernel runs); :func:`global_loads_around`: a
  compiled kernel's global loads before and after its first instance of given PTX.
- :func:`lowered_sm90`, :func:`pdl_prologue_problem`, :func:`loops_containing`: a TileLang
  kernel's CUDA source for sm_90 (no GPU needed), whether it waits for the kernel before it
  ahead of any global access, and its loops that contain a statement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from deepinfer_cuda_sm100.cases import Shapes, own_cases

ROW_ARGS = {
    "rms_norm": (0,),
    "apply_rope": (0, 1, 2),
    "qk_norm_rope": (0, 1, 4, 5),
    "rope_cos_sin": (0,),
    "swiglu": (0, 1),
    "compress_pool": (0, 1),
    "hc_pre": (0,),
    "hc_post": (0, 1, 2, 3),
    "hc_post_pre": (0, 1, 2, 3),
    "hc_head": (0,),
    "hc_head_norm": (0,),
}
"""The positional arguments of each op that are indexed by token (dim 0)."""

INVARIANCE_CASES = {
    "rms_norm": (0, 5),
    "apply_rope": (2,),
    "qk_norm_rope": (4, 5, 6),
    "rope_cos_sin": (3,),
    "swiglu": (2,),
    "compress_pool": (0, 4),
    "hc_pre": (2,),
    "hc_post": (2,),
    "hc_post_pre": (2, 3, 4),
    "hc_head": (2,),
    "hc_head_norm": (2, 3),
}
"""Which of :func:`~deepinfer_cuda_sm100.cases.own_cases`'s cases each op is checked on."""


def bitwise_problem(label: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """``None`` when ``got`` is ``want`` bit for bit, else ``label`` with their largest difference."""
    if torch.equal(got, want):
        return None
    return f"{label} (max {(got.double() - want.double()).abs().max().item():.3g})"


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _case(op: str, shapes: Shapes, dtype: torch.dtype, index: int, device: str) -> tuple[tuple, dict]:
    args, kwargs = own_cases(shapes)[op](torch.Generator().manual_seed(0), dtype)[index]
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), kwargs


def batch_invariance_problems(
    op: str, fn: Callable, shapes: Shapes, dtype: torch.dtype, device: str
) -> list[str]:
    """Run ``fn`` on whole batches and on row slices of them; describe every row that changed."""
    problems = []
    for index in INVARIANCE_CASES[op]:
        args, kwargs = _case(op, shapes, dtype, index, device)
        t = next(args[i] for i in ROW_ARGS[op] if args[i] is not None).shape[0]
        full = _outputs(fn(*args, **kwargs))
        for a, b in ((0, 1), (t - 2, t), (1, min(t, 8))):
            sub = tuple(
                x[a:b].clone() if i in ROW_ARGS[op] and x is not None else x for i, x in enumerate(args)
            )
            for k, (whole, part) in enumerate(zip(full, _outputs(fn(*sub, **kwargs)), strict=True)):
                label = f"case {index}, output {k}: rows {a}:{b} of {t} differ alone"
                problems.append(bitwise_problem(label, whole[a:b], part))
    return [p for p in problems if p]


def graph_replay_problems(op: str, fn: Callable, shapes: Shapes, dtype: torch.dtype) -> list[str]:
    """Capture ``fn`` in a CUDA graph, replay it on fresh input values, compare with eager calls."""
    args, kwargs = _case(op, shapes, dtype, 0, "cuda")
    fn(*args, **kwargs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _outputs(fn(*args, **kwargs))
    problems = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for replay in range(2):
        for i in ROW_ARGS[op]:  # new activations (or positions), in place (the static inputs)
            if args[i] is None:
                continue
            if args[i].is_floating_point():
                fresh = torch.randn(args[i].shape, generator=gen, device="cuda", dtype=torch.float32)
            else:
                fresh = torch.randint(0, 1 << 20, args[i].shape, generator=gen, device="cuda")
            args[i].copy_(fresh.abs() if op in ("hc_post", "hc_post_pre") and i in (2, 3) else fresh)
        graph.replay()
        expected = _outputs(fn(*args, **kwargs))
        for k, (got, want) in enumerate(zip(captured, expected, strict=True)):
            if not torch.equal(got, want):
                problems.append(f"replay {replay}, output {k}: differs from an eager call")
    return problems


def replayed(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fn()`` captured in a CUDA graph on a side stream (after one warm call there) and
    replayed once: the captured output, to compare with an eager call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return out


def conformance_rows(
    spec, dtypes: tuple[torch.dtype, ...], bi_dtypes: tuple[torch.dtype, ...] | None = None
) -> list[dict]:
    """``check_backend(spec)`` in the default mode (``dtypes``) and the batch-invariant mode
    (``bi_dtypes``, default ``dtypes``): one row per case (``mode``, ``op``, ``case``, ``status``,
    ``message``, ``own``), plus a failed ``case="*"`` row per op left untested and per op whose
    cases all were refused (the reasons as the message)."""
    from deepinfer_core.ops.modes import batch_invariant_mode
    from deepinfer_core.testing import check_backend

    rows: list[dict] = []
    for bi in (False, True):
        mode = "bi" if bi else "default"
        with batch_invariant_mode(bi):
            report = check_backend(spec, dtypes=(bi_dtypes or dtypes) if bi else dtypes)
        rows += [
            {
                "mode": mode,
                "op": r.op,
                "case": r.label,
                "status": r.status,
                "message": r.message,
                "own": r.own,
            }
            for r in report.results
        ]
        failed = [(op, "untested") for op in report.untested_ops] + [
            (op, str(why)) for op, why in report.never_ran.items()
        ]
        rows += [
            {"mode": mode, "op": op, "case": "*", "status": "failed", "message": why, "own": False}
            for op, why in failed
        ]
    return rows


def failed_rows(rows: list[dict], allowed_skip: str | None = None) -> list[str]:
    """The :func:`conformance_rows` that did not pass, described one per line; a skipped row
    whose reason contains ``allowed_skip`` (a refusal the test expects) does not count."""
    return [
        f"{r.get('mode', '')} {r['case']}: {r['status']} {r['message']}"
        for r in rows
        if r["status"] != "passed"
        and not (allowed_skip is not None and r["status"] == "skipped" and allowed_skip in r["message"])
    ]


def op_conformance_rows(name: str, op: str, impl: Callable, device: str, dtypes: tuple[torch.dtype, ...]):
    """:func:`conformance_rows` of a backend ``name`` on ``device`` that serves only ``op``, by
    ``impl()`` (an ``OpImpl``), in both modes on ``dtypes``."""
    from deepinfer_core.backends import BackendSpec

    return conformance_rows(BackendSpec(name=name, device_type=device, ops=lambda: {op: impl()}), dtypes)


def op_impl(module: str, factory: str, op: str) -> Callable:
    """``impl()`` giving the ``OpImpl`` of ``op`` from ``deepinfer_cuda_sm100.<module>.<factory>()``
    (imported at the call: the kernels, and so Triton, only where a test runs them)."""
    import importlib

    return lambda: getattr(importlib.import_module(f"deepinfer_cuda_sm100.{module}"), factory)()[op]


def op_conformance(
    name: str, op: str, impl: Callable
) -> Callable[[str, tuple[torch.dtype, ...]], list[dict]]:
    """``conformance(device, dtypes)``: :func:`op_conformance_rows` of the backend ``name``
    serving only ``op`` by ``impl()``."""
    return lambda device, dtypes: op_conformance_rows(name, op, impl, device, dtypes)


def conformance_problems(
    rows: list[dict], allowed_skip: str | None = None, core: str = "core's"
) -> list[str]:
    """What is wrong with a kernel's :func:`conformance_rows`: none of its own cases passed,
    none of the ``core`` cases passed, or rows that failed (:func:`failed_rows`)."""
    problems = []
    if not any(r["own"] and r["status"] == "passed" for r in rows):
        problems.append("the kernel's own cases did not run")
    if not any(not r["own"] and r["status"] == "passed" for r in rows):
        problems.append(f"the {core} cases did not run")
    return problems + failed_rows(rows, allowed_skip)


@pytest.mark.slow  # it reads the report of a fresh interpreter running the kernels
def test_kernel_ran_interpreted(report):
    """The importing module's ``report`` fixture (:func:`interpreter_report`) ran its kernels in
    Triton's interpreter."""
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "bi"])
def test_interpreter_conformance(report, mode):
    """The report's conformance rows of each mode: the kernel's own and the core's cases ran,
    none failed (:func:`conformance_problems`)."""
    rows = [r for r in report["conformance"] if r["mode"] == mode]
    bad = conformance_problems(rows)
    assert not bad, "\n".join(bad)


def interpreter_report(script: Path) -> dict:
    """Run ``script --interpreter-report`` in a fresh interpreter with ``TRITON_INTERPRET=1``
    (the repo and the plugin on its path) and return the JSON of its last output line."""
    plugin = script.resolve().parent.parent
    repo = plugin.parent.parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(repo), str(plugin), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), "--interpreter-report"],
        capture_output=True,
        text=True,
        env=env,
        cwd=script.parent,
        timeout=600,
    )
    assert proc.returncode == 0, f"the interpreter child failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_problem() -> str | None:
    """Why the kernels cannot be compiled ahead of time for a GPU here (the offline compile
    tests), or ``None``: under ``TRITON_INTERPRET`` they are interpreter functions, and
    Triton's NVIDIA backend must be installed."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels are interpreter functions"
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        return "Triton's NVIDIA backend is not installed"
    return None


TRITON_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}
"""Triton's names of the tensor dtypes the kernels take (for :func:`compile_launch`)."""


def record_launches(monkeypatch, module, names, launches: list | None = None) -> list[tuple]:
    """Replace the Triton kernels ``names`` of ``module`` (with ``monkeypatch``) by recorders:
    each launch appends ``(kernel, args, kwargs)`` to the returned list (``launches`` where
    given) and runs nothing, so a host wrapper called on CPU tensors yields the arguments
    :func:`compile_launch` takes."""
    launches = [] if launches is None else launches

    class _Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    for name in names:
        monkeypatch.setattr(module, name, _Recorder(getattr(module, name)))
    return launches


def constexpr_defaults(fn, given) -> dict:
    """``fn``'s constexpr parameters outside ``given`` that have a default (``USE_PDL``, which a
    launch leaves out where PDL is off), with those defaults."""
    return {p.name: p.default for p in fn.params if p.name not in given and p.is_constexpr and p.has_default}


def compile_typed(fn, args: dict[str, str], constexprs: dict, arch: int, hints: bool = True, **options):
    """``fn`` compiled for ``sm_<arch>``: ``args`` maps each runtime argument to its Triton type
    (``"*bf16"``, ``"i32"``, ...; with ``hints``, pointers and ``stride*`` arguments get the
    16-divisibility hint the launcher gives aligned values); constexprs left out take their
    defaults."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**constexpr_defaults(fn, {*args, *constexprs}), **constexprs}
    signature = {**args, **{name: "constexpr" for name in constexprs}}
    names = list(fn.arg_names)
    signature = {name: signature[name] for name in names}
    div16 = [["tt.divisibility", 16]]
    attrs = {
        (names.index(n),): div16
        for n, ty in args.items()
        if hints and (ty.startswith("*") or n.startswith("stride_"))
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_launch(fn, args: tuple, kwargs: dict, arch: int):
    """``fn`` compiled for ``sm_<arch>`` as a launch with ``args`` would specialise it: tensors
    as typed pointers (16-byte aligned ones with the divisibility hint), ints equal to 1 and
    constexpr parameters given by position as constants, multiples of 16 with the hint."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    consts = {k: v for k, v in kwargs.items() if k not in options}
    consts |= constexpr_defaults(fn, {*names[: len(args)], *consts})
    signature, attrs = {}, {}
    for i, a in enumerate(args):
        name = names[i]
        if fn.params[i].is_constexpr:  # a constexpr passed by position: specialised on its value
            consts[name] = a
            continue
        if isinstance(a, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[a.dtype]
            aligned = a.data_ptr() % 16 == 0
        elif isinstance(a, float):
            signature[name], aligned = "fp32", False
        elif a == 1:
            signature[name], consts[name] = "constexpr", 1
            continue
        else:
            signature[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            aligned = a % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature |= {k: "constexpr" for k in consts}
    signature = {n: signature[n] for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def global_loads_around(ptx: str, *markers: str) -> tuple[int, int]:
    """The ``ld.global`` instructions of ``ptx`` before and after the first instance of any of
    ``markers`` (e.g. a block barrier, an IEEE square root): where a kernel's loads stand
    against its arithmetic.  Raises ``ValueError`` when no marker occurs."""
    first = min(i for i in (ptx.find(m) for m in markers) if i >= 0)
    return ptx[:first].count("ld.global"), ptx[first:].count("ld.global")


def _lower_sm90(func, pass_configs: dict | None = None):
    import tilelang
    import tvm
    from tvm.target import Target

    target = Target({"kind": "cuda", "arch": "sm_90"})
    with target, tvm.transform.PassContext(config=pass_configs or {}):
        return tilelang.lower(func, target=target)


def lowered_sm90(func, pass_configs: dict | None = None) -> str:
    """The CUDA source TileLang generates for ``func`` (a ``prim_func``) on sm_90 (no GPU
    needed; TileLang must import)."""
    return _lower_sm90(func, pass_configs).kernel_source


def sm90a_cubin(source: str, path) -> str:
    """Build the generated CUDA ``source`` (written to ``path``) for sm_90a with TileLang's
    nvcc options into ``path.with_suffix(".cubin")``; returns the compiler's output with
    ``ptxas -v``'s resource report and its warnings (asserts the build succeeded)."""
    import subprocess

    from tilelang.contrib.nvcc import default_compile_options, get_nvcc_compiler

    path.write_text(source)
    cmd = [get_nvcc_compiler(), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", *default_compile_options()]
    cmd += ["-Xptxas", "-v", "-o", str(path.with_suffix(".cubin")), str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-2000:]
    return report


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """A compiled kernel's registers and stack bytes a thread and its SASS instructions
    (``{"REG": .., "STACK": .., "SASS": ..}``), from Triton's bundled ``cuobjdump`` run on its
    ``cubin`` bytes."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    found = {key: int(value) for key, value in re.findall(r"\b(REG|STACK):(\d+)", usage)}
    return found | {"SASS": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.M))}


def pdl_prologue_problem(func, accesses: str, pass_configs: dict | None = None) -> str | None:
    """Why ``func`` (a ``prim_func`` built with the PDL prologue), lowered for sm_90, does not
    wait for the kernel before it (``griddepcontrol.wait``) before its first global access (the
    first match of the regular expression ``accesses`` in its kernel body) and only then let
    the next kernel be scheduled, or is not marked for a PDL launch; ``None`` when it does."""
    import re

    lowered = _lower_sm90(func, pass_configs)
    src = lowered.kernel_source
    body = src[src.index("__global__ void __launch_bounds__") :]
    if "cudaGridDependencySynchronize();" not in body:
        return "no griddepcontrol.wait in the kernel"
    wait = body.index("cudaGridDependencySynchronize();")
    if body.find("cudaTriggerProgrammaticLaunchCompletion();") < wait:
        return "the next kernel is let be scheduled before (or without) the wait"
    first = [m.start() for m in re.finditer(accesses, body)]
    if not first:
        return f"no global access matching {accesses!r} in the kernel"
    if min(first) < wait:
        return "a global access before the wait: ..." + body[: min(first)][-300:]
    if '"has_cuda_pdl_sync": 1' not in str(lowered.device_mod):
        return "the kernel is not marked for a PDL launch"
    return None


def loops_containing(src: str, needle: str) -> list[str]:
    """The bodies of the innermost ``for`` loops of generated CUDA ``src`` (one statement a
    line, nesting by indentation) that contain a line with ``needle``."""
    lines = src.splitlines()

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    bodies = []
    for k, line in enumerate(lines):
        if needle not in line:
            continue
        j = k - 1
        while j >= 0 and not (lines[j].lstrip().startswith("for (") and indent(lines[j]) < indent(line)):
            j -= 1
        if j < 0:
            continue
        body = []
        for x in lines[j + 1 :]:
            if x.strip() and indent(x) <= indent(lines[j]):
                break
            body.append(x)
        bodies.append("\n".join(body))
    return bodies


def choice_writers():
    """``scripts/choice_writers.py`` (the benchmarks' table writers) loaded as a module."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "scripts" / "choice_writers.py"
    spec = importlib.util.spec_from_file_location("choice_writers", script)
    writers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writers)
    return writers


def sm90_moe_table(monkeypatch, points: tuple):
    """A fixture body: ``moe_experts`` dispatch runs as on a CUDA device of sm_90 whose measured
    table holds ``points`` (:class:`~deepinfer_cuda_sm100.kernel_choice.Point` s); afterwards the
    real table and device come back."""
    import functools

    from deepinfer_cuda_sm100 import kernel_choice, moe_dispatch

    cuda, real_mode_problem = torch.device("cuda", 0), moe_dispatch.mode_problem
    monkeypatch.setattr(moe_dispatch, "mode_problem", lambda device: real_mode_problem(cuda))
    monkeypatch.setattr(moe_dispatch, "grouped_device_problem", lambda device: None)
    monkeypatch.setattr(kernel_choice, "device_arch", lambda device: "sm90")
    table = functools.cache(lambda arch: points if arch == "sm90" else ())
    monkeypatch.setattr(kernel_choice, "load_points", table)
    kernel_choice._choose_shipped.cache_clear()
    yield
    monkeypatch.undo()
    kernel_choice.forget()
