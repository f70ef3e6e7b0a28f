"""``deepinfer bench npu-decode`` refuses cleanly where no Ascend NPU is usable."""

from __future__ import annotations

import importlib.util

import pytest

from deepinfer_core.benchmarking.scripts import scripts
from deepinfer_core.cli import main

HAS_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.mark.skipif(HAS_NPU, reason="torch_npu is installed: the benchmark may run here")
def test_without_an_npu_the_benchmark_says_why_in_one_line_and_exits_2(capsys, tmp_path):
    assert "npu-decode" in scripts()
    code = main(["bench", "npu-decode", "--model", str(tmp_path), "--output", str(tmp_path / "o.json")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no usable Ascend NPU" in err and "torch_npu is not installed" in err
    assert not (tmp_path / "o.json").exists()
