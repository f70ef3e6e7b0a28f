"""``scripts/bench_attention.py``'s roofline (``scripts/attention_inputs.py``): the HBM bandwidth of
the GPU that runs (its preset), so a figure measured on an H100 is a share of the H100's bound,
not the H200's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_core.distributed.gpu_specs import GPUS

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_attention_under_test", SCRIPTS / "bench_attention.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.mark.parametrize("name, preset", [("NVIDIA H100 80GB HBM3", "h800"), ("NVIDIA H200", "h200")])
def test_the_roofline_takes_the_running_gpus_bandwidth(bench, monkeypatch, name, preset):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    peak, _ = bench.device_peak_bytes()
    assert peak == GPUS[preset].hbm_bw
    gigabyte = 1e9  # a byte-bound call: its bound is bytes / bandwidth, in ms
    assert bench.roofline_ms(gigabyte, 0.0, peak) == pytest.approx(1e3 * gigabyte / peak)


def test_a_gpu_without_a_preset_is_measured_against_the_h200_and_says_so(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    peak, kind = bench.device_peak_bytes()
    assert peak == GPUS["h200"].hbm_bw and kind.startswith("H200 (for NVIDIA A100")
    assert "no preset" in capsys.readouterr().out


def test_flops_bound_calls_take_the_matrix_rate(bench):
    """A call with more FLOPs than bytes can feed is bound by the bf16 matrix rate."""
    assert bench.roofline_ms(1.0, bench.PEAK_FLOPS, 3e12) == pytest.approx(1e3)
