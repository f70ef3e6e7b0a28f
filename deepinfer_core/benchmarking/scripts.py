"""``deepinfer bench NAME [ARGS...]``: the benchmark scripts of ``benchmarks/`` by name.

The scripts ship with the source tree (``benchmarks/`` beside ``deepinfer_core/``), so an
editable install or a checkout reaches them; a wheel without them gets one line saying so.
``deepinfer bench`` with no name (or ``deepinfer bench throughput``) is the offline
throughput / latency command of :mod:`deepinfer_core.bench`.
"""

from __future__ import annotations

import ast
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from deepinfer_core.errors import ConfigError

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
SOURCE_ONLY = "the benchmark scripts come with the source tree (install from a checkout: pip install -e .)"


def scripts() -> dict[str, Path]:
    """``deepinfer bench`` name -> script: each ``benchmarks/*.py`` but the ``_`` modules, named
    by its stem with dashes (``cpu_tiny.py``: ``cpu-tiny``)."""
    return {p.stem.replace("_", "-"): p for p in sorted(BENCHMARKS_DIR.glob("[!_]*.py"))}


def names_help() -> str:
    """The benchmark names, each with its script's docstring's first line (``deepinfer bench --help``)."""
    if not (found := scripts()):
        return f"benchmarks: none here; {SOURCE_ONLY}"
    width, lines = max(map(len, found)), []
    for name, path in found.items():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        lines.append(f"  {name:<{width}}  " + doc.partition("\n")[0].replace("``", ""))
    return "benchmarks (deepinfer bench NAME --help for each one's flags):\n" + "\n".join(lines)


def run_script(name: str, argv: Sequence[str]) -> int:
    """Run the benchmark ``name`` with ``argv`` as its command line; its exit status."""
    found = scripts()
    if (script := found.get(name)) is None:
        known = f"the benchmarks: {', '.join(found)}" if found else SOURCE_ONLY
        raise ConfigError(f"deepinfer bench {name}: no benchmark of that name; {known}")
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
