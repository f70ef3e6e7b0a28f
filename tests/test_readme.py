"""README accuracy: its Python example runs as written on the built-in tiny model, and every
prompt in it is served (none ends with an error); the quick start's commands run as written
with the installed ``deepinfer`` console script."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs_and_serves_every_prompt():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(b for b in blocks if "from deepinfer_core import LLM" in b)
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    outputs = namespace["outputs"]
    assert len(outputs) == 2
    assert all(o.error is None and o.outputs[0].token_ids for o in outputs), [o.error for o in outputs]
    assert namespace["replies"][0].error is None


def quick_start_commands() -> list[list[str]]:
    """The ``.venv/bin/deepinfer ...`` commands of the README's quick start, as argument lists."""
    section = README.read_text().split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [
        shlex.split(cmd, comments=True)[1:] for cmd in re.findall(r"\.venv/bin/(deepinfer [^&\n]*)", block)
    ]


@pytest.mark.slow  # two fresh interpreters
def test_readme_quick_start_runs_with_the_installed_console_script():
    """What ``bash scripts/setup.sh`` installs serves the quick start, structured outputs included."""
    script = Path(sys.executable).with_name("deepinfer")
    assert script.is_file(), f"no `deepinfer` console script beside {sys.executable}: bash scripts/setup.sh"
    commands = quick_start_commands()
    assert any("--choice" in argv for argv in commands), commands
    for argv in commands:
        done = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (argv, done.stderr)
        choices = [argv[i + 1] for i, a in enumerate(argv) if a == "--choice"]
        if choices:  # a random model, constrained: one of the choices, whatever it samples
            assert done.stdout.removesuffix("\n") in choices, (argv, done.stdout)
