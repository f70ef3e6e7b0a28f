"""docs/architecture.md's module map names every module of the core and every benchmark script."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_is_in_the_module_map():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Module map") :]
    named = set(re.findall(r"`([\w/.]+\.py)`", section))
    modules = sorted(
        p.relative_to(ROOT).as_posix()
        for p in [*(ROOT / "deepinfer_core").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    )
    missing = [m for m in modules if m not in named]
    assert not missing, f"add a row for each to the module map of docs/architecture.md: {missing}"
