"""Helpers the model families' pydantic configs share."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from deepinfer_core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)

logger = logging.getLogger("deepinfer.model")


def validate_config(cls: type[M], data: dict[str, Any], source: str, label: str) -> M:
    """``cls.model_validate(data)``, every validation error turned into one
    :class:`~deepinfer_core.errors.ConfigError` naming ``label`` (e.g. ``"DeepSeek-V4"``),
    ``source`` and each bad field."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid {label} config in {source}: {msgs}") from None


def eos_list(eos_token_id: int | list[int] | None) -> list[int]:
    """A config's ``eos_token_id`` (an int, a list or ``None``) as a list."""
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def check_model_type(data: Any, source: str, label: str, expected: str, also: Collection[str] = ()) -> str:
    """The ``model_type`` of a parsed ``config.json`` (``data``), which must be ``expected`` or
    one of ``also``; else a one-line :class:`~deepinfer_core.errors.ConfigError` naming
    ``label`` (e.g. ``"DeepSeek-V4"``) and ``source``."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid {label} config in {source}: expected a JSON object")
    model_type = data.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source} has no model_type; a {label} config says model_type {expected!r}")
    if model_type != expected and model_type not in also:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not a {label} config (expected {expected!r})"
        )
    return model_type


def check_fields(
    data: dict[str, Any], source: str, label: str, missing: list[str], known: Collection[str]
) -> None:
    """A config's shape fields and keys: the ``missing`` shape fields (descriptions) are one
    :class:`~deepinfer_core.errors.ConfigError` naming ``label`` and ``source``; the keys not
    in ``known`` are listed once at DEBUG level on ``deepinfer.model``."""
    if missing:
        raise ConfigError(
            f"invalid {label} config in {source}: missing {', '.join(missing)} "
            "(fields that decide the model's shapes have no default)"
        )
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        logger.debug("%s: keys a %s config does not use, ignored: %s", source, label, ", ".join(unknown))
