"""README accuracy: its Python example runs as written on the built-in tiny model, and every
prompt in it is served (none ends with an error)."""

from __future__ import annotations

import re
from pathlib import Path

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
