"""Repository-wide pytest hooks (``tests/`` and every plugin's tests).

Tests marked ``gpu`` need a CUDA GPU that the ``cuda_sm100`` backend can run on, with its
kernels compiled (not in Triton's CPU interpreter).  Where that is missing they are skipped
with the reason; ``bash scripts/test_gpu.sh`` runs exactly them (docs/testing.md).
"""

from __future__ import annotations

import os

import pytest


def gpu_unavailable_reason() -> str | None:
    """``None`` where the ``gpu`` tests can run here, else why not."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: the kernels would run in Triton's CPU interpreter"
    from deepinfer_core.testing import backend_unavailable_reason

    return backend_unavailable_reason("cuda_sm100")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``gpu`` tests, naming the reason, where no GPU backend runs."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)
