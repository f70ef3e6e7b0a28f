"""``scripts/profile_step.py``: a decode step's time by kind of kernel (here: CPU operators).

The kinds are a partition (every name gets exactly one, the shares add up to the total) and
the names of the backend's own kernels land where the script says; a profiled run of the
built-in tiny model reports steps whose operators' own time fits in the step's wall time.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_step.py"


def _module():
    spec = importlib.util.spec_from_file_location("profile_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sparse_attention_decode_fp8_kernel", "attention"),
        ("_gate_up_kernel", "moe"),
        ("moe_topk_gate_forward", "moe"),
        ("_indexer_topk_select", "indexer"),
        ("_compress_windows_kernel", "compressor"),
        ("_compress_entries_kernel", "compressor"),
        ("_fp8_gemm_decode_kernel", "fp8 gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "dense gemm"),
        ("aten::mm", "dense gemm"),
        ("_hc_pre_kernel", "mhc / norm / rope"),
        ("void at::native::vectorized_elementwise_kernel<4>", "torch (reference ops)"),
        ("something_else", "other"),
    ],
)
def test_kernel_names_fall_in_their_kind(name, kind):
    assert _module().kind_of(name) == kind


@pytest.mark.parametrize(
    "intervals, length",
    [
        ([], 0.0),
        ([(0, 2), (5, 6)], 3.0),  # apart: both
        ([(0, 4), (3, 6)], 6.0),  # overlapping (a kernel started early, waiting inside)
        ([(3, 6), (0, 10), (12, 13)], 11.0),  # nested, unsorted
        ([(0, 2), (2, 3)], 3.0),  # touching
    ],
)
def test_active_time_counts_overlapping_kernels_once(intervals, length):
    assert _module().union_length(intervals) == pytest.approx(length)


def test_idle_gaps_charge_each_idle_interval_to_the_kernels_around_it():
    """Two steps of three kernels on two streams: an idle interval is charged to the activity
    that finished last before it and the one that starts after it; the idle time per step
    adds up to the span less the active time (the union of the intervals)."""
    mod = _module()
    step = [(0, 10, "7", "a"), (2, 14, "9", "side"), (16, 20, "7", "b"), (23, 30, "7", "c")]
    events = step + [(t0 + 100, t1 + 100, s, n) for t0, t1, s, n in step]
    gaps = mod.idle_gaps(events, steps=2)
    by_pair = {(g["after"], g["before"]): g for g in gaps}
    assert by_pair[("9:side", "7:b")]["us_per_step"] == pytest.approx(2)  # the side stream ended last
    assert by_pair[("7:b", "7:c")]["us_per_step"] == pytest.approx(3)
    between_steps = {"after": "7:c", "before": "7:a", "us_per_step": 35, "gaps_per_step": 0.5}
    assert by_pair[("7:c", "7:a")] == between_steps
    assert [g["us_per_step"] for g in gaps] == sorted((g["us_per_step"] for g in gaps), reverse=True)
    span = events[-1][1] - events[0][0]
    idle = sum(g["us_per_step"] * 2 for g in gaps)
    assert idle == pytest.approx(span - mod.union_length([(a, b) for a, b, _, _ in events]))


def test_the_steady_period_leaves_out_a_first_step_that_starts_behind():
    """Four steps of a once-a-step kernel ``a`` then ``b`` (twice a step) on two streams, the
    first step 300 us late: the period is the median interval between ``a``'s starts (100 us,
    not the mean over the late start), with the active time in that interval; no period with
    fewer than three steps or without a once-a-step kernel."""
    mod = _module()
    step = [(0, 20, "7", "a"), (25, 50, "7", "b"), (30, 60, "9", "side"), (70, 90, "7", "b")]
    starts = (0, 400, 500, 600)  # the first step, then three 100 us later each
    events = sorted((t0 + s, t1 + s, st, n) for s in starts for t0, t1, st, n in step)
    steady = mod.steady_period(events, steps=4)
    assert steady["kernel"] == "a"
    assert steady["period_ms"] == pytest.approx(0.1)
    assert steady["active_ms"] == pytest.approx(0.075)  # 0-20, 25-60, 70-90 of each 100 us
    assert steady["idle_ms"] == pytest.approx(0.025)
    assert mod.steady_period(events[: len(step) * 2], steps=2) is None
    assert mod.steady_period([(t0, t1, st, "b") for t0, t1, st, _ in events], steps=4) is None


@pytest.mark.slow
def test_a_profiled_cpu_decode_step_is_accounted_for(tmp_path):
    out = tmp_path / "p.json"
    report = _module().main(["--steps", "2", "--batch", "2", "--prompt-len", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["steps"] == 2 and report["wall_ms_per_step"] > 0
    kinds = report["ms_by_kind"]
    assert sum(kinds.values()) == pytest.approx(report["busy_ms_per_step"])
    assert 0 < report["busy_ms_per_step"] <= report["wall_ms_per_step"] * 1.05
    assert kinds.get("dense gemm", 0) > 0  # the tiny model's projections run as matmuls


def test_a_prefill_unit_runs_fresh_prompts_in_one_chunk():
    """``--prefill``: each unit admits ``--batch`` prompts of that many tokens, none served from
    the prefix cache, all run through the model in one step of ``batch x prefill`` tokens, and
    each samples its first token."""
    mod = _module()  # (puts the scripts' folder on the path)
    from profile_workloads import prefill_engine

    a = mod.parse_args(["--prefill", "24", "--batch", "2", "--warmup", "1"])
    llm, prefill = prefill_engine(a)
    try:
        engine = llm.engine
        tokens_per_step = []
        step = engine.step

        def counted_step():
            scheduled = engine.metrics.num_scheduled_tokens
            out = step()
            tokens_per_step.append(engine.metrics.num_scheduled_tokens - scheduled)
            return out

        engine.step = counted_step
        before = engine.get_metrics()
        prefill()
        after = engine.get_metrics()
        assert after["num_finished_requests"] - before["num_finished_requests"] == 2
        assert after["num_prefix_hit_tokens"] == 0  # warm-up included: every prompt is computed
        assert after["num_generated_tokens"] - before["num_generated_tokens"] == 2
        assert [n for n in tokens_per_step if n] == [2 * 24]  # one chunk of both prompts
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_profiled_cpu_prefill_is_accounted_for(tmp_path):
    report = _module().main(
        ["--prefill", "16", "--batch", "2", "--steps", "2", "--out", str(tmp_path / "p.json")]
    )
    assert report["unit"] == "prefill of 2 x 16 tokens" and report["prefill"] == 16
    assert 0 < report["busy_ms_per_step"] <= report["wall_ms_per_step"] * 1.05


def test_a_negative_prefill_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as e:
        _module().parse_args(["--prefill", "-8"])
    assert e.value.code == 2
    assert "--prefill -8: give a prompt length >= 1 (0: profile decode steps)" in capsys.readouterr().err


def test_activity_intervals_come_from_the_profile():
    """The intervals the active time is taken over are the profile's own events: on a CPU, the
    operators' (nested, so their union is at most the profiled wall time)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    mod = _module()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        torch.randn(256, 256) @ torch.randn(256, 256)
        wall_us = (time.perf_counter() - t0) * 1e6
    cpu = mod.device_intervals(prof, torch.autograd.DeviceType.CPU)
    assert cpu and all(end >= start for start, end in cpu)
    assert 0 < mod.union_length(cpu) <= wall_us * 1.5
    assert mod.device_intervals(prof) == []  # no CUDA activity recorded


def _enclosing_functions(path: Path, line: int) -> set[str]:
    """Names of the functions whose body holds ``line`` of ``path`` (and ``<lambda>``)."""
    import ast

    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    tree = ast.parse(path.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, defs) and n.lineno <= line <= n.end_lineno}
    return names | {"<lambda>"}


@pytest.mark.slow
def test_operator_sites_name_the_source_lines_that_call_them(tmp_path):
    """Each listed site is a line of a DeepInfer source file inside the function it names."""
    repo = SCRIPT.parents[3]
    args = ["--steps", "2", "--batch", "2", "--prompt-len", "16", "--sites", "5"]
    report = _module().main([*args, "--out", str(tmp_path / "p.json")])
    sites = report["operators_by_site"]
    assert report["operators_per_step_eager"] == pytest.approx(sum(sites.values()))
    assert sum(sites.values()) > 0
    for site in sites:
        where, func = site.split(" ")
        rel, line = where.rsplit(":", 1)
        files = [p for p in repo.rglob(Path(rel).name) if str(p).endswith(rel) and ".venv" not in p.parts]
        assert files, f"{rel}: no such source file"
        assert func in _enclosing_functions(files[0], int(line)), site


@pytest.mark.slow
def test_host_time_names_the_functions_of_a_step(tmp_path):
    """``--host``: a wall time without the profiler, and DeepInfer functions by cumulative host
    time, the engine's step among them and first (every other one runs inside it)."""
    args = ["--steps", "2", "--batch", "2", "--prompt-len", "16", "--host", "6"]
    host = _module().main([*args, "--out", str(tmp_path / "p.json")])["host"]
    funcs = host["ms_by_function"]
    assert host["wall_ms_per_step"] > 0 and host["wait_ms_per_step"] >= 0 and len(funcs) == 6
    first = next(iter(funcs))
    assert first.startswith("deepinfer_core/engine/llm_engine.py:") and first.endswith(" step")
    assert list(funcs.values()) == sorted(funcs.values(), reverse=True)


def test_a_negative_sites_count_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as e:
        _module().parse_args(["--sites", "-1"])
    assert e.value.code == 2
    assert "--sites -1: give a count of source lines >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        _module().parse_args(["--host", "-2"])
    assert e.value.code == 2
    assert "--host -2: give a count of functions >= 0" in capsys.readouterr().err
