"""The failure log of the repository's ``conftest.py`` (``DEEPINFER_TEST_FAILURE_LOG``): each
failing test's report is appended as it fails, a passing test leaves no line, and a log in a
folder that does not exist is refused before any test runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BODY = """
def test_passes():
    pass


def test_fails():
    value = 41
    assert value == 42, "the answer is off by one"
"""


def _pytest(tmp_path: Path, log: Path) -> subprocess.CompletedProcess:
    test = tmp_path / "test_logged.py"
    test.write_text(BODY)
    env = {**os.environ, "DEEPINFER_TEST_FAILURE_LOG": str(log), "PYTHONPATH": str(ROOT)}
    env.pop("DEEPINFER_TEST_TIMEOUT_S", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", str(test)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_failure_is_logged_with_its_reason_and_a_pass_is_not(tmp_path):
    log = tmp_path / "failures.txt"
    done = _pytest(tmp_path, log)
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout[-2000:]
    text = log.read_text()
    assert "FAILED test_logged.py::test_fails (call)" in text, text
    assert "the answer is off by one" in text and "test_passes" not in text, text


def test_a_log_in_a_missing_folder_is_refused_before_any_test_runs(tmp_path):
    done = _pytest(tmp_path, tmp_path / "absent" / "failures.txt")
    out = done.stdout + done.stderr
    assert done.returncode == 4, out[-2000:]  # pytest's usage error
    assert "DEEPINFER_TEST_FAILURE_LOG=" in out and "does not exist" in out, out[-2000:]
    assert "test_fails" not in done.stdout, out[-2000:]
