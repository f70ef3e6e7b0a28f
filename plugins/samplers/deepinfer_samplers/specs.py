"""What the grammar backends share about a ``StructuredOutputsParams`` spec: its JSON schema as
canonical text and the key its compiled grammar is cached under."""

from __future__ import annotations

import json
from typing import Any


def json_text(schema: dict[str, Any] | str, backend: str) -> str:
    """``schema`` as compact JSON text, its key order kept (the backends emit an object's
    properties in the schema's order, so reordering keys would change the grammar); a str that
    is not valid JSON is returned unchanged (the compile reports it).  Raises
    :class:`ValueError`, naming ``backend``, for a dict that is not JSON-serialisable."""
    if isinstance(schema, str):
        try:
            return json.dumps(json.loads(schema), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except ValueError:
            return schema
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{backend}: the JSON schema is not JSON-serialisable: {e}") from None


def cache_key(spec: Any, json_options: Any, backend: str) -> tuple[str, ...]:
    """The canonical cache key of ``spec``: its kind and canonical text, plus for JSON the
    backend's whitespace options ``json_options`` (any JSON-able value); ``json=dict`` and
    ``json=`` its JSON text share a key."""
    if spec.choice is not None:
        return ("choice", json.dumps(list(spec.choice)))
    if spec.regex is not None:
        return ("regex", spec.regex)
    if spec.grammar is not None:
        return ("grammar", spec.grammar)
    return ("json", json_text(spec.json, backend), json.dumps(json_options, sort_keys=True))
