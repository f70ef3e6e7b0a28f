"""The test harness of the repository's ``conftest.py``, each run in a fresh pytest:

* the watchdog (``DEEPINFER_TEST_TIMEOUT_S``, which ``scripts/test_gpu.sh`` sets): a hung test
  ends its process with a stack dump instead of holding the run; a quick test is untouched; a
  bad value is refused before any test runs;
* the failure log (``DEEPINFER_TEST_FAILURE_LOG``): each failing test's report is appended as
  it fails, a passing test leaves no line, and a log in a folder that does not exist is
  refused before any test runs;
* the duration log (``DEEPINFER_TEST_DURATION_LOG``): each test's seconds, outcome and node id
  are appended as it ends;
* the shards (``DEEPINFER_TEST_SHARD``): the shards of a run together run each test once, and
  a malformed share is refused before any test runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGGED = """
def test_passes():
    pass


def test_fails():
    value = 41
    assert value == 42, "the answer is off by one"
"""


def _pytest(tmp_path: Path, body: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """``body`` as a test module run by a fresh pytest (extra arguments ``args``) with the
    repository's ``conftest.py`` and only the harness variables ``env`` set; its result and its
    seconds."""
    test = tmp_path / "test_harnessed.py"
    test.write_text(body)
    base = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "DEEPINFER_TEST_TIMEOUT_S",
            "DEEPINFER_TEST_FAILURE_LOG",
            "DEEPINFER_TEST_DURATION_LOG",
            "DEEPINFER_TEST_SHARD",
        )
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", *args, str(test)]
    start = time.monotonic()
    done = subprocess.run(
        cmd,
        cwd=tmp_path,
        env={**base, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - start


def test_a_hung_test_ends_its_process_with_a_stack_dump(tmp_path):
    body = "import time\n\n\ndef test_hangs():\n    time.sleep(600)\n"
    done, elapsed = _pytest(tmp_path, body, DEEPINFER_TEST_TIMEOUT_S="1")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and elapsed < 60, (done.returncode, elapsed)
    assert "Timeout (0:00:01)!" in out and "test_hangs" in out, out[-2000:]


def test_a_quick_test_passes_under_the_watchdog(tmp_path):
    body = "import time\n\n\ndef test_quick():\n    time.sleep(0.2)\n\n\ndef test_quick_too():\n    pass\n"
    done, _ = _pytest(tmp_path, body, DEEPINFER_TEST_TIMEOUT_S="30")
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_bad_limit_is_refused_before_any_test_runs(tmp_path):
    body = "def test_never():\n    raise AssertionError('ran')\n"
    done, _ = _pytest(tmp_path, body, DEEPINFER_TEST_TIMEOUT_S="soon")
    out = done.stdout + done.stderr
    assert done.returncode == 4, out[-2000:]  # pytest's usage error
    assert "DEEPINFER_TEST_TIMEOUT_S='soon'" in out and "ran" not in done.stdout, out[-2000:]


def test_a_failure_is_logged_with_its_reason_and_a_pass_is_not(tmp_path):
    log = tmp_path / "failures.txt"
    done, _ = _pytest(tmp_path, LOGGED, DEEPINFER_TEST_FAILURE_LOG=str(log))
    assert done.returncode == 1 and "1 failed, 1 passed" in done.stdout, done.stdout[-2000:]
    text = log.read_text()
    assert "FAILED test_harnessed.py::test_fails (call)" in text, text
    assert "the answer is off by one" in text and "test_passes" not in text, text


def test_a_log_in_a_missing_folder_is_refused_before_any_test_runs(tmp_path):
    done, _ = _pytest(tmp_path, LOGGED, DEEPINFER_TEST_FAILURE_LOG=str(tmp_path / "absent" / "failures.txt"))
    out = done.stdout + done.stderr
    assert done.returncode == 4, out[-2000:]  # pytest's usage error
    assert "DEEPINFER_TEST_FAILURE_LOG=" in out and "does not exist" in out, out[-2000:]
    assert "test_fails" not in done.stdout, out[-2000:]


def test_each_test_s_seconds_and_outcome_are_logged_as_it_ends(tmp_path):
    log = tmp_path / "durations.txt"
    body = LOGGED + "\n\ndef test_sleeps():\n    import time\n\n    time.sleep(0.3)\n"
    body += "\n\nimport pytest\n\n\n@pytest.mark.skip(reason='off')\ndef test_skipped():\n    pass\n"
    done, _ = _pytest(tmp_path, body, DEEPINFER_TEST_DURATION_LOG=str(log))
    assert done.returncode == 1 and "1 failed, 2 passed, 1 skipped" in done.stdout, done.stdout[-2000:]
    rows = {line.split("\t")[2]: line.split("\t")[:2] for line in log.read_text().splitlines()}
    names = ("test_passes", "test_fails", "test_sleeps", "test_skipped")
    assert set(rows) == {f"test_harnessed.py::{name}" for name in names}, rows
    outcomes = {name: rows[f"test_harnessed.py::{name}"][1] for name in names}
    assert outcomes == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_sleeps": "passed",
        "test_skipped": "skipped",
    }
    assert 0.3 <= float(rows["test_harnessed.py::test_sleeps"][0]) < 30, rows


SHARDED = "".join(f"\n\ndef test_{i}():\n    pass\n" for i in range(5))


def test_the_shards_of_a_run_run_each_test_once(tmp_path):
    ran = []
    for k, want in ((1, 3), (2, 2)):
        done, _ = _pytest(tmp_path, SHARDED, "-rA", DEEPINFER_TEST_SHARD=f"{k}/2")  # a line a passed test
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-2000:]
        assert f"{want} passed, {5 - want} deselected" in done.stdout, out[-2000:]
        ran += [line.split("::")[1] for line in done.stdout.splitlines() if line.startswith("PASSED ")]
    assert sorted(ran) == [f"test_{i}" for i in range(5)], ran


def test_a_malformed_shard_is_refused_before_any_test_runs(tmp_path):
    for value in ("3/2", "0/2", "half"):
        done, _ = _pytest(tmp_path, LOGGED, DEEPINFER_TEST_SHARD=value)
        out = done.stdout + done.stderr
        assert done.returncode == 4, (value, out[-2000:])  # pytest's usage error
        assert f"DEEPINFER_TEST_SHARD={value!r}" in out and "test_fails" not in done.stdout, out[-2000:]
