"""Helpers the model families' pydantic configs share."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from deepinfer_core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


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
