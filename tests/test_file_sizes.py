"""Source modules stay small: no module of the core or of a plugin's package over
:data:`MAX_LINES` lines, so that each keeps one job.

Checked: every ``.py`` file under ``deepinfer_core/`` and under each plugin's package and
scripts (``plugins/*/``, its ``tests/`` excepted: a test module follows the area it tests).
Not checked: the GPU kernel modules (:data:`KERNEL_DIRS`), where one kernel with its launch
code and its tuning tables is one job however long.  What is still over the limit is listed
in :data:`EXEMPT` with its reason; an entry that no longer needs its exemption fails the test,
so the list only shrinks.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450

KERNEL_DIRS = (
    "plugins/cuda_sm100/deepinfer_cuda_sm100/kernels/",  # Triton kernels
    "plugins/cuda_sm100/deepinfer_cuda_sm100/tl/",  # TileLang kernels
)

EXEMPT: dict[str, str] = {}


def _checked() -> list[Path]:
    files = list((ROOT / "deepinfer_core").rglob("*.py"))
    for plugin in (ROOT / "plugins").iterdir():
        if plugin.is_dir():
            files += [p for p in plugin.rglob("*.py") if "tests" not in p.relative_to(plugin).parts]
    out = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if "__pycache__" not in path.parts and not rel.startswith(KERNEL_DIRS):
            out.append(path)
    return sorted(out)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_source_module_is_over_the_limit():
    over = {p.relative_to(ROOT).as_posix(): n for p in _checked() if (n := _lines(p)) > MAX_LINES}
    new = sorted(f"{rel} ({n} lines)" for rel, n in over.items() if rel not in EXEMPT)
    assert not new, (
        f"modules over {MAX_LINES} lines: split each by job (see docs/architecture.md, module map): {new}"
    )


def test_every_exemption_is_still_needed():
    stale = sorted(rel for rel in EXEMPT if not (ROOT / rel).exists() or _lines(ROOT / rel) <= MAX_LINES)
    assert not stale, (
        f"remove from EXEMPT in tests/test_file_sizes.py (now within {MAX_LINES} lines): {stale}"
    )


def test_the_scan_covers_the_packages_and_skips_kernels_and_tests():
    checked = {p.relative_to(ROOT).as_posix() for p in _checked()}
    assert "deepinfer_core/engine/scheduler.py" in checked
    assert "plugins/cuda_sm100/deepinfer_cuda_sm100/attention_ops.py" in checked
    assert "plugins/samplers/deepinfer_samplers/xgrammar_backend.py" in checked
    assert not any(c.startswith(KERNEL_DIRS) for c in checked)
    assert not any("/tests/" in c for c in checked)
