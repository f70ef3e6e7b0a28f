"""A corpus of varied JSON schemas for the structured-outputs tests (``test_schema_corpus.py``).

Each entry is ``(name, schema)``.  Every schema uses only JSON-schema features that llguidance
implements (it rejects the others, e.g. ``uniqueItems``, ``not``, ``if``/``then``,
``contains``, ``propertyNames``, ``dependentRequired``: see :data:`UNSUPPORTED`), and every
value llguidance lets through must validate with ``jsonschema`` (Draft 2020-12, formats
checked as the test module describes).  ``oneOf`` branches are disjoint by type (compiled as
``anyOf``, which is then exact): the backends refuse a ``oneOf`` whose branches may overlap.

Strings are mostly bounded (``maxLength``, ``enum``, ``format``, ``pattern``) so that the
built-in tiny model, which is untrained, finishes a document within the test's token budget;
a few are unbounded on purpose.
"""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer"}
_STR8 = {"type": "string", "maxLength": 8}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A closed object: ``additionalProperties: false``, all properties required by default."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: list[tuple[str, dict[str, Any] | str]] = [
    # --- scalars -------------------------------------------------------------------------
    ("integer", {"type": "integer"}),
    ("number", {"type": "number"}),
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("string_bounded", {"type": "string", "minLength": 2, "maxLength": 6}),
    ("string_unbounded", {"type": "string"}),
    ("type_array_string_or_null", {"type": ["string", "null"], "maxLength": 5}),
    ("type_array_int_or_bool", {"type": ["integer", "boolean"]}),
    ("const_string", {"const": "fixed-value"}),
    ("const_object", {"const": {"a": [1, 2, {"b": None}], "c": True}}),
    ("enum_mixed", {"enum": ["red", 7, None, True, 2.5, [1, "x"], {"k": "v"}]}),
    ("empty_schema_any", {}),
    ("true_schema_as_json_text", "true"),  # a schema may be given as JSON text
    # --- numbers and integers with bounds ------------------------------------------------------
    ("int_min_max", {"type": "integer", "minimum": -5, "maximum": 17}),
    ("int_exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("int_large_range", {"type": "integer", "minimum": 1000, "maximum": 99999}),
    ("int_negative_only", {"type": "integer", "maximum": -1}),
    ("int_multiple_of", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("number_min_max", {"type": "number", "minimum": -1.5, "maximum": 2.25}),
    ("number_exclusive_unit", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("number_min_only", {"type": "number", "minimum": 100}),
    (
        "object_of_bounded_numbers",
        _obj(
            {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
                "alt": {"type": "integer", "exclusiveMinimum": -500, "maximum": 9000},
            }
        ),
    ),
    # --- string formats and patterns ------------------------------------------------------
    ("format_date", {"type": "string", "format": "date"}),
    ("format_date_time", {"type": "string", "format": "date-time"}),
    ("format_time", {"type": "string", "format": "time"}),
    ("format_duration", {"type": "string", "format": "duration"}),
    ("format_email", {"type": "string", "format": "email", "maxLength": 24}),
    ("format_hostname", {"type": "string", "format": "hostname", "maxLength": 20}),
    ("format_ipv4", {"type": "string", "format": "ipv4"}),
    ("format_ipv6", {"type": "string", "format": "ipv6"}),
    ("format_uuid", {"type": "string", "format": "uuid"}),
    ("pattern_code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}),
    ("pattern_hex_color", {"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
    ("pattern_with_length", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3, "maxLength": 7}),
    (
        "object_of_formats",
        _obj(
            {
                "id": {"type": "string", "format": "uuid"},
                "created": {"type": "string", "format": "date-time"},
                "contact": {"type": "string", "format": "email", "maxLength": 20},
                "ip": {"type": "string", "format": "ipv4"},
            }
        ),
    ),
    # --- arrays ---------------------------------------------------------------------------
    ("array_of_ints", {"type": "array", "items": _INT, "maxItems": 6}),
    ("array_min_max_items", {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4}),
    ("array_exact_length", {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "maxItems": 3}),
    ("array_min_items_only", {"type": "array", "items": {"type": "null"}, "minItems": 1}),
    ("array_unbounded_items", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}}),
    ("array_empty_only", {"type": "array", "maxItems": 0}),
    (
        "tuple_prefix_items",
        {
            "type": "array",
            "prefixItems": [{"type": "string", "maxLength": 4}, _INT, {"type": "boolean"}],
            "items": False,
            "minItems": 3,
        },
    ),
    (
        "array_of_arrays",
        {"type": "array", "items": {"type": "array", "items": _INT, "maxItems": 2}, "maxItems": 3},
    ),
    (
        "array_of_objects",
        {"type": "array", "items": _obj({"k": _STR8, "v": _INT}), "minItems": 1, "maxItems": 3},
    ),
    # --- objects: required vs optional, additionalProperties ---------------------------------
    ("object_all_required", _obj({"a": _INT, "b": {"type": "boolean"}, "c": {"type": "null"}})),
    ("object_some_optional", _obj({"name": _STR8, "age": _INT, "nick": _STR8}, required=["name"])),
    ("object_none_required", _obj({"x": _INT, "y": _INT}, required=[])),
    (
        "object_additional_typed",
        {"type": "object", "properties": {"id": _INT}, "required": ["id"], "additionalProperties": _INT},
    ),
    ("object_open", {"type": "object", "properties": {"id": _INT}, "required": ["id"]}),
    (
        "object_pattern_properties",
        {
            "type": "object",
            "patternProperties": {"^x_[a-z]{1,3}$": {"type": "integer"}},
            "additionalProperties": False,
            "maxProperties": 3,
        },
    ),
    ("object_min_properties", {"type": "object", "additionalProperties": _INT, "minProperties": 1}),
    (
        "object_nested_three_levels",
        _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": 0}, "d": {"enum": ["p", "q"]}})})}),
    ),
    (
        "object_with_enum_and_const",
        _obj({"kind": {"const": "event"}, "level": {"enum": ["debug", "info", "warn", "error"]}}),
    ),
    (
        "object_with_nullable",
        _obj({"value": {"type": ["integer", "null"]}, "note": {"type": ["string", "null"], "maxLength": 6}}),
    ),
    (
        "object_with_booleans_and_nulls",
        _obj({"enabled": {"type": "boolean"}, "deleted": {"const": False}, "parent": {"type": "null"}}),
    ),
    # --- composition -------------------------------------------------------------------------
    ("any_of_scalars", {"anyOf": [_INT, {"type": "string", "maxLength": 4}, {"type": "null"}]}),
    (
        "any_of_objects",
        {
            "anyOf": [
                _obj({"type": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}),
                _obj({"type": {"const": "rect"}, "w": _INT, "h": _INT}),
            ]
        },
    ),
    ("one_of_disjoint", {"oneOf": [{"type": "integer", "maximum": -1}, {"type": "string", "maxLength": 3}]}),
    (
        "all_of_merge",
        {
            "allOf": [
                {"type": "object", "properties": {"a": _INT}, "required": ["a"]},
                {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
            ],
            "additionalProperties": False,
            "properties": {"a": _INT, "b": {"type": "boolean"}},
        },
    ),
    ("type_with_sibling_any_of", {"type": "integer", "anyOf": [{"minimum": 50}, {"maximum": -50}]}),
    # --- $ref / $defs ------------------------------------------------------------------------
    (
        "defs_ref",
        {
            "$defs": {"point": _obj({"x": _INT, "y": _INT})},
            "type": "object",
            "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
            "required": ["from", "to"],
            "additionalProperties": False,
        },
    ),
    (
        "definitions_ref",
        {
            "definitions": {"small": {"type": "integer", "minimum": 0, "maximum": 3}},
            "$ref": "#/definitions/small",
        },
    ),
    (
        "ref_in_array_items",
        {
            "$defs": {"tag": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
            "type": "array",
            "items": {"$ref": "#/$defs/tag"},
            "maxItems": 4,
        },
    ),
    (
        "recursive_linked_list",
        {
            "$defs": {
                "node": _obj(
                    {
                        "v": {"type": "integer", "minimum": 0, "maximum": 9},
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                    }
                )
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "recursive_tree_bounded",
        {
            "$defs": {
                "tree": _obj(
                    {
                        "label": {"enum": ["a", "b", "c"]},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 2},
                    }
                )
            },
            "$ref": "#/$defs/tree",
        },
    ),
    # --- realistic documents --------------------------------------------------------------
    (
        "person",
        _obj(
            {
                "name": {"type": "string", "minLength": 1, "maxLength": 10},
                "age": {"type": "integer", "minimum": 0, "maximum": 130},
                "email": {"type": "string", "format": "email", "maxLength": 20},
                "birthday": {"type": "string", "format": "date"},
                "tags": {"type": "array", "items": _STR8, "maxItems": 3},
            },
            required=["name", "age"],
        ),
    ),
    (
        "order",
        _obj(
            {
                "order_id": {"type": "string", "format": "uuid"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                            "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                        }
                    ),
                },
                "status": {"enum": ["new", "paid", "shipped"]},
                "gift": {"type": "boolean"},
            },
            required=["order_id", "items", "status"],
        ),
    ),
    (
        "tool_call",
        _obj(
            {
                "name": {"enum": ["get_weather", "search", "calculator"]},
                "arguments": {
                    "anyOf": [
                        _obj({"city": _STR8, "unit": {"enum": ["C", "F"]}}),
                        _obj({"query": {"type": "string", "maxLength": 12}}),
                        _obj({"expr": {"type": "string", "pattern": "^[0-9+*/ -]{1,10}$"}}),
                    ]
                },
            }
        ),
    ),
    (
        "config_file",
        _obj(
            {
                "version": {"const": 2},
                "server": _obj(
                    {
                        "host": {"type": "string", "format": "hostname", "maxLength": 16},
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "tls": {"type": "boolean"},
                    },
                    required=["host", "port"],
                ),
                "retries": {"type": "integer", "minimum": 0, "maximum": 5},
                "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
            },
            required=["version", "server"],
        ),
    ),
    (
        "event_log",
        {
            "type": "array",
            "maxItems": 3,
            "items": _obj(
                {
                    "at": {"type": "string", "format": "date-time"},
                    "level": {"enum": ["info", "warn"]},
                    "code": {"type": ["integer", "null"], "minimum": 100, "maximum": 599},
                }
            ),
        },
    ),
]

# keywords llguidance does not implement: a schema using one fails to compile (the request
# fails with "Unimplemented keys"), which is better than silently ignoring it
UNSUPPORTED: list[tuple[str, dict[str, Any]]] = [
    ("uniqueItems", {"type": "array", "items": _INT, "uniqueItems": True}),
    ("not", {"not": {"type": "string"}}),
    ("if_then", {"if": {"type": "integer"}, "then": {"minimum": 0}}),
    ("contains", {"type": "array", "contains": _INT}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}),
]

# --- regular expressions: (name, pattern); the completion must re.fullmatch the pattern (each
# pattern means the same in llguidance's Rust regex syntax and Python's re) --------------------
REGEXES: list[tuple[str, str]] = [
    ("us_phone", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("iso_date", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("time_24h", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("hex_literal", r"0x[0-9A-F]{2,8}"),
    ("alternation_plural", r"(cat|dog|bird)s?"),
    ("dotted_quad", r"([0-9]{1,3}\.){3}[0-9]{1,3}"),
    ("signed_decimal", r"[+-]?[0-9]{1,6}(\.[0-9]{1,3})?"),
    ("identifier", r"[A-Za-z_][A-Za-z0-9_]{0,11}"),
    ("csv_ints", r"[0-9]{1,3}(,[0-9]{1,3}){0,4}"),
    ("simple_email", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)"),
    ("semver", r"(0|[1-9][0-9]?)\.(0|[1-9][0-9]?)\.(0|[1-9][0-9]?)(-(alpha|beta|rc)(\.[0-9])?)?"),
    ("quoted", r'"[^"\\\n]{0,10}"'),
    ("multiline", r"line[0-9]\n(line[0-9]\n){0,2}end"),
    ("case_insensitive", r"(?i:yes|no)!"),
    ("uuid_lower", r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
    ("unbounded_letters", r"[a-z]+"),
]


def _is_arithmetic(text: str) -> bool:
    """``text`` is an arithmetic expression of integer literals, + - * / and parentheses."""
    import ast

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree)) and "**" not in text


def _is_balanced(text: str) -> bool:
    """``text`` is a (possibly empty) sequence of balanced ``()`` / ``[]`` groups."""
    stack: list[str] = []
    for ch in text:
        if ch in "([":
            stack.append(")" if ch == "(" else "]")
        elif not stack or stack.pop() != ch:
            return False
    return not stack


def _is_result_json(text: str) -> bool:
    import json

    if not text.startswith("Result: "):
        return False
    try:
        value = json.loads(text[len("Result: ") :])
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"n"} and type(value["n"]) is int


_ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/
"""

_ARITH_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= "0" | [1-9] [0-9]{0,2}
"""

# --- grammars: (name, Lark or GBNF text, check); check is a regex the completion must
# re.fullmatch, or a predicate on the completion ---------------------------------------------
GRAMMARS: list[tuple[str, str, Any]] = [
    ("lark_arith", _ARITH_LARK, _is_arithmetic),
    ("gbnf_arith", _ARITH_GBNF, _is_arithmetic),
    ("lark_balanced", 'start: group*\ngroup: "(" group* ")" | "[" group* "]"', _is_balanced),
    (
        "lark_key_values",
        'start: item ("," item)*\nitem: KEY "=" VALUE\nKEY: /[a-z]{1,4}/\nVALUE: /[0-9]{1,3}/',
        r"[a-z]{1,4}=[0-9]{1,3}(,[a-z]{1,4}=[0-9]{1,3})*",
    ),
    (
        "lark_sql_select",
        'start: "SELECT " cols " FROM " TABLE ";"\ncols: COL (", " COL)*\nCOL: "id" | "name" | "age"\n'
        "TABLE: /[a-z]{2,6}/",
        r"SELECT (id|name|age)(, (id|name|age))* FROM [a-z]{2,6};",
    ),
    (
        "lark_embedded_json",
        'start: "Result: " %json {"type": "object", "properties": {"n": {"type": "integer"}}, '
        '"required": ["n"], "additionalProperties": false, "x-guidance": {"whitespace_flexible": false, '
        '"item_separator": ",", "key_separator": ":"}}',
        _is_result_json,
    ),
    ("lark_repeat_range", 'start: item ~ 2..3 "."\nitem: "ab" | "cd"', r"(ab|cd){2,3}\."),
    ("lark_case_insensitive", 'start: "select"i " " /[a-z]{1,5}/', r"(?i:select) [a-z]{1,5}"),
    ("lark_optional", 'start: "a" ["b"] "c"? "d"', r"ab?c?d"),
    (
        "lark_ignore_spaces",
        'start: NUM ("+" NUM)*\nNUM: /[0-9]{1,2}/\n%ignore " "',
        r" *[0-9]{1,2}( *\+ *[0-9]{1,2})* *",
    ),
    ("gbnf_classes", 'root ::= [A-Z] [a-z]{2,5} "-" [0-9]{1,3}', r"[A-Z][a-z]{2,5}-[0-9]{1,3}"),
    ("gbnf_negated_class", 'root ::= "<" [^<>]{1,8} ">"', r"<[^<>]{1,8}>"),
    (
        "gbnf_rules",
        'root ::= greeting " " name "!"\ngreeting ::= "hi" | "hello" | "hey"\nname ::= [a-z]{1,6}',
        r"(hi|hello|hey) [a-z]{1,6}!",
    ),
    (
        "gbnf_string_list",
        'root ::= "[" (item ("," item)*)? "]"\nitem ::= "\\"" [a-z]{1,4} "\\""',
        r'\[("[a-z]{1,4}"(,"[a-z]{1,4}")*)?\]',
    ),
]
