"""The Triton kernels against the reference, in Triton's CPU interpreter (no GPU needed).

``interpreter_run.py`` runs in a fresh interpreter with ``TRITON_INTERPRET=1`` (set before
the kernels are imported, and kept out of this process, whose GPU tests need the compiled
kernels): the core conformance suite on CPU tensors with the op's own cases and the
kernels' scaled-down V4-Flash cases (:data:`deepinfer_cuda_sm100.cases.SMALL`) in float32,
bfloat16 and float16, plus batch invariance.  Each test below reads one part of its report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_sm100_checks import failed_rows
from deepinfer_cuda_sm100.ops import FUSED_OPS

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")
pytestmark = pytest.mark.slow  # one fresh interpreter running the kernels interpreted: ~10 s

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def report() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "interpreter_run.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE,
        timeout=600,
    )
    assert proc.returncode == 0, f"interpreter_run.py failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_kernels_ran_interpreted(report):
    assert report["interpreted"], "TRITON_INTERPRET=1 did not reach the kernel modules"


def test_package_imports_without_triton(report):
    outcome = report["without_triton"]
    assert outcome["imported"], outcome.get("error")
    assert not outcome["available"] and outcome["reason"]


@pytest.mark.parametrize("op", FUSED_OPS)
def test_conformance_in_interpreter(report, op):
    results = [r for r in report["cases"] if r["op"] == op]
    assert results and op not in report["untested"], f"{op}: no conformance case ran"
    assert op not in report["never_ran"], report["never_ran"].get(op)
    own = [r for r in results if "own" in r["case"]]
    assert own, f"{op}: the kernels' own (V4-Flash-like) cases did not run"
    bad = failed_rows(results)
    assert not bad, f"{op}: " + "; ".join(bad)


@pytest.mark.parametrize("op", FUSED_OPS)
def test_batch_invariance_in_interpreter(report, op):
    assert not report["invariance"][op], "; ".join(report["invariance"][op])
