"""JSON-schema reading the grammar backends share: where a schema's subschemas are, local
``$ref`` resolution, which JSON types a schema can accept, and the rewrite of a ``oneOf`` whose
branches cannot overlap into the equal ``anyOf``.

A ``oneOf`` accepts a value that matches exactly one branch, an ``anyOf`` one that matches at
least one; when no value can match two branches the two are the same.  The backends prove that
only for some ``oneOf`` s (llguidance by the branches' own ``type`` s, without following
``$ref``; xgrammar by its own analysis) and refuse or approximate the rest, so
:func:`one_of_as_any_of` rewrites every ``oneOf`` it can prove disjoint (:func:`disjoint`:
by JSON type, ``$ref`` s resolved, or by a required property with different constants) before
either backend sees the schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# schema positions holding one subschema, a map of them, or a list of them
_ONE = (
    "additionalProperties", "unevaluatedProperties", "items", "additionalItems", "unevaluatedItems",
    "contains", "propertyNames", "not", "if", "then", "else",
)  # fmt: skip
_MAPS = ("properties", "patternProperties", "dependentSchemas")
_DEFINITIONS = ("$defs", "definitions")
_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf", "items")  # items: the draft-07 tuple form

# the JSON types as disjoint atoms: "integer" is a number with no fraction, "fraction" the rest
ALL_TYPES = frozenset({"null", "boolean", "object", "array", "string", "integer", "fraction"})
_TYPE_ATOMS = {
    "null": frozenset({"null"}),
    "boolean": frozenset({"boolean"}),
    "object": frozenset({"object"}),
    "array": frozenset({"array"}),
    "string": frozenset({"string"}),
    "integer": frozenset({"integer"}),
    "number": frozenset({"integer", "fraction"}),
}
# `$schema` values of drafts where keywords beside `$ref` are ignored (draft 2019-09 on applies them)
_LEGACY_DRAFT = re.compile(r"json-schema\.org/draft-0[3-7]/")


def subschemas(schema: Any, path: str = "#", definitions: bool = True) -> Iterator[tuple[str, Any]]:
    """``(JSON pointer, subschema)`` for each subschema directly inside ``schema`` (a dict; the
    subschemas may be booleans); ``$defs`` / ``definitions`` only with ``definitions``."""
    if not isinstance(schema, dict):
        return
    for kw, value in schema.items():
        if kw in _ONE and isinstance(value, dict | bool):
            yield f"{path}/{kw}", value
        elif kw in _LISTS and isinstance(value, list):
            yield from ((f"{path}/{kw}/{i}", v) for i, v in enumerate(value))
        elif (kw in _MAPS or (definitions and kw in _DEFINITIONS)) and isinstance(value, dict):
            yield from ((f"{path}/{kw}/{_escape(k)}", v) for k, v in value.items())
        elif kw == "dependencies" and isinstance(value, dict):  # draft 7: a schema or a list of names
            yield from ((f"{path}/{kw}/{_escape(k)}", v) for k, v in value.items() if isinstance(v, dict))


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def resolve_ref(root: Any, ref: str) -> Any:
    """The subschema of ``root`` that a document-local ``$ref`` (``#`` or ``#/json/pointer``)
    names, or ``None`` when ``ref`` is not such a reference or names nothing."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def legacy_ref(root: Any) -> bool:
    """Whether ``root`` declares (``$schema``) a draft up to 7, where every keyword beside a
    ``$ref`` is ignored."""
    draft = root.get("$schema") if isinstance(root, dict) else None
    return isinstance(draft, str) and _LEGACY_DRAFT.search(draft) is not None


def type_of(value: Any) -> str:
    """The type atom (:data:`ALL_TYPES`) of a JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "fraction"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def value_types(
    schema: Any, root: Any, legacy: bool = False, _refs: frozenset[str] = frozenset()
) -> frozenset[str]:
    """A superset of the type atoms (:data:`ALL_TYPES`) of the values ``schema`` accepts, read
    from ``type``, ``const``, ``enum``, ``$ref`` (resolved in ``root``; alone with ``legacy``,
    see :func:`legacy_ref`), ``anyOf`` / ``oneOf`` (the union) and ``allOf`` (the
    intersection); every other keyword may only narrow the values, never their types."""
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict):
        return ALL_TYPES
    ref = schema.get("$ref")
    target = resolve_ref(root, ref) if isinstance(ref, str) and ref not in _refs else None
    if target is not None and legacy:
        return value_types(target, root, legacy, _refs | {ref})
    types = ALL_TYPES
    if target is not None:
        types &= value_types(target, root, legacy, _refs | {ref})
    named = schema.get("type")
    if isinstance(named, str):
        named = [named]
    if isinstance(named, list):
        types &= frozenset().union(*(_TYPE_ATOMS.get(t, ALL_TYPES) for t in named if isinstance(t, str)))
    if "const" in schema:
        types &= {type_of(schema["const"])}
    if isinstance(schema.get("enum"), list):
        types &= {type_of(v) for v in schema["enum"]}
    for kw in ("anyOf", "oneOf"):
        if isinstance(schema.get(kw), list):
            types &= frozenset().union(*(value_types(b, root, legacy, _refs) for b in schema[kw]))
    if isinstance(schema.get("allOf"), list):
        for branch in schema["allOf"]:
            types &= value_types(branch, root, legacy, _refs)
    return types


def disjoint(branches: list[Any], root: Any, legacy: bool = False) -> bool:
    """Whether no value can match two of ``branches``: each pair accepts disjoint JSON types, or
    shares only objects and both require a property whose ``const`` / ``enum`` values (or
    types) differ (a discriminated union: ``{"kind": {"const": "cat"}}`` against ``"dog"``)."""
    for i, a in enumerate(branches):
        for b in branches[i + 1 :]:
            common = value_types(a, root, legacy) & value_types(b, root, legacy)
            if common and (common != {"object"} or not _discriminated(a, b, root, legacy)):
                return False
    return True


def _discriminated(a: Any, b: Any, root: Any, legacy: bool) -> bool:
    """Whether two object schemas both require a property that no value satisfies in both."""
    props_a, required_a = _object_view(a, root, legacy)
    props_b, required_b = _object_view(b, root, legacy)
    for name in required_a & required_b:
        pa, pb = props_a.get(name, True), props_b.get(name, True)
        ca, cb = _constants(pa, root), _constants(pb, root)
        if ca is not None and cb is not None and not ca & cb:
            return True
        if not value_types(pa, root, legacy) & value_types(pb, root, legacy):
            return True
    return False


def _object_view(
    schema: Any, root: Any, legacy: bool, _refs: frozenset[str] = frozenset()
) -> tuple[dict, set]:
    """The ``properties`` and ``required`` names of ``schema`` and of what its ``$ref`` names
    (each one holds for every value it accepts)."""
    if not isinstance(schema, dict):
        return {}, set()
    ref = schema.get("$ref")
    target = resolve_ref(root, ref) if isinstance(ref, str) and ref not in _refs else None
    props, required = _object_view(target, root, legacy, _refs | {ref}) if target is not None else ({}, set())
    if target is not None and legacy:
        return props, required
    own = schema.get("properties")
    if isinstance(own, dict):
        props = {**own, **props}
    if isinstance(schema.get("required"), list):
        required |= {n for n in schema["required"] if isinstance(n, str)}
    return props, required


def _constants(schema: Any, root: Any, _refs: frozenset[str] = frozenset()) -> frozenset[Any] | None:
    """The scalar values ``schema`` allows when its ``const`` / ``enum`` (or its ``$ref`` s')
    lists them, numbers as floats (``1`` and ``1.0`` are one JSON value); ``None`` otherwise."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = schema["enum"]
    else:
        ref = schema.get("$ref")
        target = resolve_ref(root, ref) if isinstance(ref, str) and ref not in _refs else None
        return None if target is None else _constants(target, root, _refs | {ref})
    if any(isinstance(v, dict | list) for v in values):
        return None
    return frozenset(
        (type_of(v), float(v)) if type_of(v) in ("integer", "fraction") else (type_of(v), v) for v in values
    )


def one_of_as_any_of(schema: Any) -> Any:
    """``schema`` (parsed JSON, changed in place and returned) with each ``oneOf`` whose branches
    are :func:`disjoint` renamed ``anyOf`` (an equal schema: no value can match two branches),
    keeping the key order; a ``oneOf`` beside an ``anyOf`` is left alone."""
    legacy = legacy_ref(schema)
    found: list[dict[str, Any]] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        one_of = node.get("oneOf")
        if isinstance(one_of, list) and "anyOf" not in node and disjoint(one_of, schema, legacy):
            found.append(node)
        stack.extend(sub for _, sub in subschemas(node))
    for node in found:
        items = list(node.items())
        node.clear()
        node.update(("anyOf" if k == "oneOf" else k, v) for k, v in items)
    return schema


def one_of_as_any_of_text(text: str) -> str:
    """:func:`one_of_as_any_of` on a schema's JSON text, the result as compact JSON text (the
    text unchanged when it is not JSON)."""
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(one_of_as_any_of(schema), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
