"""The ``xgrammar`` structured-output backend (``StructuredOutputsParams(backend="xgrammar")``).

The corpora of ``schema_corpus.py`` run through xgrammar on the built-in tiny model, greedy and
seeded, in one batch with unconstrained requests and llguidance requests, with async
scheduling; every output is checked against an oracle independent of xgrammar (``jsonschema``,
``re.fullmatch``, the grammar's own check).  Regex and grammar outputs are also replayed through
a fresh llguidance matcher for the same spec (every token must be allowed, a finished output
must leave it stopped; the one departure allowed: xgrammar lets a byte-level model spell UTF-16
surrogates encoded as UTF-8, ``ED A0``..``ED BF``, which is not UTF-8 and llguidance refuses, so a
replay may fail only at bytes that are not a UTF-8 prefix, and such a finished output, whose
text holds U+FFFD, is not checked: at most 5 % of them).  JSON outputs are not replayed:
llguidance's JSON strings also exclude U+007F, which JSON allows and xgrammar lets through.
Specs xgrammar cannot enforce exactly are refused per request, with the reason: :data:`REFUSED`
lists the corpus entries and why.  Speculative decoding with the n-gram drafter gives the
tokens of plain decoding (drafts are validated and rolled back).
"""

from __future__ import annotations

import codecs
import json
import re

import pytest

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip(
    "xgrammar", reason="the xgrammar backend is not installed: pip install -e 'plugins/samplers[xgrammar]'"
)
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip(
    "jsonschema", reason="the corpus is validated with jsonschema: pip install -e 'plugins/samplers[test]'"
)

import deepinfer_samplers.plugin as samplers_plugin  # noqa: E402
from schema_corpus import GRAMMARS, REGEXES, SCHEMAS, UNSUPPORTED  # noqa: E402
from test_structured_corpus import _check_grammar, _check_json, _check_regex  # noqa: E402

from deepinfer_core.engine.structured import spec_kind  # noqa: E402
from deepinfer_core.testing import manager_with_plugin  # noqa: E402

SEEDS = (0, 1)
PROMPTS = ["Hello", "The answer is", "Give me JSON:", "x"]
_DROPS_LENGTH = "combined with minLength/maxLength is not supported"
# corpus entries xgrammar 0.2.9 would not enforce exactly: the request fails with this text
REFUSED = {
    "format_email": _DROPS_LENGTH,
    "format_ipv4": "format 'ipv4' (at #) is not implemented",
    "format_hostname": _DROPS_LENGTH,
    "pattern_with_length": _DROPS_LENGTH,
    "object_of_formats": "format 'ipv4' (at #/properties/",
    "person": _DROPS_LENGTH,
    "config_file": _DROPS_LENGTH,
    "all_of_merge": "keywords ['additionalProperties', 'properties'] beside 'allOf' (at #) are ignored",
    "type_with_sibling_any_of": "keywords ['type'] beside 'anyOf' (at #) are ignored",
    "uniqueItems": "keyword 'uniqueItems' (at #) is not implemented",
    "not": "keyword 'not' (at #) is not implemented",
    "if_then": "keyword 'if' (at #) is not implemented",
    "contains": "keyword 'contains' (at #) is not implemented",
    "dependentRequired": "keyword 'dependentRequired' (at #) is not implemented",
    "case_insensitive": "Group modifier flag is not supported",
    "lark_embedded_json": "x-guidance JSON options are llguidance's",
}
# llguidance's "Unimplemented keys" that xgrammar enforces: run and validated like the corpus
XGRAMMAR_ONLY = [(n, s) for n, s in UNSUPPORTED if n not in REFUSED]


def _xg(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(backend="xgrammar", **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir

    return LLM(model=str(builtin_tiny_model_dir()), async_scheduling=True)  # the corpus thresholds' model


def _sampling(spec: StructuredOutputsParams | None, seed: int | None, max_tokens: int) -> SamplingParams:
    temp = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    return SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **temp)


def _run_corpus(llm: LLM, cases, max_tokens: int, replay: bool = True) -> float:
    """Generate every ``(name, spec, check)`` greedily and with each of :data:`SEEDS`, in one
    batch with unconstrained requests and the same specs through llguidance; check each
    output; return the fraction of xgrammar outputs that finished with ``stop``."""
    prompts, params, labels = [], [], []
    for i, (name, spec, check) in enumerate(cases):
        for seed in (None, *SEEDS):
            prompts.append(PROMPTS[i % len(PROMPTS)])
            params.append(_sampling(spec, seed, max_tokens))
            labels.append((name, seed, spec, check))
        if i % 6 == 0:  # an unconstrained request and an llguidance request mixed in
            prompts += [PROMPTS[i % len(PROMPTS)]] * 2
            params.append(_sampling(None, i, 12))
            labels.append(None)
            ll_spec = StructuredOutputsParams(regex=r"[a-z]{1,6}( [a-z]{1,6}){0,3}")
            params.append(_sampling(ll_spec, i, 40))
            labels.append(("llguidance", i, ll_spec, _check_regex(ll_spec.regex)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    llg = llm.engine.structured.backend("llguidance")
    vocab_bytes = llm.engine.structured.backend("xgrammar")._info.decoded_vocab

    def token_bytes(ids: list[int]) -> bytes:
        return b"".join(vocab_bytes[t] for t in ids)

    finished = total = not_utf8 = 0
    for label, out in zip(labels, outs, strict=True):
        c = out.outputs[0]
        if label is None:
            assert out.error is None and (c.finish_reason == "length") == (len(c.token_ids) == 12)
            continue
        name, seed, spec, check = label
        where = f"{name} seed={seed}: {c.text!r}"
        if name in REFUSED:
            assert c.finish_reason == "error" and REFUSED[name] in out.error, (where, out.error)
            kind = spec_kind(spec)
            assert out.error.startswith(f"request {out.request_id!r}: structured outputs: {kind}: xgrammar: ")
            assert "\n" not in out.error
            continue
        assert out.error is None, (where, out.error)
        if name != "llguidance":
            total += 1
            finished += c.finish_reason == "stop"
        replayer = None
        if replay:
            try:
                replayer = llg.matcher(StructuredOutputsParams(**{**_fields(spec), "backend": "llguidance"}))
            except ValueError:  # a spec only xgrammar takes
                replayer = None
        if replayer is not None:
            for k, t in enumerate(c.token_ids):  # every token allowed, as llguidance says ...
                replayer.consume([t])
                if replayer.error is not None:  # ... but bytes that are not UTF-8 (see the docstring)
                    assert not _utf8_prefix(token_bytes(c.token_ids[: k + 1])), (where, replayer.error)
                    replayer = None
                    break
        if c.finish_reason == "stop":
            assert replayer is None or replayer.is_stopped(), where
            if _utf8_prefix(token_bytes(c.token_ids)):
                check(c.text, where)
            else:  # the surrogate departure (module docstring): the text holds U+FFFD, not checkable
                not_utf8 += 1
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == max_tokens, where
    assert not_utf8 <= 0.05 * total, not_utf8
    return finished / total


def _utf8_prefix(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8 or a prefix of it (an unfinished last character)."""
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _fields(spec: StructuredOutputsParams) -> dict:
    names = ("choice", "regex", "json", "grammar", "disable_any_whitespace", "whitespace_pattern")
    return {n: getattr(spec, n) for n in names}


def test_xgrammar_is_registered_and_available():
    manager = manager_with_plugin(samplers_plugin, "samplers")
    row = next(r for r in manager.report() if r["name"] == "samplers")
    entry = next(b for b in row["structured_backends"] if b["name"] == "xgrammar")
    assert entry["available"] is True and entry["reason"] is None


def test_a_missing_xgrammar_is_reported_with_the_reason(monkeypatch):
    monkeypatch.setattr(samplers_plugin, "_XGRAMMAR_MODULES", ("xgrammar", "no_such_module_for_xgrammar"))
    manager = manager_with_plugin(samplers_plugin, "samplers")
    row = next(r for r in manager.report() if r["name"] == "samplers")
    entry = next(b for b in row["structured_backends"] if b["name"] == "xgrammar")
    assert entry["available"] is False
    assert entry["reason"] == (
        "no_such_module_for_xgrammar is not installed: pip install xgrammar==0.2.9, or from the root "
        "of a DeepInfer checkout: pip install -e 'plugins/samplers[xgrammar]'"
    )
    llm = LLM.from_engine(_engine(manager))
    [out] = llm.generate(
        ["Hi"], SamplingParams(max_tokens=4, structured_outputs=_xg(regex="a")), use_tqdm=False
    )
    assert out.outputs[0].finish_reason == "error" and "no_such_module_for_xgrammar" in out.error


def _engine(manager):
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(max_num_seqs=8), plugins=manager)


def test_regex_and_grammar_corpora_generate_full_matches(llm):
    cases = [(n, _xg(regex=p), _check_regex(p)) for n, p in REGEXES]
    cases += [(n, _xg(grammar=g), _check_grammar(expected)) for n, g, expected in GRAMMARS]
    assert _run_corpus(llm, cases, 64) >= 0.8


def _json_cases(schemas):
    return [(n, _xg(json=s), _check_json(s)) for n, s in schemas]


@pytest.mark.slow
def test_json_corpus_subset_and_keywords_only_xgrammar_enforces(llm):
    """Every fifth corpus schema (the rest is the slow test below), plus the schema llguidance
    refuses and xgrammar enforces (``propertyNames``)."""
    assert {n for n, _ in XGRAMMAR_ONLY} == {"propertyNames"}
    picked = SCHEMAS[::5] + [(n, s) for n, s in SCHEMAS if n in REFUSED]
    assert _run_corpus(llm, _json_cases(picked + UNSUPPORTED), 160, replay=False) >= 0.75


@pytest.mark.slow
def test_every_corpus_schema_generates_valid_json(llm):
    assert _run_corpus(llm, _json_cases(SCHEMAS + UNSUPPORTED), 400, replay=False) >= 0.8


def test_choice_with_characters_that_need_escaping(llm):
    choices = ['say "hi"', "back\\slash", "two\nlines", "café ✓", "𝄞 clef", "x"]
    params = [_sampling(_xg(choice=choices), seed, 32) for seed in (None, *range(8))]
    outs = llm.generate(["Pick one:"] * len(params), params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert out.error is None and c.finish_reason == "stop" and c.text in choices, (c.text, out.error)


def test_special_tokens_are_never_allowed_and_eos_only_where_the_grammar_accepts(llm):
    backend = llm.engine.structured.backend("xgrammar")
    tok = llm.get_tokenizer()
    eos = set(llm.engine.eos_token_ids)
    special = set(tok.special_token_ids) - eos
    anything = backend.matcher(_xg(regex=r"(.|\n)*"))
    allowed = set(anything.allowed_token_ids())
    assert eos <= allowed and not special & allowed and len(allowed) > 300
    m = backend.matcher(_xg(regex="[0-9]{2}"))
    assert not eos & set(m.allowed_token_ids())
    m.consume(tok.encode("42", add_bos=False))
    assert set(m.allowed_token_ids()) == eos and not m.is_stopped()
    m.consume(sorted(eos)[:1])
    assert m.is_stopped() and set(m.allowed_token_ids()) == eos


def _token_texts(llm) -> dict[int, str]:
    tok = llm.get_tokenizer()
    return {t: tok.decode([t]) for t in range(llm.engine.model_config.vocab_size)}


def test_json_whitespace_bounded_by_default_and_per_option(llm):
    backend = llm.engine.structured.backend("xgrammar")
    tok = llm.get_tokenizer()
    texts = _token_texts(llm)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def allowed_after(spec, prefix: str) -> set[str]:
        m = backend.matcher(spec)
        m.consume(tok.encode(prefix, add_bos=False))
        assert m.error is None, prefix
        return {texts[t] for t in m.allowed_token_ids()}

    def has_space(allowed: set[str]) -> bool:
        return any(re.match(r"[ \t\n\r]", t) for t in allowed)

    assert has_space(allowed_after(_xg(json=schema), "{   "))
    assert not has_space(allowed_after(_xg(json=schema), "{    "))  # DEFAULT_JSON_WHITESPACE: {0,4}
    assert not has_space(allowed_after(_xg(json=schema, disable_any_whitespace=True), "{"))
    assert not has_space(allowed_after(_xg(json=schema, whitespace_pattern=""), "{"))
    two = _xg(json=schema, whitespace_pattern=r"[\t\r\n ]{0,2}")
    assert has_space(allowed_after(two, "{ ")) and not has_space(allowed_after(two, "{  "))
    assert has_space(allowed_after(_xg(json=schema, whitespace_pattern=r"[ \t\n\r]*"), "{" + " " * 40))


INVALID = [
    ("bad_regex", _xg(regex="[a-"), "Unclosed '['"),
    ("bad_json_text", _xg(json="{not json"), "the JSON schema is not valid JSON"),
    ("schema_false", _xg(json="false"), "accepts no value"),
    ("unknown_format", _xg(json={"type": "string", "format": "zip-code"}), "format 'zip-code' (at #)"),
    (
        "nested_not",
        _xg(json={"type": "object", "properties": {"not": {"not": {"type": "null"}}}}),
        "keyword 'not' (at #/properties/not)",
    ),
    ("number_multiple_of", _xg(json={"type": "number", "multipleOf": 0.5}), "ignoring multipleOf"),
    ("bad_gbnf", _xg(grammar="root ::= missing"), "invalid GBNF grammar"),
    ("lark_priority", _xg(grammar='start: A\nA.2: "a"'), "use backend='llguidance'"),
    (
        "whitespace_class",
        _xg(json={"type": "integer"}, whitespace_pattern=r"[ ]{0,2}"),
        "whitespace_pattern='[ ]{0,2}' is not supported",
    ),
]


def test_an_invalid_or_unenforceable_spec_fails_that_request_alone(llm):
    params = [_sampling(spec, None, 8) for _, spec, _ in INVALID]
    params += [_sampling(None, None, 5), _sampling(_xg(regex="[0-9]{3}"), None, 8)]
    outs = llm.generate(["Hello"] * len(params), params, use_tqdm=False)
    for (name, _, text), out in zip(INVALID, outs, strict=False):
        assert out.outputs[0].finish_reason == "error", name
        assert text in out.error and "xgrammar: " in out.error and "\n" not in out.error, (name, out.error)
    assert outs[-2].error is None and len(outs[-2].outputs[0].token_ids) == 5
    assert outs[-1].error is None and re.fullmatch("[0-9]{3}", outs[-1].outputs[0].text)


def test_check_spec_without_a_tokenizer_refuses_as_the_backend_does(llm):
    """The CLI's check (``check_spec``, no tokenizer) gives each invalid spec the refusal its
    request would get; a valid spec passes it."""
    from deepinfer_core.engine.structured import check_spec
    from deepinfer_core.plugins import get_plugins

    backend = llm.engine.structured.backend("xgrammar")
    for name, spec, _ in INVALID:
        with pytest.raises(ValueError) as checked:
            check_spec(get_plugins(), spec)
        with pytest.raises(ValueError) as refused:
            backend.matcher(spec)
        assert str(checked.value) == str(refused.value), name
    check_spec(get_plugins(), _xg(grammar='start: "a" ("b" | "c")+'))
    check_spec(get_plugins(), _xg(json={"type": "object", "properties": {"a": {"type": "integer"}}}))


def test_compiled_grammars_are_cached_per_spec(llm):
    backend = llm.engine.structured.backend("xgrammar")
    backend.cache_clear()
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    a = backend.matcher(_xg(json=schema))
    b = backend.matcher(_xg(json=json.dumps(schema, indent=2)))  # same key: canonical JSON text
    with pytest.raises(ValueError, match="Unclosed"):
        backend.matcher(_xg(regex="[a-"))
    with pytest.raises(ValueError, match="Unclosed"):
        backend.matcher(_xg(regex="[a-"))
    info = backend.cache_info()
    assert (info.hits, info.misses, info.size) == (2, 2, 2)
    a.consume(llm.get_tokenizer().encode('{"b":', add_bos=False))
    assert a.allowed_token_ids() != b.allowed_token_ids()  # independent states over one grammar


def test_num_valid_and_rollback_restore_the_state(llm):
    """Draft validation leaves the state untouched; consuming then rolling back returns the
    state of never having consumed (same allowed tokens, same later acceptance), also across
    a rejected token and across the finishing EOS."""
    backend = llm.engine.structured.backend("xgrammar")
    tok = llm.get_tokenizer()
    eos = llm.engine.eos_token_ids[0]
    spec = _xg(json={"type": "array", "items": {"type": "integer"}, "maxItems": 3})
    doc = tok.encode("[1,22,3]", add_bos=False) + [eos]
    m = backend.matcher(spec)
    assert m.num_valid(doc) == len(doc) and m.num_consumed == 0
    bad = tok.encode("[1,x", add_bos=False)
    assert m.num_valid(bad) == len(tok.encode("[1,", add_bos=False))
    for k in range(1, len(doc) + 1):
        ref = backend.matcher(spec)
        ref.consume(doc[: len(doc) - k])
        m = backend.matcher(spec)
        m.consume(doc)
        assert m.is_stopped()
        m.consume([5, 6])  # after the EOS: ignored, still rolled back
        m.rollback(k + 2)
        assert m.num_consumed == ref.num_consumed and m.allowed_token_ids() == ref.allowed_token_ids()
        assert m.num_valid(doc[len(doc) - k :]) == k
    m = backend.matcher(spec)
    m.consume(bad)
    assert m.error is not None and m.allowed_token_ids() == []
    m.rollback(1)
    assert m.error is None and m.num_valid(doc[len(bad) - 1 :]) == len(doc) - len(bad) + 1


def _speculative_llm(speculative) -> LLM:
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine

    manager = manager_with_plugin(samplers_plugin, "samplers")
    config = EngineConfig(max_num_seqs=16, speculative=speculative)
    return LLM.from_engine(LLMEngine(config, plugins=manager))


@pytest.mark.parametrize(
    "greedy", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["greedy", "seeded"]
)
def test_speculative_decoding_with_ngram_drafts_equals_plain_decoding(greedy):
    names = {"array_of_ints", "enum_mixed", "lark_key_values", "csv_ints"}
    specs = [(n, _xg(json=s)) for n, s in SCHEMAS if n in names]
    specs += [(n, _xg(grammar=g)) for n, g, _ in GRAMMARS if n in names]
    specs += [(n, _xg(regex=r)) for n, r in REGEXES if n in names]
    specs.append(("llguidance", StructuredOutputsParams(regex="(ab|cd){1,20}")))
    temp = {"temperature": 0} if greedy else {"temperature": 1.0}
    prompts = [f"a b a b {i} {i}" for i in range(len(specs))] + ["one two one two one two"]
    params = [
        SamplingParams(max_tokens=48, seed=i, structured_outputs=spec, **temp)
        for i, (_, spec) in enumerate(specs)
    ] + [SamplingParams(max_tokens=30, seed=99, ignore_eos=True, **temp)]
    ref = _speculative_llm(None).generate(prompts, params, use_tqdm=False)
    spec_llm = _speculative_llm({"drafter": "ngram", "method": "fixed", "max_draft_tokens": 4})
    outs = spec_llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    m = spec_llm.get_metrics()["speculative"]
    assert m["num_accepted_tokens"] < m["num_draft_tokens"], m  # drafts rejected and rolled back
    assert m["num_accepted_tokens"] > 0 or not greedy, m
