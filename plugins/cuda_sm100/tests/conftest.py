"""Fixtures the ``cuda_sm100`` kernel tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def report(request: pytest.FixtureRequest) -> dict:
    """The interpreter report of the requesting test module: the module run with
    ``--interpreter-report`` in a fresh interpreter with ``TRITON_INTERPRET=1``
    (:func:`cuda_sm100_checks.interpreter_report`), once per module."""
    from cuda_sm100_checks import interpreter_report

    return interpreter_report(Path(request.module.__file__).resolve())
