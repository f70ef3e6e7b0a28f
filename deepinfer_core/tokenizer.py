"""Tokenizer of a checkpoint: HF ``tokenizers`` fast tokenizer plus the checkpoint's configs.

Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (BOS/EOS tokens,
``add_bos_token``, ``chat_template``), ``chat_template.jinja`` (takes precedence, as in
transformers) and ``generation_config.json`` (extra EOS ids).  Chat templates are rendered
with jinja2 in a sandbox, with the same globals transformers provides.  ``transformers``
is not imported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from deepinfer_core.errors import ConfigError


class Tokenizer:
    """Text <-> token ids for one checkpoint.

    Attributes:
        bos_token_id: id of the BOS token, or ``None`` when the checkpoint has none.
        eos_token_id: the primary EOS id (from ``tokenizer_config.json``), or ``None``.
        eos_token_ids: every id that ends generation: the primary EOS plus the ids listed in
            ``generation_config.json``, in that order, without duplicates.
        add_bos_token: whether :meth:`encode` prepends BOS by default.
        chat_template: the jinja source of the chat template, or ``None``.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = True,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        source: str = "tokenizer",
    ) -> None:
        self._tok = backend
        self._source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = self._id_of(bos_token, "bos_token")
        self.eos_token_id = self._id_of(eos_token, "eos_token")
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: list[int] = list(dict.fromkeys([*eos, *extra_eos_token_ids]))

    def _id_of(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ConfigError(f"{self._source}: {field} {token!r} is not in the vocabulary")
        return tid

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added (special) tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of all special added tokens (BOS, EOS, role markers, ...)."""
        return {tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special}

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (exact vocabulary entry), or ``None``."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; prepends BOS when ``add_bos`` (default: ``add_bos_token``).

        Special-token strings inside ``text`` become their ids, so a rendered chat template
        (which already starts with BOS) should be encoded with ``add_bos=False``.
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos_token
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens=False``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the checkpoint's template.

        Extra keyword arguments are passed to the template (e.g. ``tools``).  Raises
        :class:`ConfigError` when the checkpoint has no template or the template fails.
        """
        if not self.chat_template:
            raise ConfigError(
                f"{self._source} has no chat template (no 'chat_template' in tokenizer_config.json "
                "and no chat_template.jinja); pass a plain prompt instead"
            )
        try:
            template = _jinja_env().from_string(self.chat_template)
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except (jinja2.TemplateError, _TemplateRaised) as e:
            raise ConfigError(f"chat template of {self._source} failed: {e}") from None


class _TemplateRaised(Exception):
    """Raised by a template's own ``raise_exception(...)`` call."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


@lru_cache(maxsize=1)
def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Same settings and helpers as transformers' chat-template renderer, so templates that
    # work there work here.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of the checkpoint in ``model_dir``.

    Raises :class:`ConfigError` naming the file when ``tokenizer.json`` is missing or
    unreadable, or a JSON config beside it is corrupt.
    """
    d = Path(model_dir)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"no tokenizer at {path}: the model directory needs a tokenizer.json (HF fast tokenizer)"
        )
    try:
        backend = _HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise ConfigError(f"{path} is not a valid HF tokenizers file: {e}") from None
    tok_cfg = _read_json(d / "tokenizer_config.json")
    gen_cfg = _read_json(d / "generation_config.json")
    template = _chat_template(d, tok_cfg)
    extra_eos = gen_cfg.get("eos_token_id")
    extra_eos = [] if extra_eos is None else [extra_eos] if isinstance(extra_eos, int) else list(extra_eos)
    return Tokenizer(
        backend,
        bos_token=_token_str(tok_cfg.get("bos_token")),
        eos_token=_token_str(tok_cfg.get("eos_token")),
        add_bos_token=bool(tok_cfg.get("add_bos_token", True)),
        chat_template=template,
        extra_eos_token_ids=extra_eos,
        source=str(d),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _token_str(value: Any) -> str | None:
    # Older configs store special tokens as serialised AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(d: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    tpl = tok_cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        return named.get("default")
    return tpl
