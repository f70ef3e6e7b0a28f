"""The ``cuda_sm100`` ``hc_post_pre`` (the transition between two blocks in two launches) and
``hc_head_norm`` (the final collapse and norm in two) against the ops they fuse.

**Interpreter** (a child run with ``TRITON_INTERPRET=1``, ``python test_mhc_chain.py
--interpreter-report``): at the small shapes (:data:`deepinfer_cuda_sm100.cases.SMALL`: 4 streams
of 256) and at 4 streams of 4,096 (V4-Flash's width, whose row the kernel norms in one program), in
float32, bfloat16 and float16, for 1, 5 and 19 tokens, after a block, for the first block (no block
output) and with the unweighted norm, every output is bitwise what ``cuda_sm100``'s own
``hc_post``, ``hc_pre`` and ``rms_norm`` kernels give in sequence (the op's decomposition on this
backend); ``hc_head_norm`` likewise against ``hc_head`` then ``rms_norm``.  Conformance against
the reference and batch invariance are in ``test_interpreter.py`` (the fused ops' report).

**Launches** (no kernel runs): two launches where the sequence takes four (three for the first
block; ``hc_head_norm``: two for three), and the kernels compile for sm_90 and sm_100.

**GPU** (skipped without CUDA): bitwise the sequence at V4-Flash's shapes (1, 64 and 256 tokens),
and its replay in a CUDA graph.
"""

from __future__ import annotations

import json
import os
import sys

import cuda_sm100_checks as checks
import pytest
import torch
from cuda_sm100_checks import compile_problem

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _calls(d: int, tokens: tuple[int, ...], dtype: torch.dtype, device: str) -> list[tuple[str, tuple]]:
    """``(label, hc_post_pre args)``: after a block (weighted norm), the first block, the
    unweighted norm, for each token count."""
    g = torch.Generator().manual_seed(d)
    n = 4
    m, k = (2 + n) * n, n * d

    def randn(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

    calls = []
    for t in tokens:
        pre = (randn(m, k, scale=k**-0.5), randn(m), 1 + randn(3, scale=0.1), 1e-6, 1e-6, 20)
        block_out, streams = randn(t, d, dt=dtype), randn(t, n, d, dt=dtype)
        post = 2 * randn(n, t).sigmoid().t()  # transposed, as the reference's hc_pre gives it
        comb = randn(t, n, n).softmax(-1)
        norm = 1 + randn(d, scale=0.1)
        calls += [
            (f"T={t} after a block", (block_out, streams, post, comb, *pre, norm)),
            (f"T={t} first block", (None, streams, None, None, *pre, norm)),
            (f"T={t} unweighted", (block_out, streams, post, comb, *pre, None)),
        ]
    return calls


def sequence_problems(d: int, tokens: tuple[int, ...], dtypes, device: str) -> list[str]:
    """Where the fused op is not bitwise ``hc_post`` → ``hc_pre`` → ``rms_norm`` on the kernels."""
    from deepinfer_cuda_sm100.kernels import mhc, mhc_chain, norm

    problems = []
    for dtype in dtypes:
        for label, args in _calls(d, tokens, dtype, device):
            block_out, streams, post, comb, fn, base, scale, eps, hc_eps, iters, weight = args
            n_streams = streams.shape[1]
            got = mhc_chain.hc_post_pre(*args)
            new = streams if block_out is None else mhc.hc_post(block_out, streams, post, comb)
            p, c, x = mhc.hc_pre(new, fn, base, scale, eps, hc_eps, iters)
            want = (new, p, c, norm.rms_norm(x, weight, eps))
            for name, a, b in zip(("streams", "post", "comb", "x"), got, want, strict=True):
                problems.append(checks.bitwise_problem(f"D={d} {dtype} {label}: {name} differs", a, b))
            if block_out is None and got[0] is not streams:
                problems.append(f"D={d} {dtype} {label}: the streams are not the input tensor")
            head = (fn[:n_streams], base[:n_streams], scale[:1], eps, hc_eps)  # hc_head's shapes
            got = mhc_chain.hc_head_norm(streams, *head, weight)
            want = norm.rms_norm(mhc.hc_head(streams, *head), weight, eps)
            problems.append(checks.bitwise_problem(f"D={d} {dtype} {label}: hc_head_norm differs", got, want))
    return [p for p in problems if p]


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """The interpreter checks, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {
        "interpreted": _common.INTERPRETED,
        "small": sequence_problems(256, (1, 5, 19), DTYPES, "cpu"),
        "v4_width": sequence_problems(4096, (1, 3), (torch.bfloat16,), "cpu"),
    }


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernels
test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared test


@slow
@pytest.mark.parametrize("part", ["small", "v4_width"])
def test_interpreter_fused_is_bitwise_the_sequence(report, part):
    assert not report[part], "\n".join(report[part])


# ---------------------------------------------------------------------------------------------
# launches (no kernel runs)


def _launches(monkeypatch, fn, *args) -> list[str]:
    from cuda_sm100_checks import record_launches
    from deepinfer_cuda_sm100.kernels import mhc, mhc_chain, norm

    launches: list = []
    record_launches(monkeypatch, mhc, ("_hc_mix_kernel", "_hc_finish_kernel", "_hc_post_kernel"), launches)
    record_launches(monkeypatch, mhc_chain, ("_hc_post_mix_kernel",), launches)
    record_launches(monkeypatch, norm, ("_rms_norm_kernel",), launches)
    fn(*args)
    monkeypatch.undo()
    return launches


@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
def test_two_launches_where_the_sequence_takes_four(monkeypatch):
    from deepinfer_cuda_sm100.kernels import mhc, mhc_chain, norm

    [(_, after), (_, first), _] = _calls(4096, (2,), torch.bfloat16, "cpu")[:3]

    def sequence(block_out, streams, post, comb, fn, base, scale, eps, hc_eps, iters, weight):
        new = streams if block_out is None else mhc.hc_post(block_out, streams, post, comb)
        norm.rms_norm(mhc.hc_pre(new, fn, base, scale, eps, hc_eps, iters)[2], weight, eps)

    fused = _launches(monkeypatch, mhc_chain.hc_post_pre, *after)
    assert [k.fn.__name__ for k, _, _ in fused] == ["_hc_post_mix_kernel", "_hc_finish_kernel"]
    assert len(_launches(monkeypatch, sequence, *after)) == 4
    assert len(_launches(monkeypatch, mhc_chain.hc_post_pre, *first)) == 2
    assert len(_launches(monkeypatch, sequence, *first)) == 3
    streams, fn, base, scale, eps, hc_eps, weight = after[1], *after[4:6], after[6], *after[7:9], after[10]
    head = (streams, fn[:4], base[:4], scale[:1], eps, hc_eps)
    assert len(_launches(monkeypatch, mhc_chain.hc_head_norm, *head, weight)) == 2
    assert len(_launches(monkeypatch, lambda *a: norm.rms_norm(mhc.hc_head(*a), weight, eps), *head)) == 3


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_the_kernels_compile_for_the_gpu(arch, monkeypatch):
    from cuda_sm100_checks import compile_launch
    from deepinfer_cuda_sm100.kernels import mhc_chain

    launches = []
    for _, args in _calls(4096, (2,), torch.bfloat16, "cpu"):
        launches += _launches(monkeypatch, mhc_chain.hc_post_pre, *args)
    assert len(launches) == 6
    for kernel, args, kwargs in launches:
        assert compile_launch(kernel, args, kwargs, arch).asm["ptx"]


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
def test_the_sinkhorn_loop_runs_without_a_block_barrier(monkeypatch):
    """The finishing kernel's Sinkhorn iterations (the only loop with IEEE divisions) reduce the
    ``N x N`` weights within each warp: no ``bar.sync`` in the loop (each was a round trip
    through shared memory, 19 iterations a call).  The loop is found in the PTX as the code
    between a loop header's label and its backward branch."""
    import re

    from cuda_sm100_checks import compile_launch
    from deepinfer_cuda_sm100.kernels import mhc_chain

    [(_, args)] = _calls(4096, (1,), torch.bfloat16, "cpu")[:1]
    kernel, a, kw = _launches(monkeypatch, mhc_chain.hc_post_pre, *args)[-1]
    assert kernel.fn.__name__ == "_hc_finish_kernel"
    ptx = compile_launch(kernel, a, kw, 90).asm["ptx"]
    loops = [
        ptx[m.end() : ptx.index(f"bra \t{m.group(1)};", m.end())]
        for m in re.finditer(r"^(\$L__BB\d+_\d+):\s*// =>This Inner Loop Header", ptx, re.M)
    ]
    sinkhorn = [body for body in loops if "div.rn" in body]
    assert len(sinkhorn) == 1, len(loops)
    assert "bar.sync" not in sinkhorn[0]


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
def test_the_finishing_kernel_loads_everything_before_its_first_square_root(monkeypatch):
    """Of the finishing kernel (``hc_post_pre``'s, with the norm weight), every global load --
    the partials, the mixing rows' scales and biases, the norm weight, the streams' channels --
    comes before the norm factor's square root in the PTX: none waits behind the weights'
    arithmetic (they were loaded after it, each a memory round trip on the critical path)."""
    from cuda_sm100_checks import compile_launch, global_loads_around
    from deepinfer_cuda_sm100.kernels import mhc_chain

    [(_, args)] = _calls(4096, (1,), torch.bfloat16, "cpu")[:1]
    kernel, a, kw = _launches(monkeypatch, mhc_chain.hc_post_pre, *args)[-1]
    assert kernel.fn.__name__ == "_hc_finish_kernel" and kw["NORM_WEIGHT"]
    before, after = global_loads_around(compile_launch(kernel, a, kw, 90).asm["ptx"], "sqrt.rn.f32")
    assert before >= 4 and after == 0, (before, after)


def test_supports_refuses_with_the_reason():
    from deepinfer_cuda_sm100.mhc_checks import mhc_supports

    sup = mhc_supports(True)["hc_post_pre"]
    [(_, after), (_, first), _] = _calls(256, (3,), torch.bfloat16, "cpu")[:3]
    assert sup(*after) is True and sup(*first) is True
    wide = _calls(8192, (1,), torch.bfloat16, "cpu")[0][1]
    bad = [
        (wide, "over 4096"),
        ((None, *after[1:]), "without block_out"),
        ((after[0], after[1], None, None, *after[4:]), "without the previous block's post"),
        ((*after[:10], torch.ones(255)), "norm_weight has shape"),
        ((*after[:10], torch.ones(256, dtype=torch.int32)), "norm_weight dtype"),
        ((after[0][:, :128], *after[1:]), "block_out has shape"),
    ]
    for args, reason in bad:
        verdict = sup(*args)
        assert isinstance(verdict, str) and reason in verdict, (reason, verdict)
    assert "GPU" in mhc_supports(False)["hc_post_pre"](*after)


def test_the_stated_width_is_the_kernels():
    from deepinfer_cuda_sm100.checks import MAX_NORM_TILE
    from deepinfer_cuda_sm100.kernels import mhc, norm

    assert MAX_NORM_TILE == mhc.MAX_NORM_D == norm.MAX_BLOCK_D


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
def test_gpu_fused_is_bitwise_the_sequence():
    problems = sequence_problems(4096, (1, 64, 256), (torch.bfloat16, torch.float32), "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_graph_replay():
    from deepinfer_cuda_sm100.kernels import mhc_chain

    problems = checks.graph_replay_problems("hc_post_pre", mhc_chain.hc_post_pre, _v4_flash(), torch.bfloat16)
    assert not problems, "\n".join(problems)


def _v4_flash():
    from deepinfer_cuda_sm100.cases import V4_FLASH

    return V4_FLASH


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
