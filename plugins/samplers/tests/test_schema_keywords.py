"""No grammar backend drops a JSON-schema keyword: each one is enforced or refused per request.

Every case is a schema using one keyword (or one combination a backend reads specially), a value
it accepts and a value that breaks only that keyword; ``jsonschema`` (the draft the schema
names, else 2020-12, formats checked) is the oracle that says so.  Through each backend's matcher
on the built-in tiny model's tokenizer (the value's tokens, then EOS) the backend either refuses
the schema in one line, or takes the good value and rejects the bad one: a silent drop would take
the bad value.  For xgrammar the case also says which of the two it does (so the cases establish
what xgrammar 0.2.9 enforces), a refusal must name the keyword, its advice to use llguidance
must hold (llguidance then enforces the case), and each refusal must be needed: xgrammar itself
(``Grammar.from_json_schema``, none of the backend's checks) lets the bad value through, warns,
or fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from deepinfer_core import StructuredOutputsParams

xgrammar = pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from deepinfer_samplers import json_schema  # noqa: E402
from deepinfer_samplers.llguidance_backend import LLGuidanceBackend  # noqa: E402
from deepinfer_samplers.xgrammar_backend import XGrammarBackend, _with_native_warnings  # noqa: E402
from test_structured_corpus import FORMAT_CHECKER  # noqa: E402

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
D2019 = "https://json-schema.org/draft/2019-09/schema"
AB = {"a": {"type": "array", "items": {"type": "integer"}}, "b": {"type": "string", "maxLength": 3}}
OBJ = {"o": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
NAME = {"p": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}}}
INT = {"i": {"type": "integer"}}
PETS = {  # a discriminated union's branches, as pydantic writes them
    kind: {
        "type": "object",
        "properties": {"kind": {"const": kind, "type": "string"}, "lives": {"type": "integer"}},
        "required": ["kind", "lives"],
    }
    for kind in ("cat", "dog")
}
LLG = "use backend='llguidance'"


@dataclass(frozen=True)
class Case:
    """A schema, a value it accepts (``None``: it accepts none), one that breaks only the
    keyword, and what xgrammar does: ``None`` = enforces, else its refusal holds this text."""

    name: str
    schema: Any
    good: str | None
    bad: str
    xgrammar_refuses: str | None = None


CASES = [
    # --- enforced by both backends ---------------------------------------------------------------
    Case("type", {"type": "integer"}, "1", '"x"'),
    Case("type_list", {"type": ["string", "null"], "maxLength": 2}, "null", '"abc"'),
    Case("enum", {"enum": ["x", 1]}, "1", "2"),
    Case("enum_with_its_type", {"type": "string", "enum": ["x", "y"]}, '"x"', '"z"'),
    Case("const", {"const": "x"}, '"x"', '"y"'),
    Case("multipleOf_integer", {"type": "integer", "multipleOf": 3}, "6", "7"),
    Case("minimum", {"type": "integer", "minimum": 5}, "5", "4"),
    Case("maximum", {"type": "number", "maximum": 1.5}, "1.5", "1.75"),
    Case("exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 5}, "6", "5"),
    Case("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 1.5}, "1.25", "1.5"),
    Case("minLength", {"type": "string", "minLength": 2}, '"ab"', '"a"'),
    Case("maxLength", {"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    Case("pattern", {"type": "string", "pattern": "^a+$"}, '"aa"', '"ab"'),
    Case("format", {"type": "string", "format": "date"}, '"2020-01-01"', '"2020-1-1"'),
    Case("items", {"type": "array", "items": {"type": "integer"}}, "[1]", '["x"]'),
    Case(
        "items_false", {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1]", "[1,2]"
    ),
    Case("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}]}, "[1]", '["x"]'),
    Case("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1,2]", "[1]"),
    Case("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1,2]"),
    Case("properties", {"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a":1}', '{"a":"x"}'),
    Case(
        "required",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        '{"a":1}',
        "{}",
    ),
    Case(
        "additionalProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        '{"x":1}',
        '{"x":"y"}',
    ),
    Case(
        "patternProperties",
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
        '{"x":1}',
        '{"x":"y"}',
    ),
    Case(
        "minProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
        '{"x":1}',
        "{}",
    ),
    Case(
        "maxProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        '{"x":1}',
        '{"x":1,"y":2}',
    ),
    Case("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "1", "true"),
    Case("oneOf_disjoint_types", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "1", "true"),
    Case(
        "oneOf_disjoint_through_ref",
        {"oneOf": [{"type": "string"}, {"$ref": "#/definitions/o"}], "definitions": OBJ},
        '{"a":1}',
        "{}",
    ),
    Case(
        "oneOf_discriminated_through_refs",
        {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}], "$defs": PETS},
        '{"kind":"cat","lives":1}',
        '{"kind":"cow","lives":1}',
    ),
    Case("oneOf_consts", {"oneOf": [{"const": "a"}, {"const": "b"}]}, '"a"', '"c"'),
    Case("allOf_one_branch", {"allOf": [{"type": "integer"}]}, "1", '"x"'),
    Case("ref", {"$ref": "#/$defs/i", "$defs": INT}, "1", '"x"'),
    Case("ref_beside_annotations", {"$ref": "#/$defs/i", "title": "t", "$defs": INT}, "1", '"x"'),
    Case(
        "ref_beside_ignored_in_draft_07",
        {"$schema": D7, "$ref": "#/definitions/i", "minimum": 5, "definitions": INT},
        "5",
        '"x"',
    ),
    # --- refused by xgrammar: keywords it drops without a word --------------------------------------
    Case("not", {"type": "integer", "not": {"const": 3}}, "2", "3", "keyword 'not' (at #)"),
    Case(
        "if_then",
        {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 9}},
        "5",
        "10",
        "keyword 'if' (at #)",
    ),
    Case(
        "contains",
        {"type": "array", "items": {}, "contains": {"type": "integer"}},
        "[1]",
        "[]",
        "keyword 'contains' (at #)",
    ),
    Case(
        "uniqueItems",
        {"type": "array", "items": {}, "uniqueItems": True},
        "[1,2]",
        "[1,1]",
        "keyword 'uniqueItems' (at #)",
    ),
    Case(
        "dependentRequired",
        {"type": "object", "properties": AB, "dependentRequired": {"a": ["b"]}},
        '{"a":[],"b":"x"}',
        '{"a":[]}',
        "keyword 'dependentRequired' (at #)",
    ),
    Case(
        "dependentSchemas",
        {"type": "object", "properties": AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        '{"a":[],"b":"x"}',
        '{"a":[]}',
        "keyword 'dependentSchemas' (at #)",
    ),
    Case(
        "dependencies_names",
        {"$schema": D7, "type": "object", "properties": AB, "dependencies": {"a": ["b"]}},
        '{"a":[],"b":"x"}',
        '{"a":[]}',
        "keyword 'dependencies' (at #)",
    ),
    Case(
        "dependencies_schema",
        {"$schema": D7, "type": "object", "properties": AB, "dependencies": {"a": {"required": ["b"]}}},
        '{"a":[],"b":"x"}',
        '{"a":[]}',
        "keyword 'dependencies' (at #)",
    ),
    Case(
        "dynamicRef", {"$dynamicRef": "#/$defs/i", "$defs": INT}, "1", '"x"', "keyword '$dynamicRef' (at #)"
    ),
    Case(
        "recursiveRef",
        {
            "$schema": D2019,
            "type": "object",
            "properties": {"c": {"$recursiveRef": "#"}, "n": {"type": "integer"}},
        },
        '{"c":{"n":1}}',
        '{"c":{"n":"x"}}',
        "keyword '$recursiveRef' (at #/properties/c)",
    ),
    Case(
        "required_beside_ref",
        {"$ref": "#/definitions/p", "required": ["name"], "definitions": NAME},
        '{"name":"x"}',
        "{}",
        "keywords ['required'] beside '$ref' (at #) are ignored by xgrammar; move them into the "
        f"referenced schema or {LLG}",
    ),
    Case(
        "required_beside_one_branch_allOf",
        {"allOf": [{"$ref": "#/definitions/p"}], "required": ["name"], "definitions": NAME},
        '{"name":"x"}',
        "{}",
        "keywords ['required'] beside 'allOf' (at #) are ignored by xgrammar; move them into the "
        f"branches or {LLG}",
    ),
    Case(
        "minimum_beside_one_branch_allOf",
        {"allOf": [{"type": "integer"}], "minimum": 5},
        "5",
        "4",
        "keywords ['minimum'] beside 'allOf' (at #)",
    ),
    Case(
        "type_beside_anyOf",
        {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 0}]},
        "5",
        "3",
        "keywords ['type'] beside 'anyOf' (at #)",
    ),
    Case(
        "oneOf_beside_anyOf",
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "oneOf": [{"type": "integer"}, {"type": "boolean"}],
        },
        "1",
        '"x"',
        "keywords ['oneOf'] beside 'anyOf' (at #)",
    ),
    Case(
        "minLength_beside_enum",
        {"enum": ["x", "yy"], "minLength": 2},
        '"yy"',
        '"x"',
        "keywords ['minLength'] beside 'enum' (at #)",
    ),
    Case(
        "type_beside_enum",
        {"type": "string", "enum": ["x", 1]},
        '"x"',
        "1",
        "enum value 1 (at #) is not of type 'string'",
    ),
    Case(
        "type_beside_const",
        {"type": ["integer", "null"], "const": "a"},
        None,
        '"a"',
        "const value 'a' (at #) is not of type",
    ),
    Case(
        "pattern_beside_format",
        {"type": "string", "format": "date", "pattern": "^2"},
        '"2020-01-01"',
        '"1999-01-01"',
        "'pattern' beside 'format' (at #)",
    ),
    Case(
        "required_outside_properties",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["b"],
            "additionalProperties": {"type": "integer"},
        },
        '{"b":1}',
        '{"a":1}',
        "required property 'b' (at #) is not in 'properties'",
    ),
    Case(
        "patternProperties_on_a_declared_name",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "patternProperties": {"^a$": {"minimum": 5}},
        },
        '{"a":5}',
        '{"a":1}',
        "property 'a' (at #) also matches patternProperties '^a$'",
    ),
    Case(
        "propertyNames_beside_properties",
        {"type": "object", "properties": {"aa": {"type": "integer"}}, "propertyNames": {"maxLength": 1}},
        "{}",
        '{"aa":1}',
        "'propertyNames' beside 'properties' (at #)",
    ),
    *(
        Case(f"{kw}_without_type", {kw: value}, good, bad, f"keywords [{kw!r}] without 'type' (at #)")
        for kw, value, good, bad in [
            ("minLength", 2, '"ab"', '"a"'),
            ("maxLength", 1, '"a"', '"ab"'),
            ("pattern", "^a$", '"a"', '"b"'),
            ("format", "date", '"2020-01-01"', '"x"'),
            ("minimum", 5, "5", "4"),
            ("maximum", 5, "5", "6"),
            ("multipleOf", 3, "6", "7"),
            ("minItems", 2, "[1,2]", "[1]"),
            ("maxItems", 1, "[1]", "[1,2]"),
            ("required", ["a"], '{"a":1}', "{}"),
            ("minProperties", 1, '{"a":1}', "{}"),
            ("maxProperties", 1, '{"a":1}', '{"a":1,"b":2}'),
        ]
    ),
    # --- refused by xgrammar: drafts' forms it does not read --------------------------------------
    Case(
        "items_tuple_draft_07",
        {"$schema": D7, "type": "array", "items": [{"type": "integer"}], "additionalItems": False},
        "[1]",
        '["x"]',
        "'items' as an array (at #) is the draft-07 tuple form, which xgrammar does not implement: write it "
        f"as 'prefixItems' (draft 2020-12) or {LLG}",
    ),
    Case(
        "exclusiveMinimum_boolean_draft_04",
        {"$schema": D4, "type": "integer", "minimum": 5, "exclusiveMinimum": True},
        "6",
        "5",
        "boolean 'exclusiveMinimum' (at #) is the draft-04 form",
    ),
    # --- refused by xgrammar: what it drops with a warning ------------------------------------------
    Case(
        "multipleOf_number",
        {"type": "number", "multipleOf": 0.5},
        "1.5",
        "1.25",
        "multipleOf is not supported for type:number",
    ),
    Case(
        "maxLength_beside_format",
        {"type": "string", "format": "date", "maxLength": 5},
        None,
        '"2020-01-01"',
        "format combined with minLength/maxLength",
    ),
    Case(
        "minLength_beside_pattern",
        {"type": "string", "pattern": "^a+$", "minLength": 2},
        '"aa"',
        '"a"',
        "pattern combined with minLength/maxLength",
    ),
    Case(
        "allOf_two_branches",
        {"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 5}]},
        "5",
        "4",
        "allOf with multiple options",
    ),
    Case(
        "oneOf_overlapping",
        {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        "1.5",
        "1",
        "non-provably-disjoint branches",
    ),
    Case(
        "oneOf_overlapping_objects",
        {
            "oneOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": False},
            ]
        },
        '{"a":1}',
        "{}",
        "non-provably-disjoint branches",
    ),
    Case(
        "format_ipv4",
        {"type": "string", "format": "ipv4"},
        '"1.2.3.4"',
        '"1.2.3.000"',
        "format 'ipv4' (at #) is not implemented",
    ),
]


@pytest.fixture(scope="module")
def backends() -> tuple[Any, dict[str, Any]]:
    """The tiny model's tokenizer and one backend of each kind over it."""
    from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
    from deepinfer_core.tokenizer import load_tokenizer

    tok = load_tokenizer(builtin_tiny_model_dir())
    eos = tok.eos_token_ids
    built = {cls.__name__: cls(tok, tok.vocab_size, eos) for cls in (LLGuidanceBackend, XGrammarBackend)}
    return tok, {"llguidance": built["LLGuidanceBackend"], "xgrammar": built["XGrammarBackend"]}


def _valid(schema: Any, text: str) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=FORMAT_CHECKER).is_valid(json.loads(text))


def _takes(tok: Any, matcher: Any, text: str) -> bool:
    """Whether ``matcher`` accepts the tokens of ``text`` and then ends (EOS)."""
    matcher.consume(tok.encode(text, add_bos=False) + tok.eos_token_ids[:1])
    return matcher.error is None and matcher.is_stopped()


def _verdict(backends: tuple[Any, dict[str, Any]], name: str, case: Case) -> str | None:
    """The backend's refusal (one line), or ``None`` after checking that it enforces the case."""
    tok, built = backends
    spec = StructuredOutputsParams(json=case.schema, backend=name)
    try:
        built[name].matcher(spec)
    except ValueError as e:
        assert "\n" not in str(e), (name, str(e))
        return str(e)
    assert not _takes(tok, built[name].matcher(spec), case.bad), (
        f"{name} dropped {case.name}: took {case.bad}"
    )
    if case.good is not None:
        assert _takes(tok, built[name].matcher(spec), case.good), f"{name} refused the valid {case.good}"
    return None


def _raw_xgrammar_takes_the_bad_value(case: Case) -> bool:
    """Whether xgrammar itself, with none of the backend's checks, would not enforce the case:
    its grammar takes the bad value, it warns while converting, or it fails."""
    try:
        grammar, warnings = _with_native_warnings(
            lambda: xgrammar.Grammar.from_json_schema(json.dumps(case.schema))
        )
    except Exception:
        return True
    if warnings:
        return True
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([]), cache_enabled=False).compile_grammar(
        grammar
    )
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(case.bad)) and matcher.is_terminated()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_keyword_is_enforced_or_refused_never_dropped(backends, case):
    assert not _valid(case.schema, case.bad), "the case's bad value must break the schema"
    assert case.good is None or _valid(case.schema, case.good), "the case's good value must be valid"
    llguidance = _verdict(backends, "llguidance", case)  # either backend: refuse or enforce
    refusal = _verdict(backends, "xgrammar", case)
    if case.xgrammar_refuses is None:
        assert refusal is None, refusal
        return
    assert refusal is not None and refusal.startswith("xgrammar: "), refusal
    assert case.xgrammar_refuses in refusal, refusal
    assert _raw_xgrammar_takes_the_bad_value(case), "xgrammar enforces this itself: no need to refuse it"
    if LLG in refusal and case.good is not None:  # the advice holds (for a schema with values)
        assert llguidance is None, llguidance


def test_one_of_as_any_of_renames_only_the_one_ofs_no_value_can_match_twice():
    """Branches disjoint by type once ``$ref`` s are resolved, or objects told apart by a
    required property's constants, become ``anyOf`` (key order kept); overlapping ones (integer
    within number, two objects, one object twice, equal constants) stay; so does a ``oneOf``
    inside a ``const`` value, which is data, not a schema."""
    dog_as = {  # the dog branch with another constant for "kind"
        value: {**PETS["dog"], "properties": {"kind": {"enum": [value]}}} for value in (1.0, "cat")
    }
    schema = {
        "title": "t",
        "oneOf": [{"type": "string"}, {"$ref": "#/$defs/o"}],
        "$defs": {
            "o": {
                "type": "object",
                "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
            },
            "p": {"oneOf": [{"type": "object"}, {"properties": {}}]},
            "c": {"const": {"oneOf": [1, "a"]}},
            "pets": {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]},
            "same": {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/cat"}]},
            "number": {"oneOf": [{"$ref": "#/$defs/cat"}, dog_as[1.0]]},
            "equal": {"oneOf": [{"$ref": "#/$defs/cat"}, dog_as["cat"]]},
            **PETS,
        },
    }
    out = json_schema.one_of_as_any_of(json.loads(json.dumps(schema)))
    assert list(out) == ["title", "anyOf", "$defs"] and out["anyOf"] == schema["oneOf"]
    assert "oneOf" in out["$defs"]["o"]["properties"]["n"] and "oneOf" in out["$defs"]["p"]
    assert out["$defs"]["c"] == schema["$defs"]["c"]
    renamed = {name for name in ("pets", "same", "number", "equal") if "anyOf" in out["$defs"][name]}
    assert renamed == {"pets", "number"}


def test_value_types_follow_refs_and_combinators():
    root = {"$defs": {"i": {"type": "integer"}, "loop": {"$ref": "#/$defs/loop"}}}
    types = json_schema.value_types
    assert types({"$ref": "#/$defs/i"}, root) == {"integer"}
    assert types({"$ref": "#/$defs/loop"}, root) == json_schema.ALL_TYPES  # a cycle: anything
    assert types({"type": "number"}, root) == {"integer", "fraction"}
    assert types({"enum": [1.0, "a", None]}, root) == {"integer", "string", "null"}
    assert types({"anyOf": [{"type": "string"}, {"const": True}]}, root) == {"string", "boolean"}
    assert types({"allOf": [{"type": ["string", "null"]}, {"type": "string"}]}, root) == {"string"}
    assert types({"type": "string", "$ref": "#/$defs/i"}, root) == set()
    assert types({"type": "string", "$ref": "#/$defs/i"}, root, legacy=True) == {"integer"}
