"""``deepinfer bench`` on the tiny model: counts, JSON keys, percentiles, prompt sources."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deepinfer_core.bench import percentiles, read_prompts_file, synthetic_prompts
from deepinfer_core.cli import main
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.registry import default_model_dir
from deepinfer_core.tokenizer import load_tokenizer

KEYS = {
    "num_requests", "num_failed_requests", "num_input_tokens", "num_output_tokens", "duration_s",
    "request_throughput", "output_throughput", "total_token_throughput", "ttft_ms", "latency_ms",
    "num_prefix_hit_tokens", "num_replayed_tokens", "num_preemptions", "num_steps", "peak_cache_usage",
    "kv_cache_capacity_tokens", "args", "engine", "first_error",
}  # fmt: skip


def bench(capsys, tmp_path, *argv: str) -> tuple[dict, str]:
    out_json = tmp_path / "bench.json"
    code = main(["bench", "--backend", "reference", *argv, "--json", str(out_json)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(out_json.read_text()), captured.out


def test_synthetic_bench_counts_and_percentiles(capsys, tmp_path):
    result, table = bench(
        capsys, tmp_path, "--num-prompts", "5", "--input-len", "20", "--output-len", "3",
        "--shared-prefix-len", "16", "--max-num-seqs", "3",
    )  # fmt: skip
    assert set(result) == KEYS
    engine = result["engine"]  # the resolved settings, not only the flags given
    assert engine["backend"] == "reference" and engine["dtype"] == "float32" and engine["device"] == "cpu"
    assert engine["max_num_seqs"] == 3 and Path(engine["model"]).is_dir()
    assert engine["keep_quantized"] is False  # resolved: the reference declares no quantised formats
    assert engine["kv_cache_capacity_tokens"] == result["kv_cache_capacity_tokens"]
    assert result["num_requests"] == 5 and result["num_failed_requests"] == 0
    assert result["num_input_tokens"] == 5 * 20 and result["num_output_tokens"] == 5 * 3
    for key in ("ttft_ms", "latency_ms"):
        s = result[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert result["ttft_ms"]["p99"] <= result["latency_ms"]["p99"]
    d = result["duration_s"]
    assert result["output_throughput"] == pytest.approx(15 / d)
    assert result["total_token_throughput"] == pytest.approx(115 / d)
    assert result["request_throughput"] == pytest.approx(5 / d)
    assert result["args"]["max_num_seqs"] == 3 and result["args"]["shared_prefix_len"] == 16
    assert result["num_prefix_hit_tokens"] >= 0 and result["num_replayed_tokens"] >= 0
    assert "Output throughput (tok/s)" in table and "TTFT (ms) p99" in table


def test_shared_prefix_is_served_from_the_prefix_cache(capsys, tmp_path):
    argv = ["--num-prompts", "3", "--input-len", "20", "--shared-prefix-len", "16", "--output-len", "1"]
    on, _ = bench(capsys, tmp_path, *argv, "--max-num-seqs", "1")  # one at a time: 2nd and 3rd can hit
    off, _ = bench(capsys, tmp_path, *argv, "--max-num-seqs", "1", "--no-prefix-caching")
    assert 0 < on["num_prefix_hit_tokens"] <= 2 * 16  # at most the shared page of the later two
    assert off["num_prefix_hit_tokens"] == 0 and off["num_replayed_tokens"] == 0
    assert on["num_input_tokens"] == off["num_input_tokens"] == 60


def test_file_prompts_plain_and_jsonl(capsys, tmp_path):
    tok = load_tokenizer(default_model_dir())  # the model `deepinfer bench` runs by default
    texts = ["Hello world", "Once upon a time there was", "A"]
    plain = tmp_path / "prompts.txt"
    plain.write_text("\n".join(texts) + "\n\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    expected_in = sum(len(tok.encode(t)) for t in texts)
    for path in (plain, jsonl):
        result, _ = bench(capsys, tmp_path, "--prompts-file", str(path), "--output-len", "2")
        assert result["num_requests"] == 3 and result["num_input_tokens"] == expected_in
        assert result["num_output_tokens"] == 6
    # --num-prompts larger than the file cycles through it
    result, _ = bench(
        capsys, tmp_path, "--prompts-file", str(plain), "--num-prompts", "4", "--output-len", "1"
    )
    assert result["num_input_tokens"] == expected_in + len(tok.encode(texts[0]))


def test_synthetic_prompts_share_exactly_the_prefix():
    prompts = synthetic_prompts(4, 12, 5, list(range(100, 200)), seed=3)
    assert all(len(p) == 12 and p[:5] == prompts[0][:5] for p in prompts)
    assert len({tuple(p[5:]) for p in prompts}) == 4
    assert all(100 <= t < 200 for p in prompts for t in p)
    assert synthetic_prompts(4, 12, 5, list(range(100, 200)), seed=3) == prompts


def test_percentiles_match_numpy():
    values = [5.0, 1.0, 9.5, 3.0, 3.0, 7.25, 100.0]
    got = percentiles(values)
    for q in (50, 90, 99):
        assert got[f"p{q}"] == pytest.approx(float(np.percentile(values, q)))
    assert got["mean"] == pytest.approx(np.mean(values))


def test_bad_bench_input_is_a_clean_error(capsys, tmp_path):
    code = main(["bench", "--input-len", "4", "--shared-prefix-len", "8", "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --shared-prefix-len=8")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match="line 1"):
        read_prompts_file(bad)
    code = main(["bench", "--prompts-file", str(tmp_path / "missing.txt")])
    assert code == 2 and "missing.txt" in capsys.readouterr().err
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\x80\x81 not utf-8\n")  # found by the CLI property test: was an internal error
    code = main(["bench", "--prompts-file", str(binary)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --prompts-file {binary}: cannot read the file")


def test_throughput_is_the_named_form_of_the_default_command(capsys, tmp_path):
    argv = ["--backend", "reference", "--num-prompts", "2", "--input-len", "4", "--output-len", "2"]
    assert main(["bench", "throughput", *argv, "--json", str(tmp_path / "a.json")]) == 0
    named = json.loads((tmp_path / "a.json").read_text())
    assert named["num_output_tokens"] == 4 and named["args"]["input_len"] == 4


def test_bench_help_lists_the_benchmark_scripts_and_a_name_runs_one(capsys, tmp_path):
    from deepinfer_core.benchmarking.scripts import BENCHMARKS_DIR

    assert main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    names = {p.stem.replace("_", "-") for p in BENCHMARKS_DIR.glob("*.py")} - {"-gpu-model"}
    assert all(f"\n  {name} " in listed for name in names)
    assert "gpu-model" not in listed  # _gpu_model.py: a module the scripts share, no benchmark
    assert "cpu-tiny   " in listed and "CPU throughput of DeepInfer vs HF transformers' generate on" in listed
    assert main(["bench", "run-batch", "--sizes", "0"]) == 2  # the script's own argparse usage error
    assert "expected positive integers" in capsys.readouterr().err
    assert main(["bench", "cpu_tiny"]) == 2  # a name not listed: one line naming the listed ones
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "deepinfer bench cpu_tiny: no benchmark of that name" in err
    assert "cpu-tiny, cpu-v41" in err
