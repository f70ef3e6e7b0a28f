"""The ``cuda_sm100`` ``qk_norm_rope`` (the attention block's query and key norms and their rope
in one launch) against the four kernels it fuses.

**Interpreter** (a child run with ``TRITON_INTERPRET=1``, ``python test_qk_norm_rope.py
--interpreter-report``): at the small shapes (4 heads of 64, a rope of 16) and at V4-Flash's
(64 heads of 512, a rope of 64), in float32, bfloat16 and float16, for 1, 5 and 19 tokens, with
the queries normed (V4) and not (V4.1), a weighted and an unweighted key norm, and the key row a
strided view of a fused projection: both outputs are bitwise what ``cuda_sm100``'s own
``rms_norm`` and ``apply_rope`` kernels give in sequence (the op's decomposition on this
backend).  Conformance against the reference and batch invariance are in ``test_interpreter.py``.

**Launches** (no kernel runs): one launch where the sequence takes four (three for V4.1), and
the kernel compiles for sm_90 and sm_100.

**GPU** (skipped without CUDA): bitwise the sequence at V4-Flash's shapes (1, 64 and 256 tokens),
and its replay in a CUDA graph.
"""

from __future__ import annotations

import json
import os
import re
import sys

import cuda_sm100_checks as checks
import pytest
import torch
from cuda_sm100_checks import compile_problem

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SMALL, V4_FLASH = (4, 64, 16), (64, 512, 64)
"""``(heads, head_dim, rope_dim)``."""


def _calls(
    shape: tuple[int, int, int], tokens, dtype: torch.dtype, device: str
) -> list[tuple[str, tuple, dict]]:
    """``(label, args, kwargs)`` of ``qk_norm_rope``: V4's and V4.1's calls, and an unweighted
    key norm, for each token count."""
    heads, d, rope = shape
    g = torch.Generator().manual_seed(d)

    def randn(*s, scale=1.0, dt=torch.float32):
        return (torch.randn(*s, generator=g) * scale).to(dt).to(device)

    calls = []
    for t in tokens:
        angles = torch.randint(0, 1 << 16, (t, 1), generator=g) * 10000.0 ** -(
            torch.arange(rope // 2) / (rope // 2)
        )
        cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
        q = randn(t, heads, d, scale=3.0, dt=dtype)
        kv = randn(t, 3 * d, scale=3.0, dt=dtype)[:, d : 2 * d]  # a split of a fused projection
        w = 1 + randn(d, scale=0.1)
        calls += [
            (f"T={t} V4", (q, kv, w, 1e-6, cos, sin), {}),
            (f"T={t} V4.1", (q, kv, w, 1e-6, cos, sin), {"norm_q": False}),
            (f"T={t} unweighted", (q, kv, None, 1e-6, cos, sin), {}),
        ]
    return calls


def _sequence(q, kv, kv_weight, eps, cos, sin, norm_q=True):
    from deepinfer_cuda_sm100.kernels import norm, rope

    if norm_q:
        q = norm.rms_norm(q, None, eps)
    kv = norm.rms_norm(kv, kv_weight, eps)
    return rope.apply_rope(q, cos, sin), rope.apply_rope(kv.unsqueeze(1), cos, sin)[:, 0]


def sequence_problems(shape, tokens, dtypes, device: str) -> list[str]:
    """Where the fused op is not bitwise the ``rms_norm`` and ``apply_rope`` kernels in sequence."""
    from deepinfer_cuda_sm100.kernels import qk_norm_rope

    problems = []
    for dtype in dtypes:
        for label, args, kwargs in _calls(shape, tokens, dtype, device):
            got = qk_norm_rope.qk_norm_rope(*args, **kwargs)
            want = _sequence(*args, **kwargs)
            for name, a, b in zip(("q", "kv"), got, want, strict=True):
                problems.append(checks.bitwise_problem(f"{shape} {dtype} {label}: {name} differs", a, b))
    return [p for p in problems if p]


# ---------------------------------------------------------------------------------------------
# the interpreter child


def interpreter_report() -> dict:
    """The interpreter checks, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {
        "interpreted": _common.INTERPRETED,
        "small": sequence_problems(SMALL, (1, 5, 19), DTYPES, "cpu"),
        "v4_flash": sequence_problems(V4_FLASH, (1, 3), (torch.bfloat16, torch.float32), "cpu"),
    }


slow = pytest.mark.slow  # they read the report of a fresh interpreter running the kernels
test_kernel_ran_interpreted = checks.test_kernel_ran_interpreted  # the report's shared test


@slow
@pytest.mark.parametrize("part", ["small", "v4_flash"])
def test_interpreter_fused_is_bitwise_the_sequence(report, part):
    assert not report[part], "\n".join(report[part])


# ---------------------------------------------------------------------------------------------
# launches (no kernel runs)


def _launches(monkeypatch, fn, args, kwargs) -> list:
    from cuda_sm100_checks import record_launches
    from deepinfer_cuda_sm100.kernels import norm, qk_norm_rope, rope

    launches: list = []
    record_launches(monkeypatch, qk_norm_rope, ("_qk_norm_rope_kernel",), launches)
    record_launches(monkeypatch, norm, ("_rms_norm_kernel",), launches)
    record_launches(monkeypatch, rope, ("_rope_kernel",), launches)
    fn(*args, **kwargs)
    monkeypatch.undo()
    return launches


@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
def test_one_launch_where_the_sequence_takes_four(monkeypatch):
    from deepinfer_cuda_sm100.kernels import qk_norm_rope

    [(_, args, v4), (_, _, v41), _] = _calls(V4_FLASH, (2,), torch.bfloat16, "cpu")
    for kwargs, apart in ((v4, 4), (v41, 3)):
        assert len(_launches(monkeypatch, qk_norm_rope.qk_norm_rope, args, kwargs)) == 1
        assert len(_launches(monkeypatch, _sequence, args, kwargs)) == apart


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
@pytest.mark.parametrize("arch", [90, 100])
def test_the_kernel_compiles_for_the_gpu(arch, monkeypatch):
    from cuda_sm100_checks import compile_launch
    from deepinfer_cuda_sm100.kernels import qk_norm_rope

    launches = []
    for _, args, kwargs in _calls(V4_FLASH, (2,), torch.bfloat16, "cpu"):
        launches += _launches(monkeypatch, qk_norm_rope.qk_norm_rope, args, kwargs)
    assert len(launches) == 3
    for kernel, args, kwargs in launches:
        assert compile_launch(kernel, args, kwargs, arch).asm["ptx"]


@slow
@pytest.mark.skipif(compile_problem() is not None, reason=compile_problem() or "")
def test_weights_and_rope_tables_load_before_the_norms_sum(monkeypatch):
    """The loads that do not depend on the rows (the key's norm weight, the rope tables) are
    issued with the rows', before the sum of squares' first block barrier, so their latency
    overlaps the rows' instead of following the sum (and, for the tables, the block barrier
    before the rotation).  ``rms_norm``'s own kernel likewise loads its weight with the row:
    at V4-Flash's widths every global load comes before the first barrier.  No 64-bit integer
    division: the head count is a compile-time constant."""
    from cuda_sm100_checks import compile_launch, global_loads_around
    from deepinfer_cuda_sm100.kernels import norm, qk_norm_rope

    [(_, args, kwargs)] = _calls(V4_FLASH, (1,), torch.bfloat16, "cpu")[:1]
    kernel, a, kw = _launches(monkeypatch, qk_norm_rope.qk_norm_rope, args, kwargs)[0]
    # rows, weight and cosines (sines follow the cosines' layout change); the rows were before
    # with the weight after the sum and the tables after the rotation's barrier: 2
    ptx = compile_launch(kernel, a, kw, 90).asm["ptx"]
    assert global_loads_around(ptx, "bar.sync")[0] >= 4
    # a query row's token and head from the head count, a constant: no 64-bit division
    # subroutine before the first load (it was two, on every program's critical path)
    assert not re.search(r"\b(div|rem)\.[su]64\b", ptx)
    for d in (1024, 4096):
        x = torch.empty(1, d, dtype=torch.bfloat16)
        block_r, block_d, warps = norm.row_tile(d)
        launch = dict(HAS_WEIGHT=True, FACTOR_IN_X_DTYPE=False, BLOCK_R=block_r, BLOCK_D=block_d)
        launch |= dict(NUM_TILES=1, num_warps=warps)
        ptx = compile_launch(norm._rms_norm_kernel, (x, x[0], x, 1, d, d, 1e-6), launch, 90).asm["ptx"]
        assert global_loads_around(ptx, "bar.sync")[1] == 0, d


def test_supports_refuses_with_the_reason():
    from deepinfer_cuda_sm100.ops import make_supports

    sup = make_supports(True)["qk_norm_rope"]
    (_, args, _), (_, v41, kw41) = _calls(SMALL, (3,), torch.bfloat16, "cpu")[:2]
    assert sup(*args) is True and sup(*v41, **kw41) is True
    q, kv, w, eps, cos, sin = args
    wide = _calls((2, 8192, 64), (1,), torch.bfloat16, "cpu")[0][1]
    bad = [
        (wide, {}, "over 4096"),
        ((q, kv.float(), w, eps, cos, sin), {}, "kv dtype"),
        ((q, kv[:2], w, eps, cos, sin), {}, "kv has shape"),
        ((q, kv, w[:-1], eps, cos, sin), {}, "kv_weight has shape"),
        ((q, kv, w, eps, cos[:, :0], sin[:, :0]), {}, "no rotated pair"),
        ((q[:, :, :8], kv[:, :8], w[:8], eps, cos, sin), {}, "rope width"),
        ((q, kv, w, eps, cos, sin), {"norm_q": 1}, "not a bool"),
    ]
    for call, kwargs, reason in bad:
        verdict = sup(*call, **kwargs)
        assert isinstance(verdict, str) and reason in verdict, (reason, verdict)
    assert "GPU" in make_supports(False)["qk_norm_rope"](*args)


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu  # skipped with the reason where no GPU backend runs (conftest.py)


@needs_cuda
def test_gpu_fused_is_bitwise_the_sequence():
    problems = sequence_problems(V4_FLASH, (1, 64, 256), (torch.bfloat16, torch.float32), "cuda")
    assert not problems, "\n".join(problems)


@needs_cuda
def test_gpu_graph_replay():
    from deepinfer_cuda_sm100.cases import V4_FLASH as SHAPES
    from deepinfer_cuda_sm100.kernels import qk_norm_rope

    problems = checks.graph_replay_problems("qk_norm_rope", qk_norm_rope.qk_norm_rope, SHAPES, torch.bfloat16)
    assert not problems, "\n".join(problems)


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
