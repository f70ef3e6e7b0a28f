"""The ``deepinfer`` command line: subcommands and error reporting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.cli import main
from deepinfer_core.cli_generate import escape_control

REPO = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_matches_the_python_api(capsys):
    code, out, err = run_cli(
        capsys,
        "generate",
        "--backend",
        "reference",
        "--prompt",
        "Hello",
        "--prompt",
        "Once upon",
        "--temperature",
        "0",
        "--max-tokens",
        "4",
        "--logprobs",
        "2",
        "--json",
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    expected = LLM(backend="reference").generate(
        ["Hello", "Once upon"], SamplingParams(temperature=0, max_tokens=4, logprobs=2)
    )
    assert [r["token_ids"] for r in records] == [o.outputs[0].token_ids for o in expected]
    assert [r["text"] for r in records] == [o.outputs[0].text for o in expected]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in records)
    assert all(len(r["logprobs"]) == 4 for r in records)


def test_generate_plain_text(capsys):
    code, out, _ = run_cli(capsys, "generate", "--prompt", "Hi", "--temperature", "0", "--max-tokens", "3")
    expected = LLM().generate("Hi", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].text
    assert code == 0 and out == expected + "\n"


def test_unknown_backend_is_a_clean_error(capsys):
    code, out, err = run_cli(capsys, "generate", "--backend", "no-such-backend", "--prompt", "x")
    assert code == 2 and out == ""
    assert err.startswith("error: ") and "no-such-backend" in err and "Traceback" not in err


def test_bad_config_value_is_a_clean_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--max-num-seqs", "0", "--prompt", "x")
    assert code == 2 and err.startswith("error: ") and "max_num_seqs=0" in err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_num_seqs: 2\nbatch: 3\n")
    code, _, err = run_cli(capsys, "generate", "--config", str(cfg), "--prompt", "x")
    assert code == 2 and "'batch'" in err and str(cfg) in err


def test_missing_model_dir_is_a_clean_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert code == 2 and err.startswith("error: ") and "missing" in err


def test_invalid_sampling_flag_is_a_clean_error(capsys):
    code, _, err = run_cli(capsys, "generate", "--top-p", "2", "--prompt", "x")
    assert code == 2 and err.startswith("error: SamplingParams.top_p") and "2.0" in err
    code, _, err = run_cli(capsys, "generate", "--max-tokens", "lots", "--prompt", "x")
    assert code == 2 and "--max-tokens" in err  # argparse's own usage error


def test_make_tiny_then_generate_from_it(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "make-tiny", str(tmp_path / "tiny"), "--seed", "3")
    assert code == 0 and out.strip() == str(tmp_path / "tiny")
    assert (tmp_path / "tiny" / "config.json").is_file()
    code, out, err = run_cli(
        capsys, "generate", "--model", str(tmp_path / "tiny"), "--prompt", "Hi", "--max-tokens", "2", "--json"
    )
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 2


def test_plugins_prints_json_with_the_core_plugin(capsys):
    code, out, _ = run_cli(capsys, "plugins")
    report = json.loads(out)
    core = next(p for p in report if p["name"] == "core")
    assert any(b["name"] == "reference" for b in core["backends"])
    assert code in (0, 1)


@pytest.mark.slow
def test_console_entry_prints_no_traceback():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer_core.cli", "generate", "--backend", "nope", "--prompt", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_verbose_generate_reports_capacity_and_progress(capsys):
    code, out, err = run_cli(
        capsys, "generate", "--backend", "reference", "--num-cache-pages", "5", "--prompt", "Hi",
        "--temperature", "0", "--max-tokens", "2", "--verbose",
    )  # fmt: skip
    llm = LLM(backend="reference", num_cache_pages=5)
    assert (
        code == 0
        and out
        == llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].text
        + "\n"
    )
    assert f"KV cache capacity: {5 * llm.engine.runner.kv_cache.page_size} tokens" in err
    assert "tok/s" in err
    code, _, err = run_cli(
        capsys, "generate", "--backend", "reference", "--prompt", "Hi", "--max-tokens", "2"
    )
    assert code == 0 and err == ""  # quiet without --verbose


def test_engine_flags_become_llm_arguments():
    from deepinfer_core.cli import build_parser
    from deepinfer_core.cli_engine_args import engine_kwargs

    args = build_parser().parse_args(
        [
            "bench",
            "--no-prefix-caching",
            "--no-async-scheduling",
            "--max-num-seqs",
            "3",
            "--num-cache-pages",
            "9",
        ]
    )
    assert engine_kwargs(args) == {
        "enable_prefix_caching": False,
        "async_scheduling": False,
        "max_num_seqs": 3,
        "num_cache_pages": 9,
    }
    assert engine_kwargs(build_parser().parse_args(["bench"])) == {}
    for flag, value in (("--keep-quantized", True), ("--no-keep-quantized", False)):
        args = build_parser().parse_args(["generate", "--prompt", "x", flag])
        assert engine_kwargs(args) == {"keep_quantized": value}
    spec_flags = [
        "--speculative-method", "fixed", "--drafter", "mtp", "--max-draft-tokens", "3",
        "--spec-acceptance", "rejection", "--no-spec-varlen", "--mixed-graph-max-tokens", "256",
    ]  # fmt: skip
    args = build_parser().parse_args(["bench", *spec_flags])
    assert engine_kwargs(args) == {
        "mixed_graph_max_tokens": 256,
        "speculative": {
            "method": "fixed",
            "drafter": "mtp",
            "max_draft_tokens": 3,
            "acceptance": "rejection",
            "varlen": False,
        },  # fmt: skip
    }


def test_generate_sampling_flags_reach_the_request(capsys):
    """--stop / penalties / min-p / min-tokens on the command line behave as the Python API."""
    from deepinfer_core import LLM, SamplingParams

    argv = [
        "generate",
        "--prompt",
        "Once upon",
        "--max-tokens",
        "20",
        "--temperature",
        "0.8",
        "--seed",
        "1",
        "--stop",
        "e",
        "--repetition-penalty",
        "1.3",
        "--min-p",
        "0.05",
        "--min-tokens",
        "2",
        "--json",
    ]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    ref = (
        LLM()
        .generate(
            ["Once upon"],
            SamplingParams(
                max_tokens=20,
                temperature=0.8,
                seed=1,
                stop=["e"],
                repetition_penalty=1.3,
                min_p=0.05,
                min_tokens=2,
            ),
            use_tqdm=False,
        )[0]
        .outputs[0]
    )
    assert got["token_ids"] == ref.token_ids and got["text"] == ref.text
    assert got["finish_reason"] == ref.finish_reason


def test_generate_prints_every_prompt_in_order_with_failures_in_place(capsys):
    long_prompt = "a much longer prompt that cannot fit in eight tokens at all"
    code, out, err = run_cli(
        capsys, "generate", "--max-model-len", "8", "--temperature", "0", "--max-tokens", "2",
        "--prompt", "Hi", "--prompt", long_prompt, "--prompt", "Yo",
    )  # fmt: skip
    want = LLM(max_model_len=8).generate(
        ["Hi", long_prompt, "Yo"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )
    assert code == 1 and err.startswith("error: 1 of 3 prompt(s) failed")
    results = [line for line in out.splitlines() if line[:1] == "["]
    assert results[0] == f"[0] {want[0].outputs[0].text}" and results[2] == f"[2] {want[2].outputs[0].text}"
    assert results[1] == f"[1] error: {want[1].error}" and "max_model_len=8" in results[1]


def test_generate_shows_logprobs_without_json(capsys):
    code, out, _ = run_cli(
        capsys, "generate", "--prompt", "Hi", "--temperature", "0", "--max-tokens", "3", "--logprobs", "2"
    )
    want = LLM().generate("Hi", SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)
    comp = want[0].outputs[0]
    lines = out.splitlines()
    assert code == 0 and lines[0] == comp.text and len(lines) == 4
    for pos, (line, token, lp) in enumerate(zip(lines[1:], comp.token_ids, comp.logprobs, strict=True)):
        assert line.startswith(f"  logprobs[{pos}]: {token}:") and f"{lp[token]:.4f} | top: " in line


def test_cache_too_small_for_max_model_len_is_refused_at_start_up(capsys):
    code, out, err = run_cli(
        capsys, "generate", "--num-cache-pages", "1", "--max-model-len", "100", "--prompt", "Hi"
    )
    assert code == 2 and out == ""
    assert err.startswith("error: max_model_len=100 needs 7 cache pages") and "at least 7" in err
    llm = LLM(num_cache_pages=1)  # max_model_len not given: lowered to what the cache holds
    assert llm.engine.max_model_len == llm.kv_cache_capacity_tokens == 16


def test_version_flag(capsys):
    from deepinfer_core import __version__

    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"deepinfer {__version__}"


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_make_tiny_files_and_folder_get_the_modes_of_new_ones(tmp_path, capsys, arch, umask):
    """Checkpoint files and folders get what ``open`` / ``mkdir`` give under the umask (0644 /
    0755 under 022), safetensors weights included."""
    old = os.umask(umask)
    try:
        assert run_cli(capsys, "make-tiny", str(tmp_path / "t"), "--arch", arch)[0] == 0
        (tmp_path / "plain_dir").mkdir()  # the oracle: what the OS gives new ones
        (tmp_path / "plain_file").write_text("")
    finally:
        os.umask(old)
    file_mode = (tmp_path / "plain_file").stat().st_mode & 0o777
    assert file_mode == 0o666 & ~umask
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "t").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {file_mode}, modes
    assert (tmp_path / "t").stat().st_mode & 0o777 == (tmp_path / "plain_dir").stat().st_mode & 0o777


def test_make_tiny_refuses_an_empty_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "make-tiny", "")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "error: make-tiny: the output directory is an empty string; give a directory path"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing written where it runs


def test_make_tiny_refuses_a_non_empty_directory_unless_forced(tmp_path, capsys):
    from deepinfer_core.models.deepseek_v4.tiny import make_tiny

    def files(d):
        return {p.name: p.read_bytes() for p in sorted(d.iterdir())}

    target = tmp_path / "t"
    assert run_cli(capsys, "make-tiny", str(target))[0] == 0
    before = files(target)
    code, out, err = run_cli(capsys, "make-tiny", str(target), "--seed", "1")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1
    assert err.startswith(f"error: make-tiny {target}: the directory is not empty (it holds config.json, ")
    assert "--force" in err
    assert files(target) == before  # refused before writing anything
    code, out, _ = run_cli(capsys, "make-tiny", str(target), "--seed", "1", "--force")
    assert code == 0 and out.strip() == str(target)
    assert files(target) == files(make_tiny(tmp_path / "seed1", seed=1)) != before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "make-tiny", str(tmp_path / "other"))
    assert code == 2 and "(it holds notes.txt)" in err
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]
    assert run_cli(capsys, "make-tiny", str(tmp_path / "empty"))[0] == 0  # new: fine
    (tmp_path / "empty2").mkdir()
    assert run_cli(capsys, "make-tiny", str(tmp_path / "empty2"))[0] == 0  # empty: fine


def test_escape_control_writes_python_escapes_for_control_characters():
    text = "a\x00b\x1b[31mc\r\nd\te\x7f\x85€\u200d\ud800 z\\x00"
    want = "a\\x00b\\x1b[31mc\\r\nd\te\\x7f\\x85€\u200d\\ud800 z\\x00"
    assert escape_control(text) == want
    assert escape_control("plain text, ünïcode 文字") == "plain text, ünïcode 文字"


@pytest.mark.slow
def test_plain_generate_output_escapes_control_bytes_json_keeps_them(tmp_path, capsys):
    """The tiny DeepSeek-V4.1 model's random weights emit control bytes (NUL, DEL, ...): the
    plain output shows them escaped, ``--json`` has the exact text."""
    assert run_cli(capsys, "make-tiny", str(tmp_path / "v41"), "--arch", "deepseek_v41")[0] == 0
    args = ["generate", "--model", str(tmp_path / "v41"), "--temperature", "0", "--max-tokens", "24"]
    args += ["--prompt", "Hello", "--prompt", "The lighthouse keeper"]
    code, plain, _ = run_cli(capsys, *args)
    assert code == 0
    code, out, _ = run_cli(capsys, *args, "--json")
    assert code == 0
    texts = [json.loads(line)["text"] for line in out.splitlines()]
    controls = {ch for t in texts for ch in t if unicodedata.category(ch) == "Cc" and ch not in "\n\t"}
    assert controls, "the workload must produce control characters"
    assert not {ch for ch in plain if unicodedata.category(ch) == "Cc"} - {"\n"}
    want = [f"[{i}] " + escape_control(t).replace("\n", "\n    ") for i, t in enumerate(texts)]
    assert plain.splitlines() == "\n".join(want).splitlines()
