"""Structured outputs over corpora (``schema_corpus.py``): 70 JSON schemas, 16 regular expressions
and 14 Lark / GBNF grammars, each generated greedily and with seeded temperature-1.0 sampling on
the built-in tiny model, batched together with unconstrained requests.

What is asserted for every constrained output:

* ``finish_reason == "stop"``: the completion is a full match.  JSON is checked with
  ``jsonschema`` (Draft 2020-12, formats checked: see :data:`FORMATS`), a regex with
  ``re.fullmatch``, a grammar with its own regex or predicate.
* ``finish_reason == "length"`` (the untrained model can write an unbounded string until
  ``max_tokens``): the completion is a valid prefix, i.e. the grammar was followed.  A truncated
  document cannot be validated by ``jsonschema``, so the output tokens are replayed through a
  fresh matcher for the same spec: every token must be accepted (a token the grammar forbids
  puts the matcher in its error state).  The same replay is done for finished outputs, where
  the matcher must also end stopped (the EOS was allowed: the grammar accepted).
* Most outputs finish (at least 80 %), so the checks above are not vacuous.
"""

from __future__ import annotations

import json
import re
from datetime import date

import pytest

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip(
    "jsonschema",
    reason="the schema corpus is validated with jsonschema: pip install -e 'plugins/samplers[test]'",
)

from schema_corpus import GRAMMARS, REGEXES, SCHEMAS, UNSUPPORTED  # noqa: E402

MAX_TOKENS = 400
SEEDS = (0, 1, 2, 3)  # seeded temperature-1.0 samples of each spec, besides the greedy one
PROMPTS = ["Hello", "The answer is", "Give me JSON:", "x"]

# RFC 3339 (date, time, date-time, duration: its Appendix A) and RFC 1123 (hostname) syntax,
# written from the RFCs.  llguidance enforces formats as regular languages, so `date` is checked
# for syntax and ranges, not calendar validity: it lets 2023-02-31 through (a documented
# llguidance departure), where jsonschema's own `date` check (date.fromisoformat) would not.
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_DUR_TIME = r"T([0-9]+H([0-9]+M([0-9]+S)?)?|[0-9]+M([0-9]+S)?|[0-9]+S)"
_DUR_DATE = rf"([0-9]+D|[0-9]+M([0-9]+D)?|[0-9]+Y([0-9]+M([0-9]+D)?)?)({_DUR_TIME})?"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
FORMATS = {
    "date": re.compile(_DATE),
    "time": re.compile(_TIME),
    "date-time": re.compile(rf"{_DATE}[Tt]{_TIME}"),
    "duration": re.compile(rf"P({_DUR_DATE}|{_DUR_TIME}|[0-9]+W)"),
    "hostname": re.compile(rf"{_LABEL}(\.{_LABEL})*"),
}


def _format_checker() -> jsonschema.FormatChecker:
    """jsonschema's checkers (email, ipv4, ipv6, uuid, ...) with :data:`FORMATS` added / replacing
    ``date`` (jsonschema checks date-time, time, duration and hostname only with optional
    packages, which are not installed)."""
    checker = jsonschema.FormatChecker()
    for name, pattern in FORMATS.items():
        checker.checks(name)(lambda value, p=pattern: not isinstance(value, str) or bool(p.fullmatch(value)))
    return checker


FORMAT_CHECKER = _format_checker()


def test_format_checker_checks_what_it_claims():
    bad = {
        "date": "2023-13-01",
        "time": "24:00:00Z",
        "date-time": "2023-01-01 10:00:00Z",
        "duration": "P1H",
        "hostname": "-a.b",
        "email": "no-at-sign",
        "ipv4": "1.2.3.256",
        "ipv6": "1:2:3",
        "uuid": "123",
    }
    good = {
        "date": "2023-02-31",  # syntax only, see FORMATS
        "time": "23:59:60.5+01:00",
        "date-time": "2023-01-01t10:00:00z",
        "duration": "P1Y2M3DT4H5M6S",
        "hostname": "a-b.c9",
        "email": "a@b",
        "ipv4": "10.0.0.1",
        "ipv6": "::1",
        "uuid": "12345678-1234-1234-1234-123456789abc",
    }
    for fmt, value in bad.items():
        assert not FORMAT_CHECKER.conforms(value, fmt), (fmt, value)
        assert FORMAT_CHECKER.conforms(good[fmt], fmt), (fmt, good[fmt])
    assert date.fromisoformat("2023-02-28")  # the stdlib check that `date` deliberately skips


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request) -> LLM:
    from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir

    # the random tiny model: the corpus thresholds were set on it
    return LLM(model=str(builtin_tiny_model_dir()), async_scheduling=request.param)


def _backend(llm: LLM):
    return llm.engine.structured.backend("llguidance")


def _sampling(spec: StructuredOutputsParams | None, seed: int | None, max_tokens: int) -> SamplingParams:
    """Greedy when ``seed`` is None, else seeded sampling at temperature 1.0."""
    temp = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    return SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **temp)


def _run_corpus(llm: LLM, cases: list[tuple[str, StructuredOutputsParams, object]], max_tokens: int):
    """Generate every case greedily and with each of :data:`SEEDS` in one batch, together with
    unconstrained requests; check each output (see the module docstring) and return the
    fraction of constrained outputs that finished with ``stop``."""
    prompts, params, labels = [], [], []
    for i, (name, spec, check) in enumerate(cases):
        for seed in (None, *SEEDS):
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(_sampling(spec, seed, max_tokens))
            labels.append((name, seed, spec, check))
        if i % 20 == 0:  # unconstrained requests mixed in
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(_sampling(None, i, 12))
            labels.append(None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    backend = _backend(llm)
    finished = total = 0
    for label, out in zip(labels, outs, strict=True):
        c = out.outputs[0]
        if label is None:
            assert out.error is None and c.finish_reason == "length" and len(c.token_ids) == 12
            continue
        name, seed, spec, check = label
        where = f"{name} seed={seed}: {c.text!r}"
        assert out.error is None, (where, out.error)
        replay = backend.matcher(spec)
        replay.consume(c.token_ids)
        assert replay.error is None, (where, replay.error)  # every sampled token was allowed
        total += 1
        if c.finish_reason == "stop":
            finished += 1
            assert replay.is_stopped(), where  # the EOS came where the grammar accepts
            check(c.text, where)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == max_tokens, where
            assert not replay.is_stopped(), where
    return finished / total


def _check_json(schema: dict | str):
    validator = jsonschema.Draft202012Validator(
        json.loads(schema) if isinstance(schema, str) else schema, format_checker=FORMAT_CHECKER
    )

    def check(text: str, where: str) -> None:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise AssertionError(f"{where}: not JSON: {e}") from None
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(value)]
        assert not errors, (where, errors)

    return check


def test_schema_corpus_is_varied():
    assert len(SCHEMAS) >= 50 and len({name for name, _ in SCHEMAS}) == len(SCHEMAS)
    text = json.dumps([schema for _, schema in SCHEMAS])
    for keyword in (
        '"minItems"',
        '"maxItems"',
        '"enum"',
        '"anyOf"',
        '"oneOf"',
        '"allOf"',
        '"$ref"',
        '"$defs"',
        '"prefixItems"',
        '"pattern"',
        '"patternProperties"',
        '"exclusiveMinimum"',
        '"exclusiveMaximum"',
        '"minimum"',
        '"maximum"',
        '"multipleOf"',
        '"const"',
        '"additionalProperties": false',
        '"required": []',
        '"type": "boolean"',
        '"type": "null"',
        '"format": "date"',
        '"format": "date-time"',
        '"format": "time"',
        '"format": "duration"',
        '"format": "email"',
        '"format": "hostname"',
        '"format": "ipv4"',
        '"format": "ipv6"',
        '"format": "uuid"',
    ):
        assert keyword in text, keyword
    for _, schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(
            json.loads(schema) if isinstance(schema, str) else schema
        )


@pytest.mark.slow
def test_every_corpus_schema_generates_valid_json(llm):
    cases = [(name, StructuredOutputsParams(json=schema), _check_json(schema)) for name, schema in SCHEMAS]
    assert _run_corpus(llm, cases, MAX_TOKENS) >= 0.8


def _check_regex(pattern: str):
    def check(text: str, where: str) -> None:
        assert re.fullmatch(pattern, text), where

    return check


def _check_grammar(expected):
    def check(text: str, where: str) -> None:
        assert re.fullmatch(expected, text) if isinstance(expected, str) else expected(text), where

    return check


@pytest.mark.slow
def test_regex_and_grammar_corpora_generate_full_matches(llm):
    cases = [
        (name, StructuredOutputsParams(regex=pattern), _check_regex(pattern)) for name, pattern in REGEXES
    ]
    cases += [
        (name, StructuredOutputsParams(grammar=grammar), _check_grammar(expected))
        for name, grammar, expected in GRAMMARS
    ]
    assert len(REGEXES) >= 10 and len(GRAMMARS) >= 10
    assert _run_corpus(llm, cases, 64) >= 0.8


def test_grammar_checks_reject_what_they_should():
    checks = {name: _check_grammar(expected) for name, _, expected in GRAMMARS}
    for name, text in [
        ("lark_arith", "1+"),
        ("lark_arith", "2**3"),
        ("lark_balanced", "(]"),
        ("lark_embedded_json", 'Result: {"n": 1.5}'),
        ("gbnf_string_list", '["a",]'),
    ]:
        with pytest.raises(AssertionError):
            checks[name](text, name)


@pytest.mark.parametrize(("name", "schema"), UNSUPPORTED, ids=[name for name, _ in UNSUPPORTED])
def test_unsupported_schema_keywords_fail_only_that_request(llm, name, schema):
    params = [_sampling(StructuredOutputsParams(json=schema), None, 8), _sampling(None, None, 4)]
    outs = llm.generate(["Hello"] * 2, params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "Unimplemented keys" in outs[0].error, outs[
        0
    ].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
