"""The ``cuda_sm100`` step plans (``deepseek_v4.fixed_step_plans``) against the reference op.

**Interpreter** (a child with ``TRITON_INTERPRET=1``): the conformance suite on the op (its
cases: decode, verify with two and five drafts, a mixed step with a prefix hit's replay and
resume, padding only; three geometries) and randomised fixed-shape steps (decode, verify and
mixed buckets, async pending tokens, prefix boundaries, padding requests), every output equal
bit for bit to the reference's.  **Compiles** for sm_90 and sm_100 at V4-Flash's geometry.
**GPU**: randomised steps at V4-Flash's geometry and a captured graph replayed over new steps
written into the same input buffers, as the model runner's decode graphs are.
"""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch
from cuda_sm100_checks import failed_rows

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

from deepinfer_core.contract.batch import SeqChunk  # noqa: E402
from deepinfer_core.contract.step_inputs import StepInputBuffers  # noqa: E402
from deepinfer_core.models.deepseek_v4.plan_op import NAME, fixed_step_plans  # noqa: E402
from deepinfer_core.testing.compare import compare  # noqa: E402

SMALL = {"window": 8, "ratios": (4, 16), "page_size": 16, "num_slots": 12, "max_pages": 8}
"""Interpreter geometry: a window of 8, ratios 4 and 16, pages of 16 positions."""
V4_FLASH = {"window": 128, "ratios": (4, 128), "page_size": 256, "num_slots": 64, "max_pages": 16}
"""V4-Flash's geometry: a window of 128, ratios 4 and 128, pages of 256 positions."""
TRASH_PAGE = 1000


def _impl():
    from deepinfer_cuda_sm100.plan_ops import plan_ops

    return plan_ops()[NAME]


def random_chunks(rng: random.Random, geo: dict, kind: str, spec: int, n_prev: int) -> list[SeqChunk]:
    """Chunks of one random fixed-shape step of ``kind`` (``decode``, ``verify`` or ``mixed``)."""
    ps, cap = geo["page_size"], geo["page_size"] * geo["max_pages"]
    chunks = []
    for slot in rng.sample(range(geo["num_slots"]), rng.randint(0, min(6, geo["num_slots"]))):
        n = {"decode": 1, "verify": 1 + spec}.get(kind) or rng.choice([1, 1, 2, 5, ps // 2, ps + 3])
        start = rng.randrange(0, cap - n + 1)
        # a decoding step's chunks start at or past their cached boundary (page aligned)
        top = start + n if kind == "mixed" else start
        cached = ps * rng.randint(0, top // ps) if rng.random() < 0.6 else 0
        prev = rng.randrange(n_prev) if n == 1 and n_prev and rng.random() < 0.4 else -1
        table = [rng.randrange(TRASH_PAGE) for _ in range(-(-(start + n) // ps))]
        ids = [rng.randrange(2, 500) for _ in range(n)]
        chunks.append(
            SeqChunk(
                slot,
                ids,
                start,
                table,
                window_from=rng.randint(0, start),
                cached_until=cached,
                prev_row=prev,
                num_draft=n - 1 if kind == "verify" else 0,
            )
        )
    return chunks


def random_steps(geo: dict, count: int, seed: int, device: str) -> list[tuple]:
    """``count`` random fixed-shape steps as ``(args of the op)`` on ``device``."""
    rng = random.Random(seed)
    dev = torch.device(device)
    steps = []
    for _ in range(count):
        kind = rng.choice(["decode", "verify", "mixed"])
        spec = rng.choice([0, 1, 2, 5]) if kind != "mixed" else rng.choice([0, 2])
        prev = (
            torch.tensor([rng.randrange(2, 500) for _ in range(4)], device=dev)
            if rng.random() < 0.5
            else None
        )
        chunks = random_chunks(rng, geo, kind, spec, 0 if prev is None else 4)
        real = sum(len(c.token_ids) for c in chunks)
        t = real + rng.choice([0, 0, 1, 3]) or 1
        r = len(chunks) + (t > real) + rng.choice([0, 1, 2])
        bufs = StepInputBuffers(t, r, geo["num_slots"], geo["max_pages"], TRASH_PAGE, dev)
        cap = geo["page_size"] * geo["max_pages"]
        inputs = bufs.prepare(chunks, list(range(real)), prev, t, r, cap, decoding=kind != "mixed")
        window, ratios, ps, slots = geo["window"], geo["ratios"], geo["page_size"], geo["num_slots"]
        steps.append((inputs, window, ratios, ps, slots, TRASH_PAGE, spec))
    return steps


def plan_problems(steps: list[tuple]) -> list[str]:
    """Where the kernels' plans differ from the reference's (every output, bit for bit)."""
    fn, problems = _impl().fn, []
    for k, args in enumerate(steps):
        assert _impl().supports(*args) is True, _impl().supports(*args)
        got, want = fn(*args), fixed_step_plans(*args)
        found: list[str] = []
        compare(got, want, 0.0, 0.0, f"step {k} (T={args[0].num_tokens}, R={args[0].num_reqs})", found)
        problems += found
    return problems


def _conformance(device: str) -> list[dict]:
    from cuda_sm100_checks import conformance_rows

    from deepinfer_core.backends import BackendSpec

    spec = BackendSpec(name="cuda_sm100_plans", device_type=device, ops=lambda: {NAME: _impl()})
    return conformance_rows(spec, (torch.float32,))


def interpreter_report() -> dict:
    """Every interpreter check, as JSON-able data (run with ``TRITON_INTERPRET=1``)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from deepinfer_cuda_sm100.kernels import _common

    return {
        "interpreted": _common.INTERPRETED,
        "conformance": _conformance("cpu"),
        "random": plan_problems(random_steps(SMALL, 40, 0, "cpu")),
    }


slow = pytest.mark.slow


def test_kernel_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


@pytest.mark.parametrize("mode", ["default", "bi"])
def test_interpreter_conformance(report, mode):
    rows = [r for r in report["conformance"] if r["mode"] == mode and r["op"] == NAME]
    assert len(rows) >= 15, rows
    bad = failed_rows(rows)
    assert not bad, "\n".join(bad)


def test_interpreter_random_steps_are_bitwise(report):
    assert not report["random"], "\n".join(report["random"][:20])


def test_supports_names_the_culprit():
    from deepinfer_cuda_sm100.plan_ops import make_supports

    from deepinfer_core.contract.step_inputs import StepInputBuffers

    supports = make_supports(interpreted=True, max_reqs=8)
    args = random_steps(SMALL, 1, 3, "cpu")[0]
    assert supports(*args) is True
    bufs = StepInputBuffers(4, 3, 12, 8, TRASH_PAGE, torch.device("cpu"))
    unpadded = bufs.prepare([SeqChunk(0, [5, 6], 0, [1])], [1], None)
    assert "unpadded" in supports(unpadded, *args[1:])
    many = StepInputBuffers(16, 12, 12, 8, TRASH_PAGE, torch.device("cpu")).prepare([], [0], None, 16, 12, 64)
    assert "12 requests" in supports(many, *args[1:])
    assert "on cuda" in make_supports(interpreted=False, max_reqs=8)(*args)


@slow
@pytest.mark.parametrize("arch", [90, 100])
def test_kernels_compile_for_the_gpu(arch, monkeypatch):
    """Both kernels at V4-Flash's geometry (a 64-slot decode bucket and a mixed step), compiled
    for ``sm_<arch>`` from launch arguments recorded on CPU tensors (no kernel runs)."""
    from cuda_sm100_checks import compile_launch, compile_problem, record_launches

    if compile_problem() is not None:
        pytest.skip(compile_problem())
    from deepinfer_cuda_sm100.kernels import step_plans as sp

    launches = record_launches(monkeypatch, sp, ("_token_kernel", "_window_kernel"))
    for args in random_steps(V4_FLASH, 6, 1, "cpu"):
        sp.fixed_step_plans(*args)
    monkeypatch.undo()
    assert len(launches) == 18  # the token kernel and one window kernel per ratio, 6 steps
    for kernel, args, kwargs in launches:
        compile_launch(kernel, args, kwargs, arch)


# ---------------------------------------------------------------------------------------------
# GPU

needs_cuda = pytest.mark.gpu


@needs_cuda
def test_gpu_conformance_and_random_steps():
    problems = failed_rows([r for r in _conformance("cuda") if r["op"] == NAME])
    problems += plan_problems(random_steps(V4_FLASH, 60, 2, "cuda") + random_steps(SMALL, 30, 4, "cuda"))
    assert not problems, "\n".join(problems[:20])


@needs_cuda
def test_gpu_graph_replays_new_steps():
    """A decode bucket's plans captured once, then replayed after new steps were written into
    the same input buffers: each replay equals the reference on that step."""
    geo, dev = V4_FLASH, torch.device("cuda")
    rng = random.Random(5)
    bucket, cap = 8, V4_FLASH["page_size"] * V4_FLASH["max_pages"]
    bufs = StepInputBuffers(bucket, bucket + 1, geo["num_slots"], geo["max_pages"], TRASH_PAGE, dev)
    prev = torch.zeros(bucket, dtype=torch.int64, device=dev)
    fn = _impl().fn
    const = (geo["window"], geo["ratios"], geo["page_size"], geo["num_slots"], TRASH_PAGE, 0)

    def step(chunks):
        return bufs.prepare(chunks, list(range(bucket)), prev, bucket, bucket + 1, cap, decoding=True)

    inputs = step(random_chunks(rng, geo, "decode", 0, bucket))
    fn(inputs, *const)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(inputs, *const)
    for k in range(6):
        chunks = random_chunks(rng, geo, "decode", 0, bucket)[:bucket]
        prev.copy_(torch.randint(2, 500, (bucket,), device=dev))
        new = step(chunks)
        graph.replay()
        want = fixed_step_plans(new, *const)
        found: list[str] = []
        compare(out, want, 0.0, 0.0, f"replay {k}", found)
        assert not found, "\n".join(found)


if __name__ == "__main__" and "--interpreter-report" in sys.argv:
    print(json.dumps(interpreter_report()))
