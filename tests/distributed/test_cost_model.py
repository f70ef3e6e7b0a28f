"""Identities of the distributed cost model (:mod:`deepinfer_core.distributed.cost_model`) and of
the V4-Flash shape its tables use (``benchmarks/distributed_cost_model.py``)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from deepinfer_core.distributed import cost_model as cm
from deepinfer_core.distributed import gpu_specs

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


tables = _load("distributed_cost_model")


@pytest.fixture(scope="module")
def flash():
    return tables.v4_flash()


def test_v4_flash_size(flash):
    # 284B total (with the 0.5B embedding) / 13B active
    assert flash.total_params + 129280 * 4096 == pytest.approx(284.3e9, rel=2e-3)
    assert flash.active_params == pytest.approx(13.23e9, rel=2e-3)


def test_shape_matches_parameter_inventory():
    """The torch-free counts equal those of ``_gpu_model.param_counts`` (the parameter specs)."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    gm = _load("_gpu_model")
    from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config

    for layers, experts in ((4, 64), (43, 256)):
        cfg = DeepseekV4Config.from_dict(tables.flash_config_dict(layers, experts), source="test")
        counts = gm.param_counts(cfg)
        shape = cm.v4_shape(cfg, "x")
        tid2eid = 3 * cfg.vocab_size * cfg.num_experts_per_tok  # hash layers' int tables, not weights
        assert shape.total_params + counts["embedding"] + tid2eid == counts["total"]
        assert shape.moe_layers * shape.n_experts * shape.expert_params == counts["routed_experts"]
        assert shape.active_params == counts["active_per_token"]


def test_expert_bytes_fall_as_one_over_ep(flash):
    """Every expert touched (large batch, uniform routing): expert bytes per GPU x EP is constant."""
    gpu = gpu_specs.GPUS["h200"]
    per = []
    for ep in (1, 2, 4, 8, 16, 32, 64):
        r = cm.step(flash, gpu, cm.deployment(ep), tokens=4096, ctx=4096)
        assert r["experts"]["touched_busiest"] == pytest.approx(256 / ep, rel=1e-9)
        per.append(r["bytes"]["expert_weights"] * ep)
    assert max(per) == pytest.approx(min(per), rel=1e-9)
    # and the dense bytes are replicated: the same on every world size
    dense = [cm.step(flash, gpu, cm.deployment(w), tokens=64, ctx=4096)["bytes"] for w in (1, 8)]
    assert dense[0]["dense_weights"] == dense[1]["dense_weights"]


def test_distinct_experts_monte_carlo():
    rng = random.Random(1)
    for E, k, T in ((64, 6, 1), (64, 6, 16), (256, 6, 64), (256, 8, 20)):
        trials = 400
        mc = sum(len({e for _ in range(T) for e in rng.sample(range(E), k)}) for _ in range(trials)) / trials
        assert cm.expected_distinct(E, k, T) == pytest.approx(mc, rel=0.02)


def test_prob_any_monte_carlo():
    rng = random.Random(2)
    E, k, held = 256, 6, 32  # one node of EP64 (8 GPUs x 4 experts)
    trials = 20000
    hits = sum(any(e < held for e in rng.sample(range(E), k)) for _ in range(trials)) / trials
    assert cm.prob_any(E, k, held) == pytest.approx(hits, abs=0.01)
    assert cm.prob_any(E, k, E) == 1.0


def test_dispatch_bytes_uniform(flash):
    """ll dispatch: tokens x top-k x hidden x bytes x (1 - 1/EP); combine the same rows in bf16."""
    gpu = gpu_specs.GPUS["h200"]
    T, k, D = 128, flash.top_k, flash.hidden
    for ep in (2, 8, 16, 64):
        net = cm.a2a_bytes(flash, cm.Deployment(world=ep, ep=ep), gpu, T, T * k)
        expect = T * k * D * (1 + 4 / 128) * (1 - 1 / ep)
        assert net["nvlink_dispatch"] + net["ib_dispatch"] == pytest.approx(expect)
        assert net["nvlink"] + net["ib"] == pytest.approx(expect + T * k * D * 2 * (1 - 1 / ep))
        g = min(8, ep)
        assert net["ib_dispatch"] == pytest.approx(T * k * D * (1 + 4 / 128) * (ep - g) / ep)
        # node-deduplicated (DeepEP normal) kernels never send more over InfiniBand
        nrm = cm.a2a_bytes(flash, cm.Deployment(world=ep, ep=ep, dispatch="normal"), gpu, T, T * k)
        assert nrm["ib"] <= net["ib"] + 1e-9
    assert cm.a2a_bytes(flash, cm.Deployment(world=1, ep=1), gpu, T, T * k)["nvlink"] == 0.0


def test_mean_attended_matches_average(flash):
    for layer in {la for la in flash.layers}:
        for L in (50, 128, 700, 3000):
            brute = [cm.attended(layer, t) for t in range(1, L + 1)]
            keys = sum(b[0] for b in brute) / L
            scored = sum(b[1] for b in brute) / L
            got = cm.mean_attended(layer, L)
            assert got[0] == pytest.approx(keys, rel=0.02, abs=1.0)
            assert got[1] == pytest.approx(scored, rel=0.02, abs=1.0)


def test_eplb_lowers_imbalance(flash):
    skew = cm.Routing(zipf=0.3, eplb=False)
    bal = cm.Routing(zipf=0.3, eplb=True)
    for ep in (8, 32, 64):
        a = cm.expert_load(flash, skew, ep, 64 * ep)
        b = cm.expert_load(flash, bal, ep, 64 * ep)
        assert b["imbalance"] < a["imbalance"]
    uni = cm.expert_load(flash, cm.Routing(), 8, 10**7)  # huge batch: only the sqrt spread is left
    assert uni["imbalance"] == pytest.approx(1.0, abs=0.01)


def test_time_bounds(flash):
    gpu = gpu_specs.GPUS["h200"]
    for w, b in ((1, 64), (8, 256), (64, 1024)):
        r = cm.step(flash, gpu, cm.deployment(w), tokens=b, ctx=4096)
        t = r["time"]
        assert t["max"] <= t["sum"]
        assert t["max"] == pytest.approx(max(t["hbm"], t["compute"], t["network"]) + t["overhead"])
        assert r["tok_s_per_gpu_max"] == pytest.approx(b / t["max"])


@pytest.mark.parametrize(
    "name, preset, kind",
    [
        ("NVIDIA H200", "h200", "H200"),
        ("NVIDIA H100 80GB HBM3", "h800", "H100"),
        ("NVIDIA H800", "h800", "H800"),
        ("NVIDIA A100-SXM4-80GB", "h200", None),
    ],
)
def test_device_hbm_bandwidth_is_the_preset_of_the_named_gpu(name, preset, kind):
    """A CUDA device name maps to its kind's preset (an H100's HBM3 is the H800's); another GPU
    gets the H200's figure and a kind that says it stands in."""
    bandwidth, got_kind, known = gpu_specs.device_hbm_bandwidth(name)
    assert bandwidth == gpu_specs.GPUS[preset].hbm_bw
    assert known == (kind is not None)
    assert got_kind == (kind or f"H200 (for {name})")
