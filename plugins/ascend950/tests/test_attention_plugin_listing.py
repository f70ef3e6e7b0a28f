"""Without an NPU: ``deepinfer plugins`` lists the ascend950 backend's implemented ops (loading
them never imports ``torch_npu``) and says why it is unavailable; selecting it is a one-line
error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from deepinfer_ascend950 import backend, ops_attention

from deepinfer_core.plugins import get_plugins

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def test_the_plugin_listing_names_the_attention_ops_and_why_the_backend_is_unavailable():
    row = next(r for r in get_plugins().report() if r["name"] == "ascend950")
    (listed,) = [b for b in row["backends"] if b["name"] == "ascend950"]
    assert set(ops_attention.OPS) <= set(listed["ops"]) == set(backend.load_ops())
    if not HAS_TORCH_NPU:
        assert listed["available"] is False and listed["reason"] == backend.NOT_INSTALLED


@pytest.mark.slow  # a fresh interpreter
def test_loading_the_ops_does_not_import_torch_npu():
    code = (
        "import sys\nfrom deepinfer_ascend950 import backend\n"
        "backend.load_ops()\nprint('torch_npu' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here: the backend may be selectable")
def test_selecting_the_backend_without_an_npu_is_a_one_line_error():
    cmd = [sys.executable, "-m", "deepinfer_core.cli", "generate", "--backend", "ascend950", "--prompt", "hi"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert (
        "ascend950" in lines[0]
        and "torch_npu is not installed" in lines[0]
        and "Traceback" not in done.stderr
    )
