"""The test watchdog of the repository's ``conftest.py`` (``DEEPINFER_TEST_TIMEOUT_S``, which
``scripts/test_gpu.sh`` sets): a hung test ends its process with a stack dump instead of
holding the run; a quick test is untouched; a bad value is refused before any test runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, body: str, timeout: str) -> tuple[subprocess.CompletedProcess, float]:
    test = tmp_path / "test_watched.py"
    test.write_text(body)
    env = {**os.environ, "DEEPINFER_TEST_TIMEOUT_S": timeout, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", str(test)]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - start


def test_a_hung_test_ends_its_process_with_a_stack_dump(tmp_path):
    body = "import time\n\n\ndef test_hangs():\n    time.sleep(600)\n"
    done, elapsed = _pytest(tmp_path, body, "1")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and elapsed < 60, (done.returncode, elapsed)
    assert "Timeout (0:00:01)!" in out and "test_hangs" in out, out[-2000:]


def test_a_quick_test_passes_under_the_watchdog(tmp_path):
    body = "import time\n\n\ndef test_quick():\n    time.sleep(0.2)\n\n\ndef test_quick_too():\n    pass\n"
    done, _ = _pytest(tmp_path, body, "30")
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_bad_limit_is_refused_before_any_test_runs(tmp_path):
    body = "def test_never():\n    raise AssertionError('ran')\n"
    done, _ = _pytest(tmp_path, body, "soon")
    out = done.stdout + done.stderr
    assert done.returncode == 4, out[-2000:]  # pytest's usage error
    assert "DEEPINFER_TEST_TIMEOUT_S='soon'" in out and "ran" not in done.stdout, out[-2000:]
