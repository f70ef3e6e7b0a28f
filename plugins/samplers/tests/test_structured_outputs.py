"""Structured outputs (choice / regex / JSON schema) through the llguidance backend, end to end
on the built-in tiny model."""

from __future__ import annotations

import json
import re
import threading

import pytest

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_core.errors import SamplingParamsError
from deepinfer_core.plugins import get_plugins

pytest.importorskip("llguidance")

CHOICES = ["yes", "no", "maybe"]
PATTERN = r"[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request) -> LLM:
    return LLM(async_scheduling=request.param)


def _params(structured: StructuredOutputsParams | None, greedy: bool, seed: int = 0, **kw) -> SamplingParams:
    temp = {"temperature": 0} if greedy else {"temperature": 1.0, "seed": seed}
    return SamplingParams(max_tokens=kw.pop("max_tokens", 24), structured_outputs=structured, **temp, **kw)


def test_llguidance_backend_is_registered_and_available():
    spec = get_plugins().components["structured_backends"]["llguidance"]
    assert spec.availability() == (True, None)


@pytest.mark.parametrize("greedy", [True, False])
def test_choice_and_regex_mixed_with_unconstrained_requests(llm, greedy):
    params = [
        _params(StructuredOutputsParams(choice=CHOICES), greedy, seed=1),
        _params(None, greedy, seed=2, max_tokens=6),
        _params(StructuredOutputsParams(regex=PATTERN), greedy, seed=3),
        _params(StructuredOutputsParams(choice=CHOICES), greedy, seed=4),
        _params(StructuredOutputsParams(regex=PATTERN), greedy, seed=5),
    ]
    outs = llm.generate(["Hello", "Hello", "The code is", "Hi", "x"], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in CHOICES and texts[3] in CHOICES
    assert re.fullmatch(PATTERN, texts[2]) and re.fullmatch(PATTERN, texts[4]), texts
    for i in (0, 2, 3, 4):
        assert outs[i].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6
    # the unconstrained request is the same as when it runs alone
    alone = llm.generate(["Hello"], [params[1]], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_masks_filled_alongside_the_forward_change_nothing(llm):
    """On the CPU the grammar masks are filled on a worker thread while the forward runs;
    seeded tokens (constrained and not, mixed) equal those of filling them after it, and the
    worker did run."""
    params = [
        _params(StructuredOutputsParams(choice=CHOICES), False, seed=1),
        _params(
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
            False,
            2,
        ),
        _params(None, False, seed=3, max_tokens=12),
        _params(StructuredOutputsParams(regex=PATTERN), False, seed=4),
    ]
    prompts = ["Hello", "Data:", "Hello", "The code is"]
    structured = llm.engine.structured
    if llm.engine.runner.device.type != "cpu":
        pytest.skip("on an accelerator the masks are filled while the launched forward runs")
    assert structured.overlap
    try:
        structured.overlap = False
        after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        structured.overlap = True
    seen = []
    fill_rows = structured._fill_rows

    def recording(*args):
        seen.append(threading.current_thread().name)
        return fill_rows(*args)

    structured._fill_rows = recording
    try:
        alongside = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del structured._fill_rows
    assert alongside == after
    assert seen and all(name.startswith("deepinfer-grammar") for name in seen), seen


def test_seeded_choices_vary_and_stay_valid(llm):
    params = [_params(StructuredOutputsParams(choice=CHOICES), False, seed=s) for s in range(12)]
    texts = [o.outputs[0].text for o in llm.generate(["Hello"] * 12, params, use_tqdm=False)]
    assert set(texts) <= set(CHOICES)


def test_json_schema(llm):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    out = llm.generate(
        ["Hello"], _params(StructuredOutputsParams(json=schema), False, seed=1, max_tokens=64), use_tqdm=False
    )[0]
    assert out.outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(out.outputs[0].text)["a"], int)


# invalid specs: (kind, StructuredOutputsParams fields, the one line after "<kind>: ")
INVALID_SPECS = [
    ("regex", {"regex": "([a-z"}, 'invalid regex "([a-z": unclosed character class'),
    (
        "regex",
        {"regex": "a{3,2}"},
        'invalid regex "a{3,2}": invalid repetition count range, the start must be <= the end',
    ),
    ("grammar", {"grammar": 'start: "a" ('}, "line 1, column 13: Expected token ')', found"),
    ("grammar", {"grammar": "start: foo"}, 'line 1, column 8: unknown name: "foo"'),
    ("grammar", {"grammar": "root ::= missing"}, "invalid GBNF grammar: "),
    ("JSON schema", {"json": {"type": "objekt"}}, "Invalid type: objekt"),
    (
        "JSON schema",
        {"json": {"type": "string", "pattern": "(["}},
        "invalid regex '([': unclosed character class",
    ),
    (
        "JSON schema",
        {"json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        "oneOf whose branches may overlap is not supported",
    ),
]


def test_an_invalid_spec_fails_its_request_alone_in_one_line_naming_the_kind(llm):
    """Each bad spec fails its own request with one line, ``<kind>: <reason>`` (no grammar dump,
    no llguidance-internal grammar), the same reason the CLI's check gives."""
    from deepinfer_core.engine.structured import check_spec

    specs = [StructuredOutputsParams(**fields) for _, fields, _ in INVALID_SPECS]
    params = [_params(spec, True) for spec in specs] + [
        _params(StructuredOutputsParams(choice=CHOICES), True)
    ]
    outs = llm.generate(["Hello"] * len(params), params, use_tqdm=False)
    for (kind, _, message), spec, out in zip(INVALID_SPECS, specs, outs, strict=False):
        prefix = f"request {out.request_id!r}: structured outputs: {kind}: "
        assert out.outputs[0].finish_reason == "error" and out.error.startswith(prefix + message), out.error
        assert "\n" not in out.error and "start:" not in out.error and "^" not in out.error, out.error
        with pytest.raises(ValueError) as checked:
            check_spec(get_plugins(), spec)
        assert str(checked.value) == out.error.removeprefix(prefix)
    assert outs[-1].error is None and outs[-1].outputs[0].text in CHOICES


def test_unknown_backend_fails_at_submission_naming_what_to_install(llm):
    params = [
        _params(StructuredOutputsParams(choice=CHOICES, backend="nope"), True),
        _params(StructuredOutputsParams(choice=CHOICES), True),
    ]
    outs = llm.generate(["Hello"] * 2, params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert (
        "'nope' is not registered" in outs[0].error
        and "pip install -e 'plugins/samplers[structured]'" in outs[0].error
    )
    assert outs[1].outputs[0].text in CHOICES


def test_unavailable_backend_fails_with_the_plugins_reason():
    """A registered but unavailable backend fails its request with the plugin's own reason (which
    names what to install), the other requests unaffected."""
    from deepinfer_core.config import EngineConfig
    from deepinfer_core.engine.llm_engine import LLMEngine
    from deepinfer_core.hookspecs import hookimpl
    from deepinfer_core.testing.managers import manager_with_plugin

    class Unicorn:
        @hookimpl
        def deepinfer_register_structured_backends(self, register):
            register("unicorn", lambda: None, is_available=lambda: (False, "needs unicorn-grammar>=2"))

    import deepinfer_samplers.plugin as samplers_plugin

    manager = manager_with_plugin(samplers_plugin, "samplers")
    manager.add_plugin(Unicorn(), "unicorn_test")
    llm = LLM.from_engine(LLMEngine(EngineConfig(max_num_seqs=4), plugins=manager))
    params = [
        _params(StructuredOutputsParams(choice=CHOICES, backend="unicorn"), True),
        _params(StructuredOutputsParams(choice=CHOICES), True),
    ]
    outs = llm.generate(["Hello"] * 2, params, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[0].error.endswith("'unicorn' is unavailable: needs unicorn-grammar>=2"), outs[0].error
    assert outs[1].outputs[0].text in CHOICES


LARK = 'start: "a" ("b" | "c")+'
GBNF = 'root ::= "a" ("b" | "c")+'
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "color", "tags", "inner"],
    "additionalProperties": False,
}


def _check_nested(obj) -> None:
    """A small explicit validation of NESTED_SCHEMA (without jsonschema: these tests run without
    the `test` extra; test_structured_corpus.py validates with it)."""
    assert isinstance(obj, dict) and set(obj) == {"name", "color", "tags", "inner"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(isinstance(t, int) and not isinstance(t, bool) for t in obj["tags"])
    assert set(obj["inner"]) == {"ok"} and isinstance(obj["inner"]["ok"], bool)


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


@pytest.mark.parametrize("grammar", [LARK, GBNF], ids=["lark", "gbnf"])
def test_grammar_lark_and_gbnf(llm, grammar):
    params = [
        _params(StructuredOutputsParams(grammar=grammar), False, seed=s, max_tokens=12) for s in range(4)
    ]
    outs = llm.generate(["Hello"] * 4, params, use_tqdm=False)
    for out in outs:
        assert out.error is None
        text = out.outputs[0].text
        # a length finish leaves a valid prefix; a stop finish a full match
        assert re.fullmatch("a[bc]*", text), text
        if out.outputs[0].finish_reason == "stop":
            assert re.fullmatch("a[bc]+", text), text


@pytest.mark.slow
@pytest.mark.parametrize(
    "ws",
    [{}, {"disable_any_whitespace": True}, {"whitespace_pattern": " ?"}],
    ids=["default", "none", "pattern"],
)
def test_nested_json_schema_validates_and_whitespace_is_bounded(llm, ws):
    params = [
        _params(StructuredOutputsParams(json=NESTED_SCHEMA, **ws), False, seed=s, max_tokens=200)
        for s in range(4)
    ]
    outs = llm.generate(["Hello"] * 4, params, use_tqdm=False)
    bound = {"default": 4, "none": 0, "pattern": 1}[
        "none" if ws.get("disable_any_whitespace") else "pattern" if ws else "default"
    ]
    for out in outs:
        text = out.outputs[0].text
        assert out.error is None and out.outputs[0].finish_reason == "stop", (text, out.error)
        _check_nested(json.loads(text))
        runs = re.findall(r"\s+", _outside_strings(text))
        assert max((len(r) for r in runs), default=0) <= bound, text


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"choice": ["a"], "regex": "a"},
        {"choice": []},
        {"choice": [""]},
        {"regex": 3},
        {"json": 1},
        {"grammar": ""},
        {"grammar": 3},
        {"regex": "a", "grammar": LARK},
        {"json": {}, "disable_any_whitespace": 1},
        {"json": {}, "whitespace_pattern": 3},
        {"json": {}, "disable_any_whitespace": True, "whitespace_pattern": " "},
    ],
)
def test_structured_outputs_params_validation(kwargs):
    with pytest.raises(SamplingParamsError, match="StructuredOutputsParams"):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_rejects_a_non_structured_outputs_value():
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs={"choice": ["a"]})


def test_cli_choice_and_regex(capsys):
    from deepinfer_core.cli import main

    argv = ["generate", "--prompt", "Hi", "--prompt", "Yo", "--temperature", "0", "--max-tokens", "8"]
    assert main([*argv, "--choice", "A", "--choice", "B", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] in ("A", "B") for r in records] == [True, True]
    assert main([*argv, "--regex", "[0-9]{2}x", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(re.fullmatch("[0-9]{2}x", r["text"]) for r in records)
    assert main([*argv, "--choice", "A", "--regex", "a"]) != 0
    assert "--choice and --regex are mutually exclusive" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_json_schema_and_grammar_files(capsys, tmp_path):
    from deepinfer_core.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(NESTED_SCHEMA))
    lark_file, gbnf_file = tmp_path / "g.lark", tmp_path / "g.gbnf"
    lark_file.write_text(LARK)
    gbnf_file.write_text(GBNF)
    argv = ["generate", "--prompt", "Hi", "--prompt", "Yo", "--temperature", "0", "--json"]
    assert main([*argv, "--max-tokens", "200", "--json-schema", str(schema_file)]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 2
    for r in records:
        _check_nested(json.loads(r["text"]))
    for f in (lark_file, gbnf_file):
        assert main([*argv, "--max-tokens", "8", "--grammar", str(f)]) == 0
        records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(records) == 2 and all(re.fullmatch("a[bc]*", r["text"]) for r in records), records


@pytest.mark.parametrize(
    ("flag", "content", "message"),
    [
        ("--json-schema", None, "cannot read the file"),
        ("--json-schema", "{not json", "not valid JSON"),
        ("--json-schema", "[1]", "must hold a JSON object"),
        ("--grammar", None, "cannot read the file"),
        ("--grammar", "  \n", "the file is empty"),
    ],
)
def test_cli_bad_structured_file_is_one_error_line(capsys, tmp_path, flag, content, message):
    from deepinfer_core.cli import main

    path = tmp_path / "f"
    if content is not None:
        path.write_text(content)
    assert main(["generate", "--prompt", "Hi", flag, str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and flag in err[0] and str(path) in err[0], err
    assert message in err[0]


def test_cli_structured_flags_are_mutually_exclusive(capsys, tmp_path):
    from deepinfer_core.cli import main

    path = tmp_path / "g.lark"
    path.write_text(LARK)
    assert main(["generate", "--prompt", "Hi", "--choice", "A", "--grammar", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--choice and --grammar" in err[0], err


def _cli_spec_args(tmp_path, fields: dict) -> tuple[str, list[str]]:
    """The ``generate`` flag of a spec and its arguments (a file for a schema or a grammar)."""
    if "regex" in fields:
        return "--regex", ["--regex", fields["regex"]]
    path = tmp_path / "spec"
    if "json" in fields:
        path.write_text(json.dumps(fields["json"]))
        return f"--json-schema {path}", ["--json-schema", str(path)]
    path.write_text(fields["grammar"])
    return f"--grammar {path}", ["--grammar", str(path)]


@pytest.mark.parametrize(("kind", "fields", "message"), INVALID_SPECS, ids=[f[2][:24] for f in INVALID_SPECS])
def test_cli_invalid_spec_is_one_error_line_before_the_model_is_looked_at(
    capsys, tmp_path, kind, fields, message
):
    """``--model`` names a directory that does not exist, so the spec's error (status 2, one
    ``error:`` line on stderr naming the flag, nothing on stdout) shows that the spec was compiled
    before the engine looked for a model or a tokenizer."""
    from deepinfer_core.cli import main

    label, args = _cli_spec_args(tmp_path, fields)
    code = main(["generate", "--prompt", "Hi", "--model", str(tmp_path / "no_model"), *args])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    assert captured.err.startswith(f"error: {label}: {message}") and captured.err.count("\n") == 1, (
        captured.err
    )


def test_cli_valid_spec_goes_on_to_the_model(capsys, tmp_path):
    """The counterpart of the test above: a valid spec passes the check, and the missing model
    directory is what fails."""
    from deepinfer_core.cli import main

    missing = tmp_path / "no_model"
    assert main(["generate", "--prompt", "Hi", "--model", str(missing), "--regex", "[a-z]+"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "--regex" not in err, err


def test_check_spec_names_a_backend_that_is_not_registered():
    """Without the samplers plugin the check fails naming the backend and what to install."""
    from deepinfer_core.engine.structured import check_spec
    from deepinfer_core.testing import core_only_manager

    with pytest.raises(
        ValueError, match=r"'llguidance' is not registered .*from the root of a DeepInfer checkout"
    ):
        check_spec(core_only_manager(), StructuredOutputsParams(regex="a"))
