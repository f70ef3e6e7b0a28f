"""The checkpoint tokenizer wrapper, checked on the tiny model's tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer_core.errors import ConfigError
from deepinfer_core.models.deepseek_v4.tiny import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    write_tokenizer_files,
)
from deepinfer_core.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n",
    "Café naïve résumé — “quotes” …",
    "東京 北京 서울 नमस्ते مرحبا שלום",
    "emoji 🙂🚀 and a ZWJ family 👨‍👩‍👧",
    "",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(tok_dir: Path, text: str) -> None:
    tok = load_tokenizer(tok_dir)
    assert tok.decode(tok.encode(text)) == text


def test_bos_follows_add_bos_token_and_override(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    assert tok.bos_token_id == 0 and tok.add_bos_token
    with_bos, without = tok.encode("hi"), tok.encode("hi", add_bos=False)
    assert with_bos == [0, *without] and without and 0 not in without


def test_special_ids_and_eos_merge_generation_config(tok_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_id == 1
    assert tok.eos_token_ids == [1, 3]
    assert tok.special_token_ids == {0, 1, 2, 3}
    assert tok.vocab_size == 512


def test_decode_skips_special_tokens_unless_asked(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    ids = [*tok.encode("ok"), tok.eos_token_id]
    assert tok.decode(ids) == "ok"
    assert tok.decode(ids, skip_special_tokens=False) == f"{BOS_TOKEN}ok{EOS_TOKEN}"


def test_chat_template_renders_deepseek_turns(tok_dir: Path) -> None:
    tok = load_tokenizer(tok_dir)
    text = tok.apply_chat_template(MESSAGES)
    turns = f"{USER_TOKEN}Hi{ASSISTANT_TOKEN}Hello.{EOS_TOKEN}{USER_TOKEN}Bye{ASSISTANT_TOKEN}"
    assert text == f"{BOS_TOKEN}Be brief.{turns}"
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(ASSISTANT_TOKEN)
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.token_to_id(ASSISTANT_TOKEN)


def test_encoding_and_template_match_transformers(tok_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours, theirs = load_tokenizer(tok_dir), transformers.AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == rendered


def test_chat_template_jinja_file_takes_precedence(tok_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert load_tokenizer(tmp_path).apply_chat_template(MESSAGES[:2]) == "[Be brief.][Hi]"


def test_missing_chat_template_is_config_error(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    tok = load_tokenizer(tmp_path)
    assert tok.bos_token_id is None and tok.encode("hi") == tok.encode("hi", add_bos=False)
    with pytest.raises(ConfigError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_template_sandbox_and_raise_exception_become_config_errors(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    cfg = {"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="chat template"):
        load_tokenizer(tmp_path).apply_chat_template(MESSAGES)
    cfg = {"chat_template": "{{ raise_exception('no tools here') }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no tools here"):
        load_tokenizer(tmp_path).apply_chat_template(MESSAGES)


def test_missing_or_corrupt_files_name_the_file(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json"):
        load_tokenizer(tmp_path)


def test_unknown_special_token_is_config_error(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<nope>"}}))
    with pytest.raises(ConfigError, match="<nope>"):
        load_tokenizer(tmp_path)
