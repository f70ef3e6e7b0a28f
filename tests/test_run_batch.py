"""``run_batch`` / ``deepinfer run-batch`` on the built-in tiny model (reference backend).

Oracles: every response body's texts, finish reasons, usage and logprobs equal what
``LLM.generate`` / ``LLM.chat`` return for the same prompt and parameters; a resumed run's
results equal an uninterrupted run's (a real ``kill -9`` of the command in the slow test).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer_core import SamplingParams
from deepinfer_core.batch import run_batch
from deepinfer_core.batch.id_set import IdSet
from deepinfer_core.batch.results_file import read_finished
from deepinfer_core.cli import main
from deepinfer_core.errors import ConfigError
from deepinfer_core.sampling.params import StructuredOutputsParams

ROOT = Path(__file__).resolve().parents[1]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def line(cid: str, url: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def results(path: Path) -> dict:
    """custom_id -> result line, ``created`` removed (the only field that is not deterministic)."""
    out = {}
    for text in path.read_text().splitlines():
        record = json.loads(text)
        body = (record["response"] or {}).get("body") or {}
        body.pop("created", None)
        out[(record["custom_id"], record["id"])] = record
    return out


def ok_body(record: dict) -> dict:
    assert record["error"] is None, record["error"]
    assert record["response"]["status_code"] == 200
    return record["response"]["body"]


def test_bodies_equal_generate_and_chat(llm, tmp_path):
    messages = [{"role": "user", "content": "Hello there"}]
    records = [
        line("chat", CHAT, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2),
        line(
            "multi",
            COMPLETIONS,
            prompt=["The cat", "A dog"],
            max_tokens=4,
            temperature=0.8,
            seed=7,
            n=2,
            logprobs=1,
        ),
        line(
            "ids", COMPLETIONS, prompt=[5, 6, 7], max_tokens=3, temperature=0, top_k=3, repetition_penalty=1.3
        ),
    ]
    out = tmp_path / "out.jsonl"
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", records), out, llm=llm, progress=False)
    assert (summary.completed, summary.failed, summary.skipped, summary.engine_requests) == (3, 0, 0, 6)
    assert summary.exit_status == 0
    got = {cid: ok_body(r) for (cid, _), r in results(out).items()}

    ref = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0, logprobs=2), use_tqdm=False)[0]
    body = got["chat"]
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-1"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref.outputs[0].text}
    assert choice["finish_reason"] == ref.outputs[0].finish_reason
    assert body["usage"] == {
        "prompt_tokens": len(ref.prompt_token_ids),
        "completion_tokens": 5,
        "total_tokens": len(ref.prompt_token_ids) + 5,
    }
    tok = llm.get_tokenizer()
    for entry, token_id, lp in zip(
        choice["logprobs"]["content"], ref.outputs[0].token_ids, ref.outputs[0].logprobs, strict=True
    ):
        assert entry["token"] == tok.decode([token_id], skip_special_tokens=False)
        assert entry["logprob"] == pytest.approx(lp[token_id], abs=1e-4)
        top = sorted(lp.values(), reverse=True)[:2]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top, abs=1e-4)

    params = SamplingParams(max_tokens=4, temperature=0.8, seed=7, n=2, logprobs=1)
    refs = llm.generate(["The cat", "A dog"], params, use_tqdm=False)
    body = got["multi"]
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    expected = [c for r in refs for c in r.outputs]
    assert [c["text"] for c in body["choices"]] == [c.text for c in expected]
    for choice, comp in zip(body["choices"], expected, strict=True):
        values = [lp[t] for t, lp in zip(comp.token_ids, comp.logprobs, strict=True)]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(values, abs=1e-4)
    assert body["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in expected)

    ref = llm.generate(
        {"prompt_token_ids": [5, 6, 7]},
        SamplingParams(max_tokens=3, temperature=0, top_k=3, repetition_penalty=1.3),
        use_tqdm=False,
    )
    assert got["ids"]["choices"][0]["text"] == ref[0].outputs[0].text
    assert got["ids"]["usage"]["prompt_tokens"] == 3


@pytest.mark.slow  # grammar-constrained decoding, four requests (~1 s)
def test_response_format_constrains_the_reply_as_structured_outputs_do(llm, tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    messages = [{"role": "user", "content": "json please"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    records = [
        line("schema", CHAT, messages=messages, max_tokens=24, temperature=0, response_format=fmt),
        line(
            "object",
            COMPLETIONS,
            prompt="{",
            max_tokens=24,
            temperature=0,
            response_format={"type": "json_object"},
        ),
    ]
    out = tmp_path / "out.jsonl"
    run_batch(write_jsonl(tmp_path / "in.jsonl", records), out, llm=llm, progress=False)
    got = {cid: ok_body(r)["choices"][0] for (cid, _), r in results(out).items()}
    spec = StructuredOutputsParams(json=schema)
    ref = llm.chat(
        messages, SamplingParams(max_tokens=24, temperature=0, structured_outputs=spec), use_tqdm=False
    )[0]
    assert got["schema"]["message"]["content"] == ref.outputs[0].text
    content = got["schema"]["message"]["content"]
    assert content.lstrip().startswith("{")  # what the schema allows, not what the random model says
    if got["schema"]["finish_reason"] == "stop":
        assert isinstance(json.loads(content)["a"], int)
    spec = StructuredOutputsParams(json={"type": "object"})
    ref = llm.generate(
        "{", SamplingParams(max_tokens=24, temperature=0, structured_outputs=spec), use_tqdm=False
    )[0]
    assert got["object"]["text"] == ref.outputs[0].text


def test_bad_lines_get_error_objects_and_the_others_are_unaffected(llm, tmp_path):
    good = line("good", COMPLETIONS, prompt="Once upon", max_tokens=3, temperature=0)
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "bogus"}}}
    records = [
        good,
        "{not json",
        '["an", "array"]',
        {"method": "POST", "url": COMPLETIONS, "body": {"prompt": "x"}},
        line("good", COMPLETIONS, prompt="again"),
        line("url", "/v1/embeddings", input="x"),
        {"custom_id": "method", "method": "GET", "url": COMPLETIONS, "body": {"prompt": "x"}},
        {"custom_id": "nobody", "method": "POST", "url": COMPLETIONS},
        line("param", COMPLETIONS, prompt="x", temperature=-1),
        line("unknown", COMPLETIONS, prompt="x", frobnicate=1),
        line("long", COMPLETIONS, prompt=[5] * (llm.engine.max_model_len + 1), max_tokens=2),
        line("vocab", COMPLETIONS, prompt=[10**6], max_tokens=2),
        line("schema", CHAT, messages=[{"role": "user", "content": "x"}], response_format=schema),
        line("role", CHAT, messages=[{"role": "wizard", "content": "x"}]),
        "",
        '{"custom_id": "\\ud800", "method": "POST", "url": "/v1/embeddings", "body": {}}',  # lone surrogate
    ]
    out = tmp_path / "out.jsonl"
    summary = run_batch(write_jsonl(tmp_path / "in.jsonl", records), out, llm=llm, progress=False)
    assert (summary.lines, summary.completed, summary.failed) == (15, 1, 14)
    assert summary.exit_status == 1
    got = results(out)
    assert len(got) == 15
    codes = {key: (r["error"] or {}).get("code") for key, r in got.items()}
    assert codes == {
        ("good", "batch_req_1"): None,
        (None, "batch_req_2"): "invalid_json",
        (None, "batch_req_3"): "invalid_line",
        (None, "batch_req_4"): "missing_custom_id",
        ("good", "batch_req_5"): "duplicate_custom_id",
        ("url", "batch_req_6"): "invalid_url",
        ("method", "batch_req_7"): "invalid_method",
        ("nobody", "batch_req_8"): "missing_body",
        ("param", "batch_req_9"): "invalid_parameter",
        ("unknown", "batch_req_10"): "unknown_parameter",
        ("long", "batch_req_11"): "request_failed",
        ("vocab", "batch_req_12"): "request_failed",
        ("schema", "batch_req_13"): "request_failed",
        ("role", "batch_req_14"): "invalid_parameter",
        ("\ud800", "batch_req_16"): "invalid_url",
    }
    for (cid, _), record in got.items():
        if record["error"] is None:
            continue
        message = record["error"]["message"]
        assert message and "\n" not in message
        if cid in (None, "good", "url", "method", "nobody", "\ud800"):  # not a request: no response
            assert record["response"] is None
        else:
            assert record["response"]["status_code"] == 400
            assert record["response"]["body"]["error"]["message"] == message
    assert "max_model_len" in got[("long", "batch_req_11")]["error"]["message"]
    assert "bogus" in got[("schema", "batch_req_13")]["error"]["message"]
    ref = llm.generate("Once upon", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert ok_body(got[("good", "batch_req_1")])["choices"][0]["text"] == ref.outputs[0].text
    # run again: every line is recognised as answered (unnamed and duplicate lines by count)
    again = run_batch(tmp_path / "in.jsonl", out, llm=llm, progress=False)
    assert (again.skipped, again.skipped_failed, again.engine_requests, again.failed) == (15, 14, 0, 0)
    assert results(out) == got


def test_resume_skips_finished_lines_and_cuts_a_torn_last_line(llm, tmp_path, caplog):
    records = [
        line(f"r{i}", COMPLETIONS, prompt=f"prompt {i}", max_tokens=2 + i, temperature=0) for i in range(5)
    ]
    records.append("bad json")
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    full = tmp_path / "full.jsonl"
    run_batch(inp, full, llm=llm, progress=False)
    kept = full.read_text().splitlines(keepends=True)
    assert len(kept) == 6
    part = tmp_path / "part.jsonl"
    part.write_text("".join(kept[:3]) + kept[3][: len(kept[3]) // 2])  # 3 whole lines, a torn 4th
    with caplog.at_level("WARNING", logger="deepinfer.batch"):
        summary = run_batch(inp, part, llm=llm, progress=False)
    assert [r.message for r in caplog.records if "incomplete" in r.message] != []
    assert summary.skipped == 3 and summary.completed + summary.failed == 3
    redone = {json.loads(t)["custom_id"] for t in kept[3:]}
    assert summary.engine_requests == len(redone - {None})  # nothing that was written runs again
    assert results(part) == results(full)
    again = run_batch(inp, part, llm=llm, progress=False)
    assert (again.skipped, again.engine_requests, again.skipped_failed) == (6, 0, 1)
    assert again.exit_status == 1  # the file holds a failed line
    assert results(part) == results(full)


def test_results_file_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("my notes\n")
    with pytest.raises(ConfigError, match="line 1 is not a result line"):
        read_finished(bad)
    bad.write_text("no newline at all")  # torn, but not the start of a result line: kept
    with pytest.raises(ConfigError, match="line 1"):
        read_finished(bad)
    assert bad.read_text() == "no newline at all"


def test_ordered_output_follows_the_input_and_in_flight_stays_bounded(llm, tmp_path, monkeypatch):
    records = [
        line(
            f"r{i}",
            COMPLETIONS,
            prompt=f"p{i}",
            max_tokens=12 if i % 3 == 0 else 1,
            temperature=0,
            ignore_eos=True,
        )
        for i in range(9)
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    engine = llm.engine
    in_engine: list[int] = []
    step = engine.step

    def observed_step():
        in_engine.append(len(engine.scheduler.waiting) + len(engine.scheduler.running))
        return step()

    monkeypatch.setattr(engine, "step", observed_step)
    unordered, ordered = tmp_path / "u.jsonl", tmp_path / "o.jsonl"
    run_batch(inp, unordered, llm=llm, max_in_flight=3, progress=False)
    assert 0 < max(in_engine) <= 3
    order = [json.loads(t)["custom_id"] for t in unordered.read_text().splitlines()]
    assert order.index("r1") < order.index("r0") and sorted(order) == sorted(
        r["custom_id"] for r in records
    )  # completion order
    in_engine.clear()
    run_batch(inp, ordered, llm=llm, max_in_flight=3, ordered=True, progress=False)
    assert 0 < max(in_engine) <= 3
    assert [json.loads(t)["custom_id"] for t in ordered.read_text().splitlines()] == [
        f"r{i}" for i in range(9)
    ]
    assert results(ordered) == results(unordered)


def test_id_set_holds_members_across_merges():
    ids = IdSet()
    for i in range(40_000):  # past two merges into the sorted array
        ids.add(f"id-{i}")
    ids.add("id-5")
    assert len(ids) == 40_000
    assert all(f"id-{i}" in ids for i in range(0, 40_000, 397))
    assert "id-40000" not in ids and "" not in ids


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["-i", "{missing}", "-o", "{out}"], "does not exist"),
        (["-i", "{inp}", "-o", "{tmp}/no/such/dir/out.jsonl"], "does not exist; create it first"),
        (["-i", "{inp}", "-o", "{tmp}"], "is a directory"),
        (["-i", "{inp}", "-o", "{inp}"], "the same file"),
        (["-i", "{inp}", "-o", "{out}", "--max-in-flight", "0"], "--max-in-flight=0"),
        (["-i", "{inp}"], "-o/--output"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys, args, culprit):
    inp = write_jsonl(tmp_path / "in.jsonl", [line("a", COMPLETIONS, prompt="x")])
    subs = {"missing": tmp_path / "nope.jsonl", "out": tmp_path / "out.jsonl", "inp": inp, "tmp": tmp_path}
    status = main(["run-batch", *(a.format(**subs) for a in args)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and culprit in err
    assert not (tmp_path / "out.jsonl").exists()


# ---- end to end: the command, killed and run again -------------------------------------------------


def _command(inp: Path, out: Path) -> list[str]:
    flags = ["--backend", "reference", "--batch-invariant", "--max-in-flight", "4", "--no-progress"]
    return [sys.executable, "-m", "deepinfer_core.cli", "run-batch", "-i", str(inp), "-o", str(out), *flags]


def _env() -> dict:
    paths = [str(ROOT), *(str(ROOT / "plugins" / p) for p in ("samplers", "cuda_sm100", "ascend950"))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_kill_9_then_the_same_command_equals_an_uninterrupted_run(tmp_path):
    """A real ``kill -9`` of ``deepinfer run-batch`` mid-run, then the same command: the results
    equal an uninterrupted run's line for line (keyed by custom_id, ``created`` aside) and the
    second run adds to the engine only the requests whose lines were not written."""
    records = []
    for i in range(40):
        if i % 2:
            records.append(
                line(
                    f"c{i}",
                    CHAT,
                    messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=24,
                    temperature=0,
                    logprobs=True,
                    top_logprobs=2,
                    ignore_eos=True,
                )
            )
        else:
            records.append(
                line(
                    f"t{i}",
                    COMPLETIONS,
                    prompt=f"text {i}",
                    max_tokens=24,
                    temperature=0.9,
                    seed=i,
                    n=2,
                    ignore_eos=True,
                )
            )
    records.insert(7, "garbage")
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    samples = {r["custom_id"]: r["body"].get("n", 1) for r in records if isinstance(r, dict)}

    whole = tmp_path / "whole.jsonl"
    done = subprocess.run(_command(inp, whole), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr  # the garbage line failed
    assert "40 completed, 1 failed, 0 skipped" in done.stderr

    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_command(inp, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 6:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    written = out.read_bytes()
    whole_lines = written[: written.rfind(b"\n") + 1].decode().splitlines()
    assert 6 <= len(whole_lines) < 41
    finished = {json.loads(t)["custom_id"] for t in whole_lines}

    again = subprocess.run(_command(inp, out), env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 1, again.stderr
    assert f"{len(whole_lines)} skipped" in again.stderr
    expected_requests = sum(n for cid, n in samples.items() if cid not in finished)
    assert f" {expected_requests} engine requests" in again.stderr  # nothing written runs twice
    assert results(out) == results(whole)
    assert len(out.read_text().splitlines()) == 41
