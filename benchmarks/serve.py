"""``deepinfer serve`` against ``LLM.generate``: output tok/s, TTFT, ITL and CPU seconds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deepinfer_core.benchmarking import harness as h  # noqa: E402


def summary(tokens: int, seconds: float, ttft: list[float], itl: list[float]) -> dict:
    """Output tok/s and the p50 / p90 (nearest rank, ms) of TTFT and ITL."""
    out = {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds}
    for name, xs in (("ttft", sorted(ttft)), ("itl", sorted(itl))):
        for q in (50, 90):
            out[f"{name}_p{q}_ms"] = 1e3 * xs[min(len(xs) - 1, q * len(xs) // 100)] if xs else None
    return out


def start_server(args) -> tuple[subprocess.Popen, str]:
    """A ``deepinfer serve`` subprocess on a free port; ``(process, base url)`` once healthy."""
    import httpx

    from deepinfer_core.distributed.processes import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_core.cli", "serve", "--port", str(port)]
    for flag in ("backend", "model", "config"):
        cmd += [f"--{flag}", getattr(args, flag)] if getattr(args, flag) else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"error: the server did not start: {(proc.communicate()[1] or '').strip()[-500:]}")


async def one_request(client, prompt: list[int], max_tokens: int) -> tuple:
    """Stream one completion: (output tokens, TTFT s, mean ITL s or None, chunks)."""
    t0, stamps, tokens = time.perf_counter(), [], 0
    stream = await client.completions.create(
        model=None, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices:
            stamps.append(time.perf_counter())
        tokens = chunk.usage.completion_tokens if chunk.usage is not None else tokens
    itl = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None
    return tokens, stamps[0] - t0, itl, len(stamps)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def serve_batch(url: str, pid: int, prompts: list[list[int]], max_tokens: int) -> dict:
    """All ``prompts`` at once through the server (process ``pid``)."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        await one_request(client, prompts[0][:8], 2)  # warm-up (connection, first step)
        t0, server0, client0 = time.perf_counter(), cpu_seconds(pid), time.process_time()
        done = await asyncio.gather(*(one_request(client, p, max_tokens) for p in prompts))
        seconds = time.perf_counter() - t0
        cpu = {"server_cpu_s": cpu_seconds(pid) - server0, "client_cpu_s": time.process_time() - client0}
    itl = [d[2] for d in done if d[2] is not None]
    figures = summary(sum(d[0] for d in done), seconds, [d[1] for d in done], itl)
    return {**figures, **cpu, "chunks": sum(d[3] for d in done)}


def llm_batch(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """All ``prompts`` in one ``LLM.generate`` (TTFT from ``RequestOutput.metrics``)."""
    h.generate(llm, [prompts[0][:8]], h.greedy(2))  # warm-up
    cpu0 = time.process_time()
    outs, seconds = h.generate(llm, prompts, h.greedy(max_tokens))
    cpu, ms = time.process_time() - cpu0, [(len(o.outputs[0].token_ids), o.metrics) for o in outs]
    ttft = [m.ttft for _, m in ms if m is not None and m.ttft is not None]
    itl = [
        (m.last_token_time - m.first_token_time) / (n - 1) for n, m in ms if n > 1 and m and m.last_token_time
    ]
    return {**summary(h.new_tokens(outs), seconds, ttft, itl), "server_cpu_s": cpu}


def main(argv: list[str] | None = None) -> None:
    ap = h.parser(__doc__, "serve", prompt_len=32, max_tokens=64, vocab=500, seed=0)  # prompt ids: [4, VOCAB)
    ap.add_argument("--batches", type=h.positive_ints, default=[1, 64], help="concurrent requests (1,64)")
    ap.add_argument("--backend", default="auto", help="engine backend, server and LLM alike (default auto)")
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("--config", default=None, help="engine config file (.toml / .yaml), server and LLM alike")
    args = h.parse(ap, argv)
    from deepinfer_core import LLM

    prompts = {b: h.random_prompts(b, args.prompt_len, args.seed + b, args.vocab) for b in args.batches}
    rows = []
    proc, url = start_server(args)
    try:
        for b in args.batches:
            h.log(f"server B={b}")
            served = asyncio.run(serve_batch(url, proc.pid, prompts[b], args.max_tokens))
            rows.append({"path": "server", "batch": b, **served})
    finally:
        proc.terminate()
        proc.wait(30)
    llm = LLM(model=args.model, config=args.config, backend=args.backend)
    for b in args.batches:
        h.log(f"LLM.generate B={b}")
        rows.append({"path": "LLM.generate", "batch": b, **llm_batch(llm, prompts[b], args.max_tokens)})
    direct = {r["batch"]: r for r in rows if r["path"] == "LLM.generate"}
    for r in rows:
        r["vs_llm_generate"] = r["output_tok_s"] / direct[r["batch"]]["output_tok_s"]
    cols = "path batch:d output_tokens:d chunks:d seconds:.2f server_cpu_s:.2f client_cpu_s:.2f"
    cols += " output_tok_s:.0f ttft_p50_ms:.1f ttft_p90_ms:.1f itl_p50_ms:.2f itl_p90_ms:.2f"
    h.print_table(rows, cols + " vs_llm_generate:.2f")
    h.write_json(args.output, {"args": vars(args), "backend": llm.client.backend.name, "results": rows})


if __name__ == "__main__":
    h.run_main(main)
