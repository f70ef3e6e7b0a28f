"""``model="org/name"``: Hugging Face Hub repo ids, resolved through the real
``huggingface_hub.snapshot_download`` against a Hugging Face cache laid out in a temporary
directory (blobs, ``snapshots/<commit>`` symlinks, ``refs/<branch or tag>``) holding the
built-in tiny model.  No test reaches the network: offline mode reads that cache, and the
"no network" test points the Hub endpoint at a closed loopback port."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.cli import main
from deepinfer_core.engine.llm_engine import resolve_model_dir
from deepinfer_core.errors import ConfigError
from deepinfer_core.hub import (
    DEFAULT_CHECKPOINT,
    MODEL_PATTERNS,
    UNSAFE_PATTERNS,
    hub_cache_dir,
    parse_repo_id,
)
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
from deepinfer_core.models.deepseek_v4.trained import builtin_trained_model_dir

MAIN = "a1" * 20  # the commit refs/main points at
TAGGED = "b2" * 20  # the commit refs/v1 points at
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def populate_hub_cache(cache: Path, repo_id: str, refs: dict[str, str]) -> dict[str, Path]:
    """Lay the built-in tiny model out as ``snapshot_download`` leaves a download in ``cache``:
    content-addressed blobs, one ``snapshots/<commit>`` folder of relative symlinks per commit
    and a ``refs/<name>`` file per branch or tag.  Returns the snapshot folder of each ref."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshots = {}
    for ref, commit in refs.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        for f in builtin_tiny_model_dir().iterdir():
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            link = snap / f.name
            if not link.exists():
                link.symlink_to(os.path.relpath(blob, snap))
        (repo / "refs" / ref).write_text(commit)
        snapshots[ref] = snap
    return snapshots


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """``HF_HUB_CACHE`` = a temporary cache holding ``org/tiny`` (``main`` and tag ``v1``), with
    ``HF_HUB_OFFLINE=1``; returns the snapshot folder of each ref."""
    pytest.importorskip("huggingface_hub", reason="huggingface_hub is not installed (the hub extra)")
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE", "DEEPINFER_MODEL"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "hf-cache"
    snapshots = populate_hub_cache(cache, "org/tiny", {"main": MAIN, "v1": TAGGED})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshots


def greedy_ids(llm: LLM) -> list[int]:
    return llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def assert_one_line_naming(err: ConfigError, *parts: str) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


def test_parse_repo_id():
    assert parse_repo_id("org/name") == ("org/name", None)
    assert parse_repo_id(DEFAULT_CHECKPOINT) == (DEFAULT_CHECKPOINT, None)
    assert parse_repo_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_repo_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    for not_an_id in (
        "name",
        "/abs/path",
        "./rel/dir",
        "~/models/x",
        "a/b/c",
        "org/name@",
        "org/-x",
        "o--g/x",
    ):
        assert parse_repo_id(not_an_id) is None, not_an_id


def test_hub_id_loads_offline_from_the_hf_cache_and_generates(hub_cache, llm):
    hub_llm = LLM(model="org/tiny", backend="reference")
    assert Path(hub_llm.config.model) == hub_cache["main"]
    assert hub_llm.get_tokenizer() is not None  # tokenizer.json came with the snapshot
    assert greedy_ids(hub_llm) == greedy_ids(llm)  # the built-in tiny model's files, the same tokens


def test_hub_revision_from_the_id_or_the_revision_option(hub_cache):
    assert resolve_model_dir("org/tiny@v1") == hub_cache["v1"]
    assert resolve_model_dir("org/tiny", revision="v1") == hub_cache["v1"]
    assert resolve_model_dir("org/tiny", revision=TAGGED) == hub_cache["v1"]  # a commit hash
    with pytest.raises(ConfigError) as e:
        resolve_model_dir("org/tiny@v1", revision="main")
    assert_one_line_naming(e.value, "'v1'", "'main'")


def test_uncached_hub_id_offline_is_one_clear_config_error(hub_cache):
    with pytest.raises(ConfigError) as e:
        LLM(model="org/not-cached", backend="reference")
    assert_one_line_naming(
        e.value,
        "org/not-cached",
        "HF_HUB_OFFLINE",
        str(hub_cache_dir()),
        "--model /path/to/dir",
        "download org/not-cached --local-dir",
    )


def test_uncached_revision_fails_clearly(hub_cache):
    for kwargs in ({"model": "org/tiny@v9"}, {"model": "org/tiny", "revision": "v9"}):
        with pytest.raises(ConfigError) as e:
            LLM(backend="reference", **kwargs)
        assert_one_line_naming(e.value, "org/tiny", "revision v9", "HF_HUB_OFFLINE", "--model")


def test_no_network_is_one_clear_config_error(hub_cache, monkeypatch):
    """Online mode with the Hub unreachable (a closed loopback port): an uncached repo fails in
    one line; a cached one still loads from the cache."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ConfigError) as e:
        resolve_model_dir("org/not-cached")
    assert_one_line_naming(e.value, "could not download", "org/not-cached", "--model /path/to/dir")
    assert resolve_model_dir("org/tiny") == hub_cache["main"]


def test_download_dir_and_hf_home_choose_the_cache(hub_cache, tmp_path, monkeypatch):
    other = tmp_path / "other-cache"
    populate_hub_cache(other, "org/elsewhere", {"main": MAIN})
    assert resolve_model_dir("org/elsewhere", download_dir=str(other)).is_relative_to(other)
    with pytest.raises(ConfigError, match="org/elsewhere"):
        resolve_model_dir("org/elsewhere")  # not in $HF_HUB_CACHE
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    populate_hub_cache(tmp_path / "hf-home" / "hub", "org/home", {"main": MAIN})
    assert resolve_model_dir("org/home").is_relative_to(tmp_path / "hf-home" / "hub")
    llm = LLM(model="org/elsewhere", download_dir=str(other), backend="reference")
    assert Path(llm.config.model).is_relative_to(other)


def test_deepinfer_model_env_and_config_file_name_the_default_model(hub_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_MODEL", "org/tiny@v1")
    assert Path(LLM(backend="reference").config.model) == hub_cache["v1"]
    monkeypatch.delenv("DEEPINFER_MODEL")
    cfg = tmp_path / "engine.toml"
    cfg.write_text('model = "org/tiny"\nbackend = "reference"\n')
    assert Path(LLM(config=cfg).config.model) == hub_cache["main"]


def test_no_model_is_the_builtin_tiny_model_and_never_asks_the_hub(monkeypatch):
    import huggingface_hub

    def no_downloads(*args, **kwargs):
        raise AssertionError(f"snapshot_download called: {args} {kwargs}")

    monkeypatch.delenv("DEEPINFER_MODEL", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_downloads)
    assert Path(LLM(backend="reference").config.model) == builtin_trained_model_dir()
    local = builtin_tiny_model_dir()
    assert resolve_model_dir(str(local), revision="v1") == local  # a local directory: revision ignored


def test_a_download_asks_for_safetensors_configs_and_tokenizer_files_never_pickles(hub_cache, monkeypatch):
    """Online, ``snapshot_download`` is asked for this repo, revision and cache, with patterns
    that (as huggingface_hub itself filters a file list) keep the safetensors checkpoint and
    its configs and tokenizer and drop pickled weights and code."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(hub_cache["v1"])

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_dir(f"{DEFAULT_CHECKPOINT}@v1") == hub_cache["v1"]
    ((repo_id, kwargs),) = calls
    assert repo_id == DEFAULT_CHECKPOINT and kwargs["revision"] == "v1"
    assert kwargs["local_files_only"] is False and kwargs["cache_dir"] == os.environ["HF_HUB_CACHE"]
    assert tuple(kwargs["allow_patterns"]) == MODEL_PATTERNS
    assert tuple(kwargs["ignore_patterns"]) == UNSAFE_PATTERNS
    files = [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "model-00001-of-00046.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "pytorch_model.bin",
        "pytorch_model-00001-of-00002.bin",
        "training_args.pt",
        "optimizer.pth",
        "modeling_deepseek.py",
        "README.md",
        "figures/benchmark.png",
    ]
    kept = list(filter_repo_objects(files, allow_patterns=MODEL_PATTERNS, ignore_patterns=UNSAFE_PATTERNS))
    assert kept == files[:7]


def test_tokenizer_may_be_a_hub_id(hub_cache):
    llm = LLM(tokenizer="org/tiny@v1", backend="reference")
    assert llm.get_tokenizer() is not None and llm.config.model == str(builtin_trained_model_dir())


def test_cli_generate_from_a_hub_id_offline(hub_cache, capsys, llm):
    argv = ["generate", "--model", "org/tiny", "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].text + "\n"
    code = main(["generate", "--model", "org/tiny", "--revision", "v9", "--prompt", "hi"])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "org/tiny" in err and "v9" in err and "--model /path/to/dir" in err


def test_missing_local_path_that_is_not_a_hub_id_keeps_its_error(tmp_path):
    for model in (str(tmp_path / "missing"), "./no-such-dir", "not/a/repo"):
        with pytest.raises(ConfigError, match="no such directory"):
            resolve_model_dir(model)


def test_hub_id_without_huggingface_hub_says_pip_install(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # "org/name" is no local directory here
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    with pytest.raises(ConfigError) as e:
        resolve_model_dir("org/name")
    assert_one_line_naming(e.value, "org/name", "pip install huggingface_hub", "--model /path/to/dir")


def test_a_snapshot_may_link_into_its_blobs_but_nowhere_else(hub_cache, tmp_path):
    """The loader follows the cache's snapshot -> ``blobs/`` symlinks (the tests above load
    through them) and still refuses a snapshot file linked anywhere else."""
    from deepinfer_core.errors import WeightLoadError

    snap = populate_hub_cache(Path(os.environ["HF_HUB_CACHE"]), "org/escape", {"main": MAIN})["main"]
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes((snap / "model.safetensors").read_bytes())
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(elsewhere)
    with pytest.raises(WeightLoadError, match="outside the model directory"):
        LLM(model="org/escape", backend="reference")
