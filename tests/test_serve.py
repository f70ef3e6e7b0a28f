"""``deepinfer serve`` with the official ``openai`` client, on the random tiny model.

A uvicorn server runs the application on a free 127.0.0.1 port in a thread of the test, over
its own ``LLM(backend="reference")``; the oracle is a second, independent ``LLM`` on the same
model: every greedy text the server answers equals ``LLM.generate`` / ``LLM.chat``, and a
stream's pieces add up to the non-streamed text.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.cli import main
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
from deepinfer_core.sampling.params import StructuredOutputsParams

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from deepinfer_core.serve.app import build_app  # noqa: E402
from deepinfer_core.serve.engine_loop import EngineLoop  # noqa: E402
from deepinfer_core.serve.metrics import Histogram  # noqa: E402

KEY = "sk-test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    """``(base url, engine loop)`` of a running server with API key :data:`KEY`."""
    llm = LLM(model=str(builtin_tiny_model_dir()), backend="reference")  # the `llm` fixture's model
    loop = EngineLoop(llm.client)
    app = build_app(loop, MODEL, api_key=KEY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", loop
    srv.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def _drained(loop: EngineLoop) -> bool:
    deadline = time.monotonic() + 30
    while loop.num_requests or loop.client.has_unfinished():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---- fast ------------------------------------------------------------------------------------
def test_histogram_buckets_are_cumulative_counts():
    h = Histogram("x_seconds", "x", buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    h.observe(0.01, times=2)
    lines = h.render()
    assert 'x_seconds_bucket{le="0.1"} 3' in lines
    assert 'x_seconds_bucket{le="1.0"} 5' in lines
    assert 'x_seconds_bucket{le="+Inf"} 6' in lines
    assert "x_seconds_count 6" in lines
    assert any(line.startswith("x_seconds_sum 4.0") for line in lines)


def test_serve_usage_error_is_one_line(capsys):
    assert main(["serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: serve --port=70000: must be in [0, 65535]"]


def test_serve_without_fastapi_prints_the_install_command(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # what an interpreter without it imports
    assert main(["serve"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: serve needs fastapi; install them from a DeepInfer checkout: pip install -e '.[serve]'"
    ]


@pytest.mark.slow
def test_serve_command_answers_and_stops_on_sigint(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "deepinfer_core.cli", "serve", "--backend", "reference", "--port", str(port)]
    env = {**os.environ, "DEEPINFER_API_KEY": KEY}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read() if proc.poll() else ""
            )
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        model = api.models.list().data[0].id
        got = api.completions.create(model=model, prompt="Hi", max_tokens=4, temperature=0)
        assert got.usage.completion_tokens == 4 and got.choices[0].finish_reason == "length"
        assert httpx.get(url + "/v1/models").status_code == 401  # the key came from the environment
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out


# ---- with a server ---------------------------------------------------------------------------
@pytest.mark.slow
def test_completions_and_chat_equal_llm(server, client, llm):
    prompt = "The quick brown fox"
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)

    messages = [{"role": "user", "content": "Say something."}]
    want = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.slow
def test_stream_deltas_add_up_to_the_text(server, client, llm):
    prompt = "Once upon a time"
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    pieces, reasons = [], []
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == want.outputs[0].text
    assert len(pieces) > 2  # it came in pieces
    assert reasons[-1] == want.outputs[0].finish_reason and set(reasons[:-1]) == {None}

    messages = [{"role": "user", "content": "Tell a story."}]
    want = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16, stop=["e "]), use_tqdm=False)[0]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=["e "], stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)


@pytest.mark.slow
def test_stream_logprobs_add_up_to_the_non_streamed_ones(server, client, llm):
    messages = [{"role": "user", "content": "Tell a story."}]
    args = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=["e "])
    whole = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    want = [e.model_dump() for e in whole.choices[0].logprobs.content]
    oracle = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16, stop=["e "]), use_tqdm=False)
    assert len(want) == len(oracle[0].outputs[0].token_ids) and all(len(e["top_logprobs"]) == 2 for e in want)
    chunks = [c for c in client.chat.completions.create(**args, logprobs=True, top_logprobs=2, stream=True)]
    parts = [c.choices[0].logprobs.content for c in chunks if c.choices[0].logprobs is not None]
    assert [e.model_dump() for part in parts for e in part] == want
    assert sum(1 for part in parts if part) > 2  # they came in pieces
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content

    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stop=["e "])
    whole = client.completions.create(**args, logprobs=2).choices[0].logprobs
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pieces = 0
    for chunk in client.completions.create(**args, logprobs=2, stream=True):
        lp = chunk.choices[0].logprobs
        if lp is not None and lp.tokens:
            pieces += 1
            for key, values in got.items():
                values.extend(getattr(lp, key))
    assert got == {key: getattr(whole, key) for key in got}
    assert len(got["tokens"]) > 0 and pieces > 2


@pytest.mark.slow
def test_response_format_json_schema(server, client, llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema)
    )
    messages = [{"role": "user", "content": "JSON please"}]
    want = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    assert got.choices[0].message.content == want
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(want)["a"], int)


@pytest.mark.slow
def test_errors_are_openai_errors(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "max_tokens" and "max_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # refused before the stream starts
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, top_logprobs=99
        )
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    bad = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.get(server[0] + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(server[0] + "/v1/completions", content=b"{", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


@pytest.mark.slow
def test_disconnect_mid_stream_aborts_the_request(server):
    url, loop = server
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    aborted = loop.metrics.requests["abort"]
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
    assert _drained(loop), "the engine still holds the request after the client went away"
    assert loop.metrics.requests["abort"] == aborted + 1
    metrics = httpx.get(url + "/metrics").text
    assert "deepinfer_time_to_first_token_seconds_count" in metrics
    assert 'deepinfer_requests_total{finish_reason="abort"}' in metrics


@pytest.mark.slow
def test_load_with_disconnects_leaks_nothing(server, llm):
    """240 concurrent streams, every fifth dropped after its first chunk: each finished stream
    is whole (its text equals the greedy ``LLM.generate`` one), and afterwards the engine holds
    no request and every cache page is free."""
    import asyncio

    url, loop = server
    prompts = [f"Request number {i} says" for i in range(12)]
    wants = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    want = {p: o.outputs[0].text for p, o in zip(prompts, wants, strict=True)}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(http, i):
        prompt = prompts[i % len(prompts)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        text, done = "", False
        async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if i % 5 == 0:
                        return None  # the client goes away mid-stream
        assert done
        return prompt, text

    async def run():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(240)))

    results = asyncio.run(run())
    finished = [r for r in results if r is not None]
    assert len(finished) == 192
    assert all(text == want[prompt] for prompt, text in finished)
    assert _drained(loop)
    cache = loop.client.runner.kv_cache
    assert cache.num_free_pages == cache.num_pages


@pytest.mark.slow
def test_disconnect_while_waiting_aborts_the_request(server):
    url, loop = server
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    aborted = loop.metrics.requests["abort"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(5, read=0.3))
    assert _drained(loop), "the engine still holds the request after the client went away"
    assert loop.metrics.requests["abort"] == aborted + 1, dict(loop.metrics.requests)


@pytest.mark.slow
def test_n_samples_seeded_equal_llm_streamed_or_not(server, client, llm):
    prompts = ["A cat", "A dog"]
    params = SamplingParams(n=2, seed=7, temperature=1.0, max_tokens=10)
    want = [c.text for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    got = client.completions.create(model=MODEL, prompt=prompts, n=2, seed=7, temperature=1.0, max_tokens=10)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == want
    texts = [""] * 4
    stream = client.completions.create(
        model=MODEL, prompt=prompts, n=2, seed=7, temperature=1.0, max_tokens=10, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == want


@pytest.mark.slow
def test_abort_before_admission_never_reaches_the_engine(llm):
    loop = EngineLoop(llm.client)  # not started: the request waits for the loop thread
    got = []
    loop.add("early", [1, 2, 3], SamplingParams(max_tokens=4), got.append)
    assert loop.num_requests == 1
    loop.abort(["early"])
    assert loop.num_requests == 0 and not llm.client.has_unfinished()
    assert [(d.engine_id, d.output.outputs[0].finish_reason) for d in got] == [("early", "abort")]
    assert loop.metrics.requests["abort"] == 1
    llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)  # the engine's abort list: harmless
