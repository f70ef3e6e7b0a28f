"""The built-in trained tiny DeepSeek-V4 (the engine's default model): what ships, what it says
(word statistics against its training text, next to the random tiny model's), its held-out
perplexity through the engine against the training script's figure (HF transformers' forward),
its FP8/FP4 variant, and MTP drafts accepted at its real operating point."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v4 import tiny, trained
from deepinfer_core.models.deepseek_v4.config import CSA, HCA, SLIDING
from deepinfer_core.models.registry import default_model_dir

ROOT = Path(__file__).resolve().parents[2]
TRAINING_LOG = ROOT / "docs" / "tiny_model_training.json"
PROMPTS = ["Hello", "The import statement", "A class definition", "Exceptions are", "The value of", "If the"]
WORD = re.compile(r"[A-Za-z]{2,}")
TRAINED_SHARE = 0.9  # of greedy words found in the training text, at least (trained model; sampled: 0.85)
RANDOM_SHARE = 0.5  # at most (the random tiny model)


def corpus_words() -> set[str]:
    return {w.lower() for p in trained.load_corpus()[0] for w in WORD.findall(p)}


def known_share(texts: list[str], vocab: set[str]) -> tuple[float, int]:
    """The share of the words of ``texts`` found in ``vocab``, and how many words there were."""
    words = [w.lower() for t in texts for w in WORD.findall(t)]
    return (sum(w in vocab for w in words) / len(words) if words else 0.0), len(words)


def greedy_texts(llm: LLM, max_tokens: int = 24) -> list[str]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def sampled_texts(llm: LLM, copies: int = 4) -> list[str]:
    """Each prompt ``copies`` times at ``deepinfer generate``'s default temperature (1.0), seeded."""
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=i) for i in range(copies * len(PROMPTS))]
    return [o.outputs[0].text for o in llm.generate(PROMPTS * copies, params, use_tqdm=False)]


def held_out_ppl(llm: LLM, windows: int | None = None, length: int = 128) -> float:
    """Perplexity of the held-out text through the engine's prompt logprobs, over the windows
    the training script evaluates (BOS + ``length`` tokens each; ``windows``: the first ones)."""
    tok = llm.get_tokenizer()
    ids = trained.token_stream(trained.load_corpus()[1], lambda text: tok.encode(text, add_bos=False))
    starts = list(range(0, len(ids) - length, length))[:windows]
    prompts = [{"prompt_token_ids": [tok.bos_token_id, *ids[s : s + length]]} for s in starts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = -sum(
        lp[tid]
        for p, o in zip(prompts, outs, strict=True)
        for tid, lp in zip(p["prompt_token_ids"][1:], o.prompt_logprobs[1:], strict=True)
    )
    return math.exp(nll / (len(prompts) * length))


def test_the_default_model_is_the_shipped_trained_model():
    d = default_model_dir()
    assert d == trained.TRAINED_DIR
    assert all((d / f).is_file() for f in (*trained.CHECKPOINT_FILES, trained.LICENCE_FILE))
    assert "Python Software Foundation" in (d / trained.LICENCE_FILE).read_text()
    assert sum(f.stat().st_size for f in d.iterdir()) < 8 * 2**20  # a few MB: the wheel stays light
    cfg = trained.trained_config()
    assert set(cfg["layer_types"]) == {SLIDING, CSA, HCA}
    assert set(cfg["mlp_layer_types"]) == {"hash_moe", "moe"} and cfg["num_nextn_predict_layers"] == 1
    assert cfg["hc_mult"] > 1 and cfg["index_topk"] > 0


def test_every_shipped_file_is_package_data():
    """``pyproject.toml``'s package data covers every file of the shipped folder (else a wheel
    would install the engine without its default model)."""
    import fnmatch
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["deepinfer_core.models.deepseek_v4"]
    shipped = [f"{trained.TRAINED_DIR.name}/{f.name}" for f in trained.TRAINED_DIR.iterdir()]
    assert shipped and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in shipped), (shipped, globs)


def test_a_damaged_install_is_one_clear_line(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(trained, "TRAINED_DIR", tmp_path)
    with pytest.raises(ConfigError, match=r"lacks model\.safetensors, tokenizer\.json.*reinstall"):
        trained.builtin_trained_model_dir()


@pytest.mark.slow
def test_the_quick_start_prints_words_of_the_training_text_unlike_the_random_model():
    vocab = corpus_words()
    trained_llm, random_llm = LLM(), LLM(model=str(tiny.builtin_tiny_model_dir()))
    for texts in (greedy_texts, sampled_texts):
        share, n = known_share(texts(trained_llm), vocab)
        random_share, random_n = known_share(texts(random_llm), vocab)
        assert n >= 10 * len(PROMPTS) and share >= TRAINED_SHARE - 0.05, (texts, share, n)
        assert random_share <= RANDOM_SHARE, (texts, random_share, random_n)


@pytest.mark.slow
def test_held_out_perplexity_through_the_engine_matches_the_training_figure():
    """The training script measured it with HF transformers' forward on the bf16-rounded weights
    (the log's ``final_bf16``): the engine's forward on the shipped checkpoint gives the same."""
    logged = json.loads(TRAINING_LOG.read_text())["final_bf16"]["ppl"]
    ppl = held_out_ppl(LLM())
    assert ppl == pytest.approx(logged, rel=1e-3)
    assert ppl < 0.05 * trained.trained_config()["vocab_size"]  # far below a uniform guess


@pytest.mark.slow
def test_fp8_fp4_variant_loads_and_stays_close(tmp_path):
    q = trained.make_trained_quantized(tmp_path / "q")
    assert json.loads((q / "config.json").read_text())["quantization_config"]["expert_dtype"] == "fp4"
    assert (q / trained.LICENCE_FILE).read_bytes() == (
        trained.TRAINED_DIR / trained.LICENCE_FILE
    ).read_bytes()
    base, quant = LLM(), LLM(model=str(q))
    assert held_out_ppl(quant, windows=16) < 1.05 * held_out_ppl(base, windows=16)
    share, n = known_share(greedy_texts(quant), corpus_words())
    assert n >= 10 * len(PROMPTS) and share >= TRAINED_SHARE, (share, n)


@pytest.mark.slow
def test_mtp_drafts_of_the_trained_model_are_accepted_unlike_the_random_models():
    spec = {"method": "fixed", "drafter": "mtp", "max_draft_tokens": 1}

    def acceptance(model: str | None) -> float:
        llm = LLM(speculative=spec, **({"model": model} if model else {}))
        greedy_texts(llm, max_tokens=32)
        return llm.get_metrics()["speculative"]["acceptance_rate"]

    trained_rate, random_rate = acceptance(None), acceptance(str(tiny.builtin_tiny_model_dir()))
    assert trained_rate >= 0.3 and random_rate <= 0.1, (trained_rate, random_rate)


@pytest.mark.slow  # a fresh interpreter training three steps (~10 s)
def test_the_training_script_writes_a_checkpoint_the_engine_serves(tmp_path: Path):
    """``scripts/train_tiny.py`` (three steps): the shipped model's architecture and tokenizer,
    a held-out loss already below the uniform guess's ``ln(vocab)``, and a checkpoint the
    ordinary loader serves."""
    import os
    import subprocess
    import sys

    out = tmp_path / "model"
    argv = [sys.executable, str(ROOT / "scripts" / "train_tiny.py"), "--out", str(out), "--steps", "3"]
    argv += ["--warmup", "1", "--log-every", "1", "--eval-every", "3"]
    argv += ["--plot", str(tmp_path / "loss.svg"), "--log", str(tmp_path / "log.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    shipped = default_model_dir()
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((shipped / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (shipped / "tokenizer.json").read_bytes()
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["loss"] < math.log(config["vocab_size"]), summary
    outs = LLM(model=str(out)).generate(["The with statement"], SamplingParams(temperature=0, max_tokens=4))
    assert len(outs[0].outputs[0].token_ids) == 4
