"""The benchmark scripts still run end to end (small settings, CPU): what they print and write
is what docs/benchmarks.md is built from, so a script that rots is a defect.  The scripts report
figures; these tests judge them: ``gpu_distributed.py --smoke`` runs every part and its eplb
part lowers the measured expert load imbalance.  The outputs' correctness is other tests': the
exactness of DP N + EP N, DP N and CP N tests/distributed/'s, speculative decoding's
tests/speculative/test_spec_engine.py's, the server's tests/test_serve.py's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_core.distributed.gpu_specs import GPUS

pytestmark = pytest.mark.slow  # fresh interpreters running whole benchmarks (~14 s)

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    path = os.pathsep.join([str(ROOT), str(ROOT / "plugins" / "samplers")])
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )


def test_gpu_distributed_smoke_runs_every_part_and_eplb_lowers_the_load(tmp_path: Path) -> None:
    """Every part at ``--world 2`` (given explicitly: the code path of any N), eplb included:
    the skewed mix is rebalanced once, and the measured max/mean expert load after the
    rebalancing is at most the load before it."""
    out = tmp_path / "dist.json"
    script = str(ROOT / "benchmarks" / "gpu_distributed.py")
    proc = _run([script, "--smoke", "--world", "2", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert {e["dist_backend"] for e in data["engines"] if e["world"] > 1} == {"gloo"}  # NCCL: test_nccl.py's
    assert {"decode.1gpu.B2", "decode.dp2ep2.B4", "prefill.1gpu.300", "prefill.cp2.300"} <= rows.keys()
    assert rows["prefill.cp2.300"]["rank0_forwards_with_cp_plan"] > 0
    ranks = rows["decode.dp2ep2.B4"]["per_rank_generated_tokens"]  # rank 0's figures stand for each
    assert len(ranks) == 2 and ranks[0] == ranks[1] > 0
    before, after = rows["eplb.before"], rows["eplb.after"]
    assert before["value"] > 0 and after["value"] > 0 and before["world"] == after["world"] == 2
    assert before["rebalanced_at_check"] and after["placement"] == "rebalanced"
    assert after["rebalances"] >= 1 and before["rebalances"] == 1
    assert 1.0 <= after["max_over_mean_load"] <= before["max_over_mean_load"]
    assert after["predicted_max_over_mean_load"] < before["max_over_mean_load"]
    assert before["engine_steps"][1] < before["load_steps"][1] < after["engine_steps"][0]
    assert "eplb.after" in proc.stdout  # the printed table


def test_gpu_e2e_smoke_measures_every_part_and_decodes_long_contexts_at_a_steady_batch(
    tmp_path: Path,
) -> None:
    """``gpu_e2e.py --smoke --pareto --contexts`` (CPU, tiny widths): every row docs/benchmarks.md
    reports, and each context point decodes with all its requests in the batch, its roofline
    counting the KV bytes of the hand count (7,680 bytes per sequence at 64 tokens)."""
    out = tmp_path / "e2e.json"
    args = ["--smoke", "--pareto", "--contexts", "64,256,1@64,1@1024", "--out", str(out)]
    proc = _run([str(ROOT / "benchmarks" / "gpu_e2e.py"), *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows, bw = {r["name"]: r for r in data["results"]}, data["roofline"]["hbm_bytes_per_s"]
    names = {"ours.decode.B4", "ours.prefill.4x32", "ours.prefill.1x256", "hf.decode.B4", "hf.prefill.1x256"}
    assert names | {"ours.pareto.chunk128.B2", "hf.pareto.B2"} <= rows.keys()
    assert all(r["value"] > 0 for r in rows.values()), [n for n, r in rows.items() if not r["value"]]
    ctx = {n: r for n, r in rows.items() if n.startswith("ours.context.")}
    assert ctx.keys() == {f"ours.context.B{b}.{c}" for b, c in ((2, 64), (2, 256), (1, 64), (1, 1024))}
    for r in ctx.values():
        assert r["decode_method"] == "full-batch steps" and r["preemptions"] == 0
        base = ctx[f"ours.context.B{r['context_batch']}.64"]
        assert r["step_ratio"] == pytest.approx(r["step_ms"] / base["step_ms"])
        step_bytes = [x["context_batch"] * bw / x["roofline_tok_s_bf16"] for x in (r, base)]  # weights + KV
        assert step_bytes[0] - step_bytes[1] == pytest.approx(
            r["kv_read_bytes_per_step"] - base["kv_read_bytes_per_step"]
        )
    assert ctx["ours.context.B2.64"]["kv_read_bytes_per_step"] == 2 * 7680
    assert ctx["ours.context.B1.1024"]["ttft_s"] > 0 and "x base" in proc.stdout
    assert data["roofline"]["gpu"] == "H200 (for cpu)" and bw == GPUS["h200"].hbm_bw


def test_gpu_e2e_decode_stats_take_the_full_batch_steps_mean_and_median() -> None:
    """Four full-batch decode steps of 10, 10, 10 and 50 ms after the last first token: 4 tokens a
    step at batch 4 over 80 ms, a mean step of 20 ms and a median of 10 ms; the host waited 1, 2,
    3 and 4 ms for their tokens: a median of 2.5 ms."""
    from types import SimpleNamespace as NS

    spec = importlib.util.spec_from_file_location("gpu_e2e_stats", ROOT / "benchmarks" / "gpu_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    outs = [NS(metrics=NS(first_token_time=1.0)) for _ in range(4)]
    full = dict(num_seqs=4, num_decode_seqs=4, num_tokens=4, num_generated_tokens=4, num_preempted=0)
    steps = [(1.0, NS(**full, host_wait_s=0.0))]
    times, waits = (1.01, 1.02, 1.03, 1.08), (1e-3, 2e-3, 3e-3, 4e-3)
    steps += [(t, NS(**full, host_wait_s=w)) for t, w in zip(times, waits, strict=True)]
    d = module.decode_stats(outs, steps, batch=4, new_tokens=5)
    assert d["decode_method"] == "full-batch steps" and d["full_batch_steps"] == 4
    assert d["decode_tok_s"] == pytest.approx(16 / 0.08)
    assert d["decode_step_ms_full_batch"] == pytest.approx(20.0)
    assert d["decode_step_ms_median"] == pytest.approx(10.0)
    assert d["host_wait_ms_median"] == pytest.approx(2.5)


@pytest.mark.parametrize(
    "name, preset, kind",
    [
        ("NVIDIA H200", "h200", "H200"),
        ("NVIDIA H100 80GB HBM3", "h800", "H100"),
        ("NVIDIA A100-SXM4-80GB", "h200", None),
    ],
)
def test_gpu_e2e_roofline_takes_the_bandwidth_of_the_gpu_that_runs(monkeypatch, name, preset, kind) -> None:
    """The decode rooflines use the cost model's HBM bandwidth of the GPU's kind (an H100's HBM3 is
    the H800's), and say when a GPU has no preset and the H200's stands in."""
    spec = importlib.util.spec_from_file_location("gpu_e2e_under_test", ROOT / "benchmarks" / "gpu_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.torch.cuda, "get_device_name", lambda *a: name)
    said = []
    monkeypatch.setattr(module, "log", said.append)
    assert module.hbm_bandwidth("cuda") == (GPUS[preset].hbm_bw, kind or f"H200 (for {name})")
    assert bool(said) == (kind is None)


def test_gpu_distributed_rejects_experts_that_do_not_divide_over_the_world(tmp_path: Path) -> None:
    proc = _run([str(ROOT / "benchmarks" / "gpu_distributed.py"), "--smoke", "--world", "3"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: 8 routed experts do not divide over --world 3 ranks (expert parallelism): "
        "give --experts a multiple of 3"
    ], proc.stderr


def test_speculative_benchmark_runs_and_pairs_dspark_with_fixed(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    args = ["--batch-sizes", "2", "--repeats", "2", "--max-tokens", "12", "--out", str(out)]
    proc = _run([str(ROOT / "benchmarks" / "speculative.py"), *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows.keys() == {"none", "fixed", "dspark"}
    paired = rows["dspark"]["vs_fixed_per_run"]
    assert paired["runs"] == 2 and len(paired["ratios"]) == 2 and paired["median"] > 0
    low, high = paired["ci95"]
    assert low <= paired["mean"] <= high and high - low == pytest.approx(2 * 1.96 * paired["sd"] / 2**0.5)


def test_run_batch_benchmark_measures_every_size(tmp_path: Path) -> None:
    """Each size runs in its own interpreter, answers every line and reports its peak RSS."""
    out = tmp_path / "rb.json"
    done = _run([str(ROOT / "benchmarks" / "run_batch.py"), "--sizes", "20,60", "--json", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["size"], r["completed"], r["failed"], r["engine_requests"]) for r in rows] == [
        (20, 20, 0, 20),
        (60, 60, 0, 60),
    ]
    assert all(r["peak_rss_mib"] > 0 and r["generated_tokens"] == 2 * r["size"] for r in rows)


def test_serve_benchmark_streams_every_token(tmp_path: Path) -> None:
    """``deepinfer bench serve`` on tiny settings: a real server subprocess streams B x max_tokens
    tokens (EOS ignored), and each path reports its throughput, TTFT and ITL."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    out = tmp_path / "serve.json"
    args = ["--batches", "1,3", "--prompt-len", "8", "--max-tokens", "5", "--json", str(out)]
    proc = _run(["-m", "deepinfer_core.cli", "bench", "serve", *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["path"], r["batch"]): r for r in json.loads(out.read_text())["results"]}
    assert rows.keys() == {(p, b) for p in ("server", "LLM.generate") for b in (1, 3)}
    for (_, b), r in rows.items():
        assert r["output_tokens"] == 5 * b
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p90_ms"]
    assert all(0 < rows["server", b]["chunks"] <= 5 * b for b in (1, 3))
    assert rows["LLM.generate", 3]["vs_llm_generate"] == 1.0
    assert "vs_llm_generate" in proc.stdout  # the printed table


def test_a_benchmark_given_a_missing_model_says_so_in_one_line(tmp_path):
    missing = tmp_path / "no_such_model"
    out = _run([str(ROOT / "benchmarks" / "cpu_tiny.py"), "--model", str(missing)], tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(missing) in lines[0]


def test_scheduler_cost_times_full_decode_batches(tmp_path: Path) -> None:
    """Every timed step schedules the whole batch, one token each (the script refuses any other
    step); per-request time is the step's total over the batch."""
    out = tmp_path / "sched.json"
    args = ["--batch-sizes", "1,8", "--prompt-len", "64", "--steps", "5", "--repeats", "2", "--out", str(out)]
    proc = _run([str(ROOT / "benchmarks" / "scheduler_cost.py"), *args], tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in rows] == [1, 8]
    for r in rows:
        assert r["schedule_ms"] > 0 and r["complete_ms"] > 0
        assert r["total_ms"] == pytest.approx(r["schedule_ms"] + r["complete_ms"])
        assert r["us_per_request"] == pytest.approx(1e3 * r["total_ms"] / r["batch"])
