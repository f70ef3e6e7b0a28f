"""Incremental detokenisation against decoding the whole output at once (tiny model tokenizer)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_core.engine.detokenizer import IncrementalDetokenizer
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
from deepinfer_core.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(builtin_tiny_model_dir())


def stream(tok, prompt, ids, skip=True):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [d.step([t]) for t in ids]
    return d, deltas


def test_deltas_concatenate_to_the_full_decode(tok):
    text = "Hello world, the quick brown fox. Ünïcödé ✓ 漢字 🙂 done"
    prompt = tok.encode("Prompt:")
    ids = tok.encode(text, add_bos=False)
    d, deltas = stream(tok, prompt, ids)
    d.flush()
    assert "".join(deltas) == d.output_text == tok.decode(ids)


def test_random_token_streams_match_the_full_decode_after_flush(tok):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, tok.vocab_size, (30,), generator=g).tolist()
        for skip in (True, False):
            d, _ = stream(tok, [5, 6], ids, skip)
            d.flush()
            assert d.output_text == tok.decode(ids, skip_special_tokens=skip)


def test_incomplete_characters_are_held_back_until_completed(tok):
    # a multi-byte character split over byte-level tokens decodes to U+FFFD until complete
    ids = tok.encode("🙂", add_bos=False)
    if len(ids) < 2:
        pytest.skip("the emoji is a single token in this vocabulary")
    d, deltas = stream(tok, [], ids)
    assert all(x == "" for x in deltas[:-1]) and deltas[-1] == "🙂"
    assert "\ufffd" not in d.output_text


def test_special_tokens_are_skipped_or_kept(tok):
    eos = tok.eos_token_id
    ids = [*tok.encode("hi", add_bos=False), eos]
    assert stream(tok, [], ids, skip=True)[0].output_text == "hi"
    assert stream(tok, [], ids, skip=False)[0].output_text == tok.decode(ids, skip_special_tokens=False)


def test_truncate_cuts_the_text(tok):
    d, _ = stream(tok, [], tok.encode("abcdef", add_bos=False))
    d.truncate(2)
    assert d.output_text == "ab"
