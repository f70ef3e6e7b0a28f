"""Repository-wide pytest hooks (``tests/`` and every plugin's tests).

Tests marked ``gpu`` need a CUDA GPU that the ``cuda_sm100`` backend can run on, with its
kernels compiled (not in Triton's CPU interpreter).  Where that is missing they are skipped
with the reason; ``bash scripts/test_gpu.sh`` runs exactly them (docs/testing.md).  Tests marked
``npu`` need an Ascend NPU that the ``ascend950`` backend runs on (the real ``torch_npu``);
elsewhere they are skipped with the reason; ``bash scripts/test_npu.sh`` runs exactly them.
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


def npu_unavailable_reason() -> str | None:
    """``None`` where the ``npu`` tests can run here, else why not (the ``ascend950`` probe)."""
    from deepinfer_core.testing import backend_unavailable_reason

    return backend_unavailable_reason("ascend950")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the ``gpu`` and ``npu`` tests, naming the reason, where their backend does not run."""
    _skip_marked(items, "npu", npu_unavailable_reason)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


def _skip_marked(items: list[pytest.Item], marker: str, unavailable) -> None:
    """Skip the items marked ``marker`` when ``unavailable()`` gives a reason."""
    marked = [item for item in items if item.get_closest_marker(marker) is not None]
    reason = unavailable() if marked else None
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"{marker} test: {reason}")
    for item in marked:
        item.add_marker(skip)
