"""Which JSON schemas xgrammar 0.2.9 would compile without enforcing them: :func:`unenforced`.

xgrammar reads one part of each schema object and ignores the rest without a word.  It takes the
first of these that the object has: ``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf``,
``allOf``, ``type``, then object keywords (``properties``, ``additionalProperties``,
``unevaluatedProperties``: only objects) or array keywords (``items``, ``prefixItems``,
``unevaluatedItems``: only arrays), else any JSON value.  So every constraining keyword beside
the first six is dropped, and so is every keyword of a schema without ``type`` that falls
through to "any value" (``{"minimum": 5}`` lets ``4`` through).  Within a typed schema it also
drops ``required`` names that are not in ``properties``, ``patternProperties`` for names in
``properties``, ``propertyNames`` for names in ``properties`` and ``pattern`` beside
``format``, and it implements neither ``not``, ``if`` / ``then`` / ``else``, ``contains``,
``uniqueItems``, ``dependentRequired``, ``dependentSchemas``, ``dependencies``,
``$dynamicRef`` nor ``$recursiveRef``.  (What it drops with a warning on its native stderr
is caught by the backend reading those warnings.)  ``plugins/samplers/tests/test_schema_keywords.py``
holds a case per keyword: a value the schema forbids that raw xgrammar lets through.
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer_samplers.json_schema import legacy_ref, resolve_ref, subschemas, type_of

# the JSON-schema `format` values xgrammar 0.2.9 turns into a grammar (others: any string); not
# `ipv4`, whose grammar lets leading zeros through (`1.2.3.000`), which RFC 2673 / jsonschema refuse
FORMATS = frozenset(
    {
        "date-time", "time", "date", "duration", "email", "hostname", "ipv6", "uri",
        "uri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
# keywords xgrammar 0.2.9 compiles without enforcing them, whatever is beside them (`contains`
# lets `[]` through); llguidance does not implement them either
UNENFORCED_KEYWORDS = (
    "not", "if", "then", "else", "contains", "minContains", "maxContains", "uniqueItems",
    "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef", "$recursiveRef",
)  # fmt: skip
# every keyword that constrains a value (the others are annotations: `title`, `$defs`, ...);
# `additionalItems` only counts beside an array `items`, which is refused on its own
CONSTRAINING = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "items", "prefixItems",
        "unevaluatedItems", "maxItems", "minItems", "properties", "patternProperties",
        "additionalProperties", "unevaluatedProperties", "propertyNames", "maxProperties",
        "minProperties", "required", "allOf", "anyOf", "oneOf", "$ref", *UNENFORCED_KEYWORDS,
    }
)  # fmt: skip
# the keywords xgrammar reads instead of everything else, in its order
_EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_OBJECT_KEYWORDS = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems", "unevaluatedItems")
_LLGUIDANCE = "use backend='llguidance'"


def unenforced(schema: Any) -> str | None:
    """Why xgrammar would not enforce ``schema`` without saying so, as one line naming the
    keyword and the JSON pointer of its subschema (the advice says whether llguidance enforces
    it); ``None`` when there is no such problem.  The subschemas the document uses are searched
    (``$ref`` s followed, unused ``$defs`` skipped); a property *named* ``not`` is fine."""
    legacy = legacy_ref(schema)
    seen: set[int] = set()

    def visit(node: Any, path: str) -> str | None:
        if not isinstance(node, dict) or id(node) in seen:
            return None
        seen.add(id(node))
        problem = _problem(node, path, legacy, names=path.endswith("/propertyNames"))
        if problem is not None:
            return problem
        children = list(subschemas(node, path, definitions=False))
        ref = node.get("$ref")
        if isinstance(ref, str) and (target := resolve_ref(schema, ref)) is not None:
            children.append((ref, target))
        for sub_path, sub in children:
            problem = visit(sub, sub_path)
            if problem is not None:
                return problem
        return None

    return visit(schema, "#")


def _problem(node: dict[str, Any], path: str, legacy: bool, names: bool) -> str | None:
    """What xgrammar drops in this schema object itself (its subschemas are visited apart);
    ``names``: it is a ``propertyNames`` schema, which xgrammar reads as a string's."""
    keywords = [k for k in node if k in CONSTRAINING]
    for kw in keywords:
        if kw in UNENFORCED_KEYWORDS and not (kw == "uniqueItems" and node[kw] is False):
            return f"JSON-schema keyword {kw!r} (at {path}) is not implemented (llguidance refuses it too)"
    head = next((k for k in _EXCLUSIVE if k in node), None)
    if head is not None:
        return _beside(node, head, keywords, path, legacy)
    if names and "type" not in node:
        node = {**node, "type": "string"}
    typed = "type" in node or any(k in node for k in _OBJECT_KEYWORDS + _ARRAY_KEYWORDS)
    if not typed:
        if keywords:
            return (
                f"keywords {keywords} without 'type' (at {path}) are ignored by xgrammar; "
                f"add 'type' or {_LLGUIDANCE}"
            )
        return None
    return _typed(node, path)


def _beside(node: dict[str, Any], head: str, keywords: list[str], path: str, legacy: bool) -> str | None:
    """The constraining keywords beside ``head`` (the keyword xgrammar reads alone) that matter."""
    if head == "$ref" and legacy:
        return None  # drafts up to 7 ignore them too
    allowed = {head}
    if head in ("const", "enum"):
        allowed.add("type")
        if head == "const" and isinstance(node.get("enum"), list) and node["const"] in node["enum"]:
            allowed.add("enum")
    extra = [k for k in keywords if k not in allowed]
    if extra:
        where = "into the branches" if head in ("anyOf", "oneOf", "allOf") else "into the referenced schema"
        move = "" if head in ("const", "enum") else f"move them {where} or "
        return f"keywords {extra} beside {head!r} (at {path}) are ignored by xgrammar; {move}{_LLGUIDANCE}"
    if head in ("const", "enum") and "type" in node and isinstance(node.get("enum", []), list):
        values = [node["const"]] if head == "const" else node["enum"]
        named = node["type"] if isinstance(node["type"], list) else [node["type"]]
        for value in values:
            if not _has_type(value, named):
                return (
                    f"{head} value {value!r} (at {path}) is not of type {node['type']!r}, and xgrammar "
                    f"ignores 'type' beside {head!r}; {_LLGUIDANCE}"
                )
    return None


def _has_type(value: Any, named: list[Any]) -> bool:
    atom = type_of(value)
    return any(t == atom or (t == "number" and atom in ("integer", "fraction")) for t in named)


def _typed(node: dict[str, Any], path: str) -> str | None:
    """What xgrammar drops in a schema it reads by type (given or inferred): only the checks of
    the types it may hold."""
    named = node.get("type", "object" if any(k in node for k in _OBJECT_KEYWORDS) else "array")
    types = set(named) if isinstance(named, list) else {named}
    if "array" in types and isinstance(node.get("items"), list):
        return (
            f"'items' as an array (at {path}) is the draft-07 tuple form, which xgrammar does not "
            f"implement: write it as 'prefixItems' (draft 2020-12) or {_LLGUIDANCE}"
        )
    for kw in ("exclusiveMinimum", "exclusiveMaximum"):
        if types & {"integer", "number"} and isinstance(node.get(kw), bool):
            return (
                f"boolean {kw!r} (at {path}) is the draft-04 form, which xgrammar does not implement: "
                f"give the bound as a number (draft 6 and later) or {_LLGUIDANCE}"
            )
    fmt = node.get("format") if "string" in types else None
    if fmt is not None and fmt not in FORMATS:
        return f"JSON-schema format {fmt!r} (at {path}) is not implemented (known: {sorted(FORMATS)})"
    if fmt is not None and "pattern" in node:
        return f"'pattern' beside 'format' (at {path}) is ignored by xgrammar; {_LLGUIDANCE}"
    if "object" not in types:
        return None
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    for name in required:
        if name not in properties:
            return (
                f"required property {name!r} (at {path}) is not in 'properties', and xgrammar enforces "
                f"'required' only for those; add it to 'properties' or {_LLGUIDANCE}"
            )
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    for pattern in patterns:
        name = next((n for n in properties if _may_match(pattern, n)), None)
        if name is not None:
            return (
                f"property {name!r} (at {path}) also matches patternProperties {pattern!r}, which "
                f"xgrammar ignores for the names in 'properties'; {_LLGUIDANCE}"
            )
    if "propertyNames" in node and properties:
        return (
            f"'propertyNames' beside 'properties' (at {path}) is applied by xgrammar only to names "
            "outside 'properties' (llguidance does not implement it): check those names and drop it"
        )
    return None


def _may_match(pattern: str, name: str) -> bool:
    """Whether the ECMA-262 regex ``pattern`` may match somewhere in ``name``: Python's ``re``
    reads the common syntax alike for an ASCII name; a pattern it cannot compile, or a name
    that is not ASCII, counts as a match."""
    if not name.isascii():
        return True
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True
