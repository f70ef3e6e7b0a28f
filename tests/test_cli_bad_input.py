"""Property test: no ``deepinfer`` subcommand prints a traceback, whatever the flags, paths,
config files and ``DEEPINFER_*`` values.

Every run must end with status 0 (it worked), 1 (``generate`` or ``bench`` ran and some request
failed: one ``error:`` line says so; ``generate`` also shows each failed prompt's error in its
place) or 2 (bad input: exactly one ``error:`` line on stderr), and
never with an internal error (status 3) or an exception escaping ``main``.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deepinfer_core.cli import main

pytestmark = pytest.mark.slow

BAD_INTS = ["-1", "0", "x", "1.5", "", "99999999999999999999999", "2", "3"]
BAD_FLOATS = ["nan", "inf", "-inf", "-1", "x", "", "1e400", "0", "0.5", "2"]
PATH = "\x00path:"  # marks a path name in a drawn argv (no real argument holds a NUL)
TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"), max_size=12
)

# flags shared by generate and bench, and their candidate values ("{path}": one of the paths)
ENGINE_FLAGS: dict[str, list[str]] = {
    "--model": ["{path}"],
    "--config": ["{path}"],
    "--backend": ["auto", "reference", "cuda_sm100", "ascend950", "nope", ""],
    "--dtype": ["auto", "float32", "bfloat16", "int8", "", "x"],
    "--device": ["cpu", "cuda", "cuda:7", "cpu:3", "npu", "foo", "", "meta"],
    "--max-num-seqs": BAD_INTS,
    "--max-num-batched-tokens": BAD_INTS,
    "--max-model-len": BAD_INTS,
    "--num-cache-pages": BAD_INTS,
    "--replay-tail": BAD_INTS,
    "--log-level": ["debug", "loud", ""],
    "--kv-cache-dtype": ["auto", "fp8", "int4", ""],
}
SWITCHES = [
    "--strict-ops", "--no-prefix-caching", "--no-async-scheduling", "--batch-invariant", "--keep-quantized",
    "--no-keep-quantized", "--enforce-eager",
]  # fmt: skip
GENERATE_FLAGS: dict[str, list[str]] = {
    "--max-tokens": BAD_INTS,
    "--temperature": BAD_FLOATS,
    "--top-p": BAD_FLOATS,
    "--top-k": BAD_INTS,
    "--seed": BAD_INTS,
    "--logprobs": BAD_INTS,
    "--min-tokens": BAD_INTS,
    "--min-p": BAD_FLOATS,
    "--presence-penalty": BAD_FLOATS,
    "--repetition-penalty": BAD_FLOATS,
    "--stop": ["", "e", "\x7f"],
    "--engine-seed": BAD_INTS,
    "--json-schema": ["{path}"],
    "--grammar": ["{path}"],
}
BENCH_FLAGS: dict[str, list[str]] = {
    "--num-prompts": BAD_INTS,
    "--input-len": BAD_INTS,
    "--output-len": BAD_INTS,
    "--shared-prefix-len": BAD_INTS,
    "--prompts-file": ["{path}"],
    "--json": ["{path}"],
    "--temperature": BAD_FLOATS,
}
ENV_FIELDS = [
    "MAX_NUM_SEQS", "DTYPE", "DEVICE", "BACKEND", "ASYNC_SCHEDULING", "BATCH_INVARIANT", "SEED",
    "KV_CACHE_MEMORY_GB", "PAGE_SIZE", "MODEL", "LOG_LEVEL", "PLUGINS", "KEEP_QUANTIZED",
    "STREAM_OVERLAP", "CP_MIN_TOKENS",  # read by the model while it runs, checked at engine build
]  # fmt: skip


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    """Named paths of every kind a user may pass by mistake."""
    root = tmp_path_factory.mktemp("bad_inputs")
    files = {
        "garbage.toml": b"max_num_seqs = = 3\n",
        "bad_value.yaml": b"max_num_seqs: -4\n",
        "unknown_key.toml": b"batch = 3\n",
        "list.yaml": b"- 1\n- 2\n",
        "binary.yaml": bytes(range(256)),
        "config.ini": b"[x]\n",
        "prompts.jsonl": b'{"prompt": 3}\n{nope\n',
        "prompts.txt": b"Hello\n\n",
        "empty.txt": b"",
    }
    out = {}
    for name, data in files.items():
        (root / name).write_bytes(data)
        out[name] = root / name
    bad_model = root / "bad_model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text('{"model_type": "deepseek_v4", "hidden_size": "big"}')
    no_weights = root / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_dir / "config.json").read_text())
    readonly = root / "readonly"
    readonly.mkdir(mode=0o500)
    out.update(
        {
            "missing": root / "missing" / "x",
            "dir": root,
            "bad_model": bad_model,
            "no_weights": no_weights,
            "tiny": tiny_dir,
            "proc": Path("/proc/nope/x"),
            "readonly_file": readonly / "out.json",
            "out_json": root / "out.json",
        }
    )
    return out


@st.composite
def invocations(draw: st.DrawFn, path_names: list[str]) -> tuple[list[str], dict[str, str]]:
    """An argv for one subcommand plus DEEPINFER_* variables."""
    command = draw(st.sampled_from(["generate", "bench", "plugins", "make-tiny"]))
    argv = [command]
    if command == "make-tiny":
        argv.append(PATH + draw(st.sampled_from(path_names)))
        if draw(st.booleans()):
            argv += ["--seed", draw(st.sampled_from(BAD_INTS))]
    elif command in ("generate", "bench"):
        flags = {**ENGINE_FLAGS, **(GENERATE_FLAGS if command == "generate" else BENCH_FLAGS)}
        for flag in draw(st.lists(st.sampled_from(sorted(flags)), max_size=4, unique=True)):
            value = draw(st.sampled_from(flags[flag]))
            if value == "{path}":
                value = PATH + draw(st.sampled_from(path_names))
            argv += [flag, value]
        argv += draw(st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))
        if command == "generate":
            for _ in range(draw(st.integers(1, 2))):
                argv += ["--prompt", draw(st.one_of(st.sampled_from(["Hi", "", "x" * 300]), TEXT))]
            argv += ["--max-tokens", "2"] if "--max-tokens" not in argv else []
        else:
            argv += ["--num-prompts", "2", "--output-len", "2", "--input-len", "4"]
    env = {
        "DEEPINFER_" + name: draw(st.one_of(TEXT, st.sampled_from(["0", "1", "on", "none", "-3", "2.5"])))
        for name in draw(st.lists(st.sampled_from(ENV_FIELDS), max_size=2, unique=True))
    }
    return argv, env


def run(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_") or k == "DEEPINFER_CACHE"}
    with (
        patch.dict(os.environ, {**clean, **env}, clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_no_subcommand_prints_a_traceback(paths, tmp_path, data):
    argv, env = data.draw(invocations(sorted(paths)))
    argv = [str(paths[a.removeprefix(PATH)]) if a.startswith(PATH) else a for a in argv]
    if argv[0] == "make-tiny" and argv[1] in (str(paths["out_json"]), str(paths["missing"])):
        argv[1] = str(tmp_path / data.draw(st.sampled_from(["a", "b/c"])))  # a fresh target
    code, out, err = run(argv, env)
    event(f"{argv[0]} exit {code}")
    lines = err.splitlines()
    assert "Traceback" not in err and "internal error" not in err, (argv, env, err)
    assert code in (0, 1, 2), (argv, env, code, err)
    if code == 2:
        assert sum(line.startswith("error: ") for line in lines) == 1, (argv, env, err)
    if code == 1:  # the engine ran and some request failed: one error line says so
        assert sum(line.startswith("error: ") for line in lines) == 1, (argv, env, err)
        if argv[0] == "generate":  # every prompt has its result line, failed ones as their error
            assert "prompt(s) failed" in err and out.count("error: ") >= 1, (argv, env, err)
        else:
            assert argv[0] == "bench" and "request(s) failed; the first: " in err, (argv, env, err)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "--device", "foo", "--prompt", "Hi"], "device='foo' is not a torch device"),
        (["make-tiny", "/proc/nope"], "make-tiny /proc/nope: cannot write"),
        (["bench", "--json", "/nonexistent/dir/out.json"], "/nonexistent/dir does not exist"),
        (["generate", "--max-tokens", "lots", "--prompt", "x"], "--max-tokens"),
    ],
)
def test_known_bad_inputs_give_one_named_error(argv, needle):
    code, out, err = run(argv, {})
    assert code == 2 and out == "" and err.startswith("error: ") and needle in err
    assert len(err.splitlines()) == 1


def test_new_refusals_are_one_named_line_before_any_work(tmp_path, monkeypatch):
    """An empty or non-empty ``make-tiny`` target, a misspelt config-file key (with the key it
    resembles), a malformed environment variable that the model reads while it runs: one
    ``error:`` line, status 2, and nothing written (the random tiny model's
    cache that cannot be made: ``tests/models/test_tiny.py``)."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "config.json").write_text("{}")
    typo = tmp_path / "typo.toml"
    typo.write_text('max_num_seq = 4\nbackend = "reference"\n')
    (tmp_path / "file").write_text("")
    monkeypatch.chdir(full)  # where an empty make-tiny path would write
    cases = [
        (["make-tiny", ""], {}, "make-tiny: the output directory is an empty string"),
        (
            ["make-tiny", str(full)],
            {},
            f"make-tiny {full}: the directory is not empty (it holds config.json)",
        ),
        (
            ["generate", "--config", str(typo), "--prompt", "x"],
            {},
            f"config file {typo}: unknown key 'max_num_seq'; did you mean 'max_num_seqs'?",
        ),
        (
            ["generate", "--prompt", "x"],
            {"DEEPINFER_STREAM_OVERLAP": "lots"},
            "DEEPINFER_STREAM_OVERLAP='lots'",
        ),
        (
            ["generate", "--prompt", "x"],
            {"DEEPINFER_CP_MIN_TOKENS": "abc"},
            "environment variable DEEPINFER_CP_MIN_TOKENS='abc'",
        ),
    ]
    for argv, env, needle in cases:
        code, out, err = run(argv, env)
        assert (code, out) == (2, ""), (argv, err)
        assert err.startswith(f"error: {needle}") and len(err.splitlines()) == 1, (argv, err)
    assert [p.name for p in full.iterdir()] == ["config.json"] and (full / "config.json").read_text() == "{}"
