"""``scripts/count_launches.py``: a decode step's launches on the ``cuda_sm100`` table, counted
on a CPU through Triton's interpreter.

Run on the built-in tiny model (4 layers) twice, with the fused ops and with them left to their
decompositions: the fusions save exactly what their kernels promise, per layer ``L``: 3 of the
4 launches of ``qk_norm_rope``'s parts, for ``hc_post_pre`` 2 of 4 at every transition after a
block and 1 of 3 at the first (``2 * (2L - 1) + 1``), and 1 of ``hc_head_norm``'s 3; nothing else
changes.  With the blocks' chains on two streams (the default, as on a GPU) the step has one more
launch a layer and fewer on its critical path than on one stream (``--one-stream``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: pip install -e 'plugins/cuda_sm100[test]'")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "count_launches.py"
REPO = SCRIPT.parents[3]


def _count(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"launches{len(args)}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(SCRIPT.parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "launches" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_fused_ops_save_the_launches_of_their_parts(tmp_path):
    fused = _count(tmp_path)
    apart = _count(tmp_path, "--decompose", "hc_post_pre,qk_norm_rope,hc_head_norm")
    layers = fused["layers"]
    assert apart["decomposed"] == ["hc_head_norm", "hc_post_pre", "qk_norm_rope"] and not fused["decomposed"]
    saved = 3 * layers + 2 * (2 * layers - 1) + 1 + 1
    assert apart["launches_per_step"] - fused["launches_per_step"] == saved
    assert fused["torch_operators"] == apart["torch_operators"]  # only kernel launches changed
    assert fused["triton_by_kernel"]["_qk_norm_rope_kernel"] == layers
    assert fused["triton_by_kernel"]["_hc_post_mix_kernel"] == 2 * layers - 1
    assert "_qk_norm_rope_kernel" not in apart["triton_by_kernel"]
    # the blocks' chains on two streams: one more launch a MoE layer (routed + shared added after
    # the join, not in the MoE's combine); on one stream every launch is on the critical path
    one = _count(tmp_path, "--one-stream")
    assert fused["launches_per_step"] == one["launches_per_step"] + layers
    assert one["critical_path_launches"] == one["launches_per_step"] and one["branches"] == 0
    assert fused["branches"] >= 2 * layers  # the shared expert and the ring write, every layer
    assert fused["critical_path_launches"] < one["launches_per_step"]


def test_an_unknown_fused_op_is_refused_with_the_known_ones(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(SCRIPT.parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--decompose", "rms_norm", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode != 0
    assert "['rms_norm'] are not fused ops" in done.stderr and "hc_post_pre" in done.stderr
    assert "Traceback" not in done.stderr
