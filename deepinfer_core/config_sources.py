"""Where engine options come from besides keyword arguments: a TOML / YAML config file, the
``DEEPINFER_<FIELD>`` environment variables and the seed's speculative-decoding switches
(``DEEPINFER_USE_NEXTN_DECODE``, ``DEEPINFER_ENABLE_MTP_VARLEN``); the error line naming each
bad field and its source; the "did you mean" hint of a misspelt option.  The precedence of the
sources is :meth:`deepinfer_core.config.EngineConfig.load`'s.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from deepinfer_core.config_sections import SpeculativeConfig
from deepinfer_core.errors import ConfigError

ENV_PREFIX = "DEEPINFER_"
NEXTN_ENV = "DEEPINFER_USE_NEXTN_DECODE"
VARLEN_ENV = "DEEPINFER_ENABLE_MTP_VARLEN"
"""The seed's switch: speculative decoding with at most this many draft tokens (0 = off)."""


def format_errors(e: ValidationError, values: Mapping[str, Any], origin: Mapping[str, str]) -> str:
    """One line of a pydantic error: each bad field with its value and (``origin``: field ->
    description) where the value came from."""
    msgs = []
    for err in e.errors():
        field = ".".join(map(str, err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if field:
            top = str(err["loc"][0])
            where = f" (from {origin[top]})" if top in origin else ""
            msgs.append(f"{field}={err.get('input', values.get(field))!r}{where}: {msg}")
        else:
            sources = sorted({origin[k] for k in origin if k in msg})
            msgs.append(msg + (f" (from {', '.join(sources)})" if sources else ""))
    return "invalid engine config: " + "; ".join(msgs)


def read_options_file(path: str | os.PathLike[str], fields: Iterable[str]) -> dict[str, Any]:
    """Read a TOML or YAML config file of top-level options; a key not in ``fields`` is an
    error naming key and file."""
    fields = list(fields)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]

            data = tomllib.loads(p.read_text())
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(p.read_text()) or {}
        else:
            raise ConfigError(f"config file {p}: unsupported extension {suffix!r}; use .toml, .yaml or .yml")
    except ConfigError:
        raise
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError
        raise ConfigError(f"config file {p} could not be parsed: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {p} must hold a table of key = value pairs, got {type(data).__name__}"
        )
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        if len(unknown) == 1:
            what, hints = f"unknown key {unknown[0]!r}", did_you_mean(unknown[0], fields)
        else:
            what, hints = (
                f"unknown keys {unknown}",
                "".join(did_you_mean(k, fields, f" for {k!r}") for k in unknown),
            )
        listing = "" if hints else f"; known keys: {sorted(fields)}"
        raise ConfigError(f"config file {p}: {what}{hints}{listing}")
    return data


def did_you_mean(name: str, known: Iterable[str], suffix: str = "") -> str:
    """``"; did you mean 'x'?"`` (``suffix`` before the ``?``) naming the known names closest
    to a misspelt ``name`` (:func:`difflib.get_close_matches`), or ``""`` when none is close."""
    close = difflib.get_close_matches(name.strip().lower().replace("-", "_"), list(known), n=2, cutoff=0.75)
    if not close:
        return ""
    return f"; did you mean {' or '.join(repr(c) for c in close)}{suffix}?"


def apply_nextn_env(env: Mapping[str, str], values: dict[str, Any], origin: dict[str, str]) -> None:
    """``DEEPINFER_USE_NEXTN_DECODE=N``: speculative decoding with ``max_draft_tokens=N`` (other
    fields from ``speculative`` if given, else the defaults); ``0`` turns it off."""
    raw = env.get(NEXTN_ENV)
    if raw is None or not raw.strip():
        return
    try:
        n = int(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {NEXTN_ENV}={raw!r}: expected an integer (0 = off)"
        ) from None
    spec = values.get("speculative")
    if isinstance(spec, str):
        spec = json.loads(spec) if spec.strip() else None
    if n == 0:
        values["speculative"] = None
    else:
        spec = dict(spec) if isinstance(spec, Mapping) else (spec.model_dump() if spec is not None else {})
        values["speculative"] = {**spec, "max_draft_tokens": n}
    origin["speculative"] = f"environment variable {NEXTN_ENV}"


def apply_varlen_env(env: Mapping[str, str], values: dict[str, Any], origin: dict[str, str]) -> None:
    """``DEEPINFER_ENABLE_MTP_VARLEN=0|1``: ``speculative.varlen``, when speculative decoding is
    on (from any source) and ``varlen`` was not given there explicitly; ignored otherwise."""
    raw = env.get(VARLEN_ENV)
    if raw is None or not raw.strip():
        return
    if raw.strip() not in ("0", "1"):
        raise ConfigError(f"environment variable {VARLEN_ENV}={raw!r}: expected 0 or 1")
    spec = values.get("speculative")
    if isinstance(spec, str):
        spec = json.loads(spec) if spec.strip() else None
    if isinstance(spec, SpeculativeConfig):
        spec = None if "varlen" in spec.model_fields_set else spec.model_dump(exclude={"varlen"})
    if not isinstance(spec, Mapping) or "varlen" in spec:
        return
    values["speculative"] = {**spec, "varlen": raw.strip() == "1"}
    origin.setdefault("speculative", f"environment variable {VARLEN_ENV}")


def env_var_name(field: str) -> str:
    """The environment variable of a field: ``max_num_seqs`` -> ``DEEPINFER_MAX_NUM_SEQS``."""
    return ENV_PREFIX + field.upper()


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_values(env: Mapping[str, str], fields: Mapping[str, FieldInfo]) -> dict[str, tuple[Any, str]]:
    """Field values from ``DEEPINFER_<FIELD>`` variables.  Other ``DEEPINFER_*`` variables (plugin
    allow-lists and the like) are not engine fields and are left alone."""
    out: dict[str, tuple[Any, str]] = {}
    for field, info in fields.items():
        var = env_var_name(field)
        if var not in env:
            continue
        raw = env[var].strip()
        optional = not info.is_required() and info.default is None
        if optional and raw.lower() in ("", "none", "null"):
            value: Any = None
        elif info.annotation is bool or info.annotation == (bool | None):
            low = raw.lower()
            if low not in _TRUE | _FALSE:
                raise ConfigError(
                    f"environment variable {var}={raw!r}: expected one of 1/0, true/false, yes/no, on/off"
                )
            value = low in _TRUE
        else:
            value = raw  # pydantic parses numeric strings by field type and reports bad ones
        out[field] = (value, var)
    return out
