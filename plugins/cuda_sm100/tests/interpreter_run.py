"""Run the ``cuda_sm100`` kernels in Triton's CPU interpreter and print a JSON report.

Started in a fresh interpreter by ``test_interpreter.py``: ``TRITON_INTERPRET=1`` must be
set before the kernel modules are imported, and must not leak into a pytest process that
also runs the compiled kernels on a GPU.  Steps:

1. with ``import triton`` made to fail, the package (plugin, probe, op table, cases) imports
   and the probe explains what is missing;
2. the conformance suite (``check_backend``) on a CPU ``BackendSpec`` built from
   ``load_ops``, for the ops of :data:`~deepinfer_cuda_sm100.ops.FUSED_OPS`: the op's own
   cases and the kernels' :data:`~deepinfer_cuda_sm100.cases.SMALL` cases, in float32,
   bfloat16 and float16;
3. batch invariance of every op (bfloat16: the serving dtype; the rows' independence does not
   depend on the dtype, and each check costs seconds in the interpreter).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def imports_without_triton() -> dict:
    """Import the package with ``triton`` unimportable; report what happened."""
    sys.modules["triton"] = None  # type: ignore[assignment]  # `import triton` now raises ImportError
    try:
        from deepinfer_cuda_sm100 import backend, cases, ops, plugin  # noqa: F401

        ops.make_supports(interpreted=True)
        ok, reason = backend.is_available()
        return {"imported": True, "available": ok, "reason": reason}
    except Exception as exc:  # reported, and the test fails with it
        return {"imported": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        del sys.modules["triton"]


def main() -> None:
    """Print the JSON report on stdout."""
    report: dict = {"without_triton": imports_without_triton()}
    os.environ["TRITON_INTERPRET"] = "1"
    from cuda_sm100_checks import batch_invariance_problems
    from deepinfer_cuda_sm100 import cases
    from deepinfer_cuda_sm100.kernels import _common
    from deepinfer_cuda_sm100.ops import FUSED_OPS, load_ops

    from deepinfer_core.backends import BackendSpec
    from deepinfer_core.testing import check_backend

    report["interpreted"] = _common.INTERPRETED
    spec = BackendSpec(name="cuda_sm100_interpreter", device_type="cpu", ops=load_ops)
    result = check_backend(spec, dtypes=(torch.float32, torch.bfloat16, torch.float16), ops=FUSED_OPS)
    report["cases"] = [
        {"op": r.op, "case": r.label, "status": r.status, "message": r.message, "max_abs_err": r.max_abs_err}
        for r in result.results
    ]
    report["untested"] = result.untested_ops
    report["never_ran"] = result.never_ran
    impls = spec.load_ops()
    report["invariance"] = {
        op: batch_invariance_problems(op, impls[op].fn, cases.SMALL, torch.bfloat16, "cpu")
        for op in FUSED_OPS
    }
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
