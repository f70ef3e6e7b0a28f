"""The llguidance backend's compiled-grammar cache: keys, hits and misses, independent copies,
the LRU bound, cached errors."""

from __future__ import annotations

import json

import pytest

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

from deepinfer_samplers.llguidance_backend import (  # noqa: E402
    DEFAULT_CACHE_SIZE,
    CacheInfo,
    LLGuidanceBackend,
    cache_key,
)

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture
def backend(llm) -> LLGuidanceBackend:
    """The engine's backend with an empty cache and the default bound."""
    be = llm.engine.structured.backend("llguidance")
    be.cache_size = DEFAULT_CACHE_SIZE
    be.cache_clear()
    yield be
    be.cache_size = DEFAULT_CACHE_SIZE
    be.cache_clear()


def _mask(matcher) -> list[int]:
    return matcher.allowed_token_ids()


def _tokens(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_bos=False)


def test_repeated_spec_hits_the_cache(backend):
    assert backend.cache_info() == CacheInfo(hits=0, misses=0, size=0, maxsize=DEFAULT_CACHE_SIZE)
    backend.matcher(StructuredOutputsParams(json=SCHEMA))
    backend.matcher(StructuredOutputsParams(json=SCHEMA))
    # the same schema as JSON text (other spacing) shares the key
    backend.matcher(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2)))
    backend.matcher(StructuredOutputsParams(regex="[0-9]+"))
    backend.matcher(StructuredOutputsParams(regex="[0-9]+"))
    assert backend.cache_info() == CacheInfo(hits=3, misses=2, size=2, maxsize=DEFAULT_CACHE_SIZE)


@pytest.mark.slow
def test_engine_requests_share_one_compile(llm, backend):
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured_outputs=spec) for s in range(6)
    ]
    outs = llm.generate(["Hello"] * 6, params, use_tqdm=False)
    assert all(o.error is None for o in outs)
    info = backend.cache_info()
    assert (info.misses, info.hits, info.size) == (1, 5, 1)
    llm.generate(["Hi"], params[:1], use_tqdm=False)
    assert backend.cache_info().hits == 6


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # llguidance emits properties in the schema's order: key order is part of the key
        (
            {"json": {"type": "object", "properties": {"a": {}, "b": {}}}},
            {"json": {"type": "object", "properties": {"b": {}, "a": {}}}},
        ),
        ({"json": SCHEMA}, {"json": SCHEMA, "disable_any_whitespace": True}),
        ({"json": SCHEMA}, {"json": SCHEMA, "whitespace_pattern": " ?"}),
        ({"regex": "a"}, {"grammar": "a"}),
        ({"choice": ["a", "b"]}, {"choice": ["b", "a"]}),
        ({"regex": "a|b"}, {"regex": "b|a"}),
    ],
)
def test_different_specs_have_different_keys(a, b):
    assert cache_key(StructuredOutputsParams(**a)) != cache_key(StructuredOutputsParams(**b))


def test_equal_specs_have_equal_keys():
    text = json.dumps(SCHEMA, indent=4)
    assert cache_key(StructuredOutputsParams(json=SCHEMA)) == cache_key(StructuredOutputsParams(json=text))
    # the default whitespace written out is the default
    from deepinfer_core.sampling.params import DEFAULT_JSON_WHITESPACE

    explicit = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=DEFAULT_JSON_WHITESPACE)
    assert cache_key(explicit) == cache_key(StructuredOutputsParams(json=SCHEMA))


def test_copies_are_independent(llm, backend):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    first, second = backend.matcher(spec), backend.matcher(spec)
    assert backend.cache_info().hits == 1
    start = _mask(first)
    first.consume(_tokens(llm, '{"n":12'))
    assert first.error is None and _mask(first) != start
    assert _mask(second) == start  # the second copy has not moved
    second.consume(_tokens(llm, '{"n":3,"ok":true}') + list(llm.engine.eos_token_ids))
    assert second.error is None and second.is_stopped()
    assert not first.is_stopped() and first.error is None
    # a third copy starts from the beginning: the cached matcher was never advanced
    third = backend.matcher(spec)
    assert _mask(third) == start and not third.is_stopped()


def test_same_schema_requests_advance_separately_in_one_batch(llm, backend):
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured_outputs=spec) for s in range(8)
    ]
    params.insert(3, SamplingParams(temperature=0, max_tokens=5))
    outs = llm.generate(["Hello", "Hi", "x", "y", "z", "Hello", "Hi", "x", "y"], params, use_tqdm=False)
    texts = []
    for i, out in enumerate(outs):
        if i == 3:
            assert len(out.outputs[0].token_ids) == 5
            continue
        assert out.error is None and out.outputs[0].finish_reason == "stop", out.outputs[0].text
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 999 and isinstance(value["ok"], bool)
        texts.append(out.outputs[0].text)
    assert len(set(texts)) > 1  # the copies did not share state: the seeded samples differ
    assert backend.cache_info().misses == 1


def test_lru_bound_evicts_the_least_recently_used(backend):
    backend.cache_size = 2
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    backend.matcher(a)
    backend.matcher(b)
    backend.matcher(a)  # a is now the most recently used
    backend.matcher(c)  # evicts b
    assert backend.cache_info() == CacheInfo(hits=1, misses=3, size=2, maxsize=2)
    backend.matcher(a)
    assert backend.cache_info().hits == 2
    backend.matcher(b)  # compiled again, evicts c
    assert backend.cache_info().misses == 4
    backend.matcher(c)
    assert backend.cache_info().misses == 5
    backend.cache_size = 1  # lowering the bound evicts on the next call
    backend.matcher(c)
    assert backend.cache_info() == CacheInfo(hits=3, misses=5, size=1, maxsize=1)


def test_cache_size_zero_disables_the_cache(backend):
    backend.cache_size = 0
    spec = StructuredOutputsParams(regex="[a-z]{3}")
    m1, m2 = backend.matcher(spec), backend.matcher(spec)
    assert backend.cache_info() == CacheInfo(hits=0, misses=2, size=0, maxsize=0)
    assert _mask(m1) == _mask(m2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"regex": "[0-9"},
        {"grammar": "start: ("},
        {"grammar": "root ::= ("},
        {"json": "{not json"},
        {"json": {"type": "array", "uniqueItems": True}},
        {"json": "false"},
    ],
    ids=["regex", "lark", "gbnf", "json-text", "json-unsupported", "json-false"],
)
def test_invalid_spec_is_cached_as_its_error(backend, kwargs):
    spec = StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError) as first:
        backend.matcher(spec)
    with pytest.raises(ValueError) as second:
        backend.matcher(spec)
    assert str(first.value) and str(first.value) == str(second.value)
    assert backend.cache_info() == CacheInfo(hits=1, misses=1, size=1, maxsize=DEFAULT_CACHE_SIZE)


def test_repeated_invalid_spec_fails_each_request_with_the_same_message(llm, backend):
    spec = StructuredOutputsParams(regex="[0-9")
    params = [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec),
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec),
    ]
    outs = llm.generate(["Hello"] * 3, params, use_tqdm=False)
    errors = [outs[0].error, outs[2].error]
    assert all(o.outputs[0].finish_reason == "error" for o in (outs[0], outs[2]))
    assert "invalid regex" in errors[0]
    # the messages differ only in the request id
    assert errors[0].split(": ", 1)[1] == errors[1].split(": ", 1)[1]
    assert len(outs[1].outputs[0].token_ids) == 4
    assert backend.cache_info().hits == 1


def test_true_schema_accepts_any_json(llm, backend):
    params = SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json="true")
    )
    out = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert out.error is None
    if out.outputs[0].finish_reason == "stop":
        json.loads(out.outputs[0].text)


def test_unserialisable_schema_fails_that_request():
    spec = StructuredOutputsParams(json={"type": "object", "x": {1, 2}})
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        cache_key(spec)
