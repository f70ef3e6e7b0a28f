"""The built-in trained tiny DeepSeek-V4: the engine's default model.

A 4-layer DeepSeek-V4 of every layer type (sliding window, CSA with its indexer, HCA; hash- and
top-k-routed MoE; mHC streams) with one multi-token-prediction layer and a 2048-token
byte-level BPE tokenizer, trained on the English prose of CPython's ``pydoc_data`` topics by
``scripts/train_tiny.py``.  It ships as package data (:data:`TRAINED_DIR`, native names,
matrices in bfloat16) and loads through the ordinary loader; :func:`make_trained_quantized`
writes its FP8 / FP4 variant.  The model card is ``docs/tiny_model.md``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.errors import ConfigError

from .config import DeepseekV4Config
from .loader import load_checkpoint, load_mtp_checkpoint
from .writer import save_checkpoint

TRAINED_DIR = Path(__file__).with_name("tiny_trained")
"""The shipped checkpoint directory."""

HELD_OUT_EVERY = 20
"""Every 20th paragraph of the corpus is held out of training (:func:`load_corpus`)."""
CORPUS_SHA256 = "d9dc35bce5ab1a24"
"""The start of the sha256 of the training corpus as :func:`load_corpus` joins it: CPython
3.11.7's ``pydoc_data/topics.py`` (other CPython versions' topics differ a little)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
CHECKPOINT_FILES = ("config.json", "model.safetensors", *TOKENIZER_FILES)
LICENCE_FILE = "CORPUS_LICENSE.txt"
"""The training text's licence and copyright notice (CPython's ``LICENSE.txt``), kept with the
weights and with every variant written from them."""


def builtin_trained_model_dir() -> Path:
    """The directory of the trained tiny model (the family's built-in model).

    Raises:
        ConfigError: a file of the shipped checkpoint is missing (a damaged install).
    """
    missing = [name for name in CHECKPOINT_FILES if not (TRAINED_DIR / name).is_file()]
    if missing:
        raise ConfigError(
            f"the built-in trained tiny model in {TRAINED_DIR} lacks {', '.join(missing)}; reinstall "
            "deepinfer-core, or pass model=<checkpoint directory>"
        )
    return TRAINED_DIR


def trained_config() -> dict[str, Any]:
    """The shipped ``config.json`` as a dict."""
    return json.loads((builtin_trained_model_dir() / "config.json").read_text(encoding="utf-8"))


def trained_weights(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the trained model, main and MTP layer, by HF-style name (matrices in
    ``dtype``), read through the ordinary loader."""
    src = builtin_trained_model_dir()
    cfg = DeepseekV4Config.from_dict(trained_config(), source=str(src / "config.json"))
    return {**load_checkpoint(src, cfg, dtype), **load_mtp_checkpoint(src, cfg, dtype)}


def make_trained_quantized(
    outdir: str | Path, *, fp8_linear: bool = True, fp4_experts: bool = True, **save_options: Any
) -> Path:
    """Write the trained model to ``outdir`` with FP8 dense linears (``fp8_linear``, 128x128
    block scales unless ``fp8_block`` says otherwise) and FP4 routed experts (``fp4_experts``),
    native names, with the tokenizer files and the corpus licence; returns ``outdir``.  ``save_options`` go to
    :func:`~.writer.save_checkpoint`."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in trained_config().items() if k != "quantization_config"}
    save_checkpoint(
        trained_weights(torch.bfloat16),
        cfg,
        out,
        names="native",
        fp8_linear=fp8_linear,
        fp4_experts=fp4_experts,
        **save_options,
    )
    for name in (*TOKENIZER_FILES, LICENCE_FILE):
        shutil.copyfile(TRAINED_DIR / name, out / name)
    return out


def load_corpus(topics_file: str | Path | None = None) -> tuple[list[str], list[str], str]:
    """The training text: ``(training paragraphs, held-out paragraphs, sha256 hex digest)``.

    The topics of CPython's interactive help (``pydoc_data/topics.py``: ``topics_file``, default
    this interpreter's; PSF licence) sorted by name and joined by blank lines, split into
    paragraphs at blank lines; every :data:`HELD_OUT_EVERY`-th paragraph is held out.
    """
    if topics_file is None:
        from pydoc_data.topics import topics
    else:
        spec = importlib.util.spec_from_file_location("pydoc_topics", topics_file)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{topics_file}: not a Python file (expected a pydoc_data/topics.py)")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        topics = mod.topics
    text = "\n\n".join(topics[n].strip() for n in sorted(topics))
    digest = hashlib.sha256(text.encode()).hexdigest()
    paras = [p.strip("\n") + "\n" for p in text.split("\n\n") if p.strip()]
    held = [p for i, p in enumerate(paras) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [p for i, p in enumerate(paras) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held, digest


def token_stream(paragraphs: list[str], encode: Callable[[str], list[int]]) -> list[int]:
    """The token ids of ``paragraphs`` as the model was trained and evaluated on them: each
    paragraph and a blank line encoded on its own (``encode``: text -> ids without BOS), the
    ids concatenated."""
    return [i for p in paragraphs for i in encode(p + "\n")]
