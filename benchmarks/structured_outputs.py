"""Structured outputs (JSON schemas, llguidance) vs unconstrained: throughput and first-token latency."""

from __future__ import annotations

import copy
import dataclasses
import runpy
import statistics
import uuid
from pathlib import Path
from typing import Any

from deepinfer_core.benchmarking import harness as h

CORPUS = Path(__file__).resolve().parents[1] / "plugins" / "samplers" / "tests" / "schema_corpus.py"
SCHEMAS = "person order tool_call config_file event_log object_of_formats array_of_objects"
SCHEMAS = [*SCHEMAS.split(), "object_nested_three_levels"]  # objects, arrays, formats, patterns, anyOf
EQUAL_WORK = {"json": "len-matched", "json-full": "unconstrained"}


def mode_params(mode: str, n: int, schemas: list[dict], max_tokens: int) -> list[Any]:
    """Request ``i`` of ``json`` / ``json-full`` (EOS ignored) gets schema ``i % len(schemas)``."""
    from deepinfer_core import StructuredOutputsParams

    if mode == "unconstrained":
        return [h.greedy(max_tokens)] * n
    json = [StructuredOutputsParams(json=schemas[i % len(schemas)]) for i in range(n)]
    return [h.greedy(max_tokens, ignore_eos=mode == "json-full", structured_outputs=j) for j in json]


def run(llm: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """One timed ``generate``: seconds, tokens, engine steps, lengths, grammars finished."""
    steps0 = llm.get_metrics()["num_steps"]
    outs, seconds = h.generate(llm, prompts, params)
    if errors := [o.error for o in outs if o.error]:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    return {"lengths": lengths, "seconds": seconds, "new_tokens": sum(lengths),
            "tok_s": sum(lengths) / seconds, "steps": llm.get_metrics()["num_steps"] - steps0,
            "min_len": min(lengths), "max_len": max(lengths),
            "grammar_finished": sum(o.outputs[0].finish_reason == "stop" for o in outs)}  # fmt: skip


def measure(
    llm: Any, args: Any, schemas: list[dict], batch: int, n: int, modes: tuple[str, ...]
) -> list[dict]:
    """``n`` requests per mode, the modes interleaved ``--repeats`` times after one warm-up of
    each (every schema compiled and cached); the median run of each mode."""
    prompts = h.corpus_prompts(llm.get_tokenizer(), n, args.prompt_len)
    params = {m: mode_params(m, n, schemas, args.max_tokens) for m in modes if m != "len-matched"}
    warm = {m: run(llm, prompts, p) for m, p in params.items()}
    params["len-matched"] = [h.greedy(k) for k in warm["json"]["lengths"]]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
            runs[m].append(run(llm, prompts, params[m]))
    rows = {}
    for m, rs in runs.items():
        med = sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2]
        med = {k: v for k, v in med.items() if k != "lengths"}
        rows[m] = {"batch": batch, "mode": m, "requests": n, **med,
                   "all_seconds": [r["seconds"] for r in rs],
                   "ms_per_step": 1e3 * med["seconds"] / med["steps"]}  # fmt: skip
    for m, row in rows.items():
        row["slowdown"] = None if m == "unconstrained" else rows["unconstrained"]["tok_s"] / row["tok_s"] - 1
        if (ref := EQUAL_WORK.get(m)) in rows:
            row.update(equal_work_ref=ref, equal_work_slowdown=row["seconds"] / rows[ref]["seconds"] - 1)
        h.log(f"batch {batch:3d} x{n // batch} {m:13s} {row['tok_s']:8.1f} tok/s ({row['steps']} steps)")
    return list(rows.values())


def served(llm: Any, args: Any, schemas: list[dict]) -> list[dict]:
    """Continuous batching: ``--queue-factor`` x B requests given at once, at most B running."""
    rows, modes = [], ("unconstrained", "json", "len-matched")
    for b in args.batch_sizes:
        llm.engine.scheduler.max_num_seqs = b  # the last part: the engine's own is not restored
        rows += measure(llm, args, schemas, b, args.queue_factor * b, modes)
    return rows


def ttft(llm: Any, args: Any, schema: dict) -> dict[str, Any]:
    """TTFT (``RequestOutput.metrics.ttft``, grammar compile included) of one ``max_tokens=1``
    request: a schema new to the engine (a unique title), the same again, and no grammar; the
    llguidance backend's cache hits and misses over each."""
    backend = llm.engine.structured.backend("llguidance")
    prompt = h.corpus_prompts(llm.get_tokenizer(), 1, args.prompt_len)
    samples: dict[str, list] = {"cold": [], "cached": [], "unconstrained": []}

    def one(kind: str, params: Any) -> None:
        before = backend.cache_info()
        (out,), wall = h.generate(llm, prompt, params)
        after = backend.cache_info()
        samples[kind].append((out.metrics.ttft, wall, after.hits - before.hits, after.misses - before.misses))

    h.generate(llm, prompt, h.greedy(1))  # warm-up
    for _ in range(args.ttft_repeats):
        fresh = {**copy.deepcopy(schema), "title": f"bench-{uuid.uuid4().hex}"}
        one("cold", mode_params("json", 1, [fresh], 1)[0])
        one("cached", mode_params("json", 1, [copy.deepcopy(fresh)], 1)[0])
        one("unconstrained", h.greedy(1, ignore_eos=False))
    out: dict[str, Any] = {"schema": "order", "repeats": args.ttft_repeats}
    for kind, s in samples.items():
        out[kind] = {"ttft_ms": 1e3 * statistics.median(x[0] for x in s),
                     "all_ttft_ms": [1e3 * x[0] for x in s],
                     "generate_ms": 1e3 * statistics.median(x[1] for x in s),
                     "cache_hits": sum(x[2] for x in s), "cache_misses": sum(x[3] for x in s)}  # fmt: skip
    return {**out, "cache_info_end": dataclasses.asdict(backend.cache_info())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = h.parser(__doc__, "structured_outputs", max_tokens=64, prompt_len=32, ttft_repeats=7)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("--batch-sizes", type=h.positive_ints, default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per mode and batch (median kept)")
    ap.add_argument(
        "--queue-factor", type=int, default=16, help="served: Q x B requests, B at a time (0: none)"
    )
    args = h.parse(ap, argv)
    from deepinfer_core import LLM

    all_schemas = dict(runpy.run_path(str(CORPUS))["SCHEMAS"])  # the test corpus: not in a package
    schemas = [all_schemas[n] for n in SCHEMAS]
    llm = LLM(model=args.model, max_num_seqs=max(args.batch_sizes))
    cfg = llm.config
    engine = {k: getattr(cfg, k) for k in ("backend", "dtype", "max_num_seqs", "async_scheduling")}
    report: dict[str, Any] = {"args": vars(args), "model": cfg.model, "schemas": SCHEMAS, "engine": engine}
    modes = ("unconstrained", "len-matched", "json", "json-full")
    report["throughput"] = [r for b in args.batch_sizes for r in measure(llm, args, schemas, b, b, modes)]
    report["ttft"] = ttft(llm, args, all_schemas["order"])
    report["served"] = served(llm, args, schemas) if args.queue_factor > 0 else []
    cols = "batch:d mode requests:d seconds:.3f new_tokens:d tok_s:.1f steps:d ms_per_step:.2f slowdown:+.1%"
    cols += " equal_work_slowdown:+.1% equal_work_ref min_len:d max_len:d grammar_finished:d"
    h.print_table(report["throughput"], cols)
    if report["served"]:
        print(f"\ncontinuous batching: {args.queue_factor} x B requests, at most B running")
        h.print_table(report["served"], cols)
    t = report["ttft"]
    print(f"\nfirst-token latency, schema {t['schema']!r}, median of {t['repeats']} (max_tokens=1)")
    rows = [{"request": k, **t[k]} for k in ("cold", "cached", "unconstrained")]
    h.print_table(rows, "request ttft_ms:.2f generate_ms:.2f cache_hits:d cache_misses:d")
    h.write_json(args.output, report)
    return report


if __name__ == "__main__":
    h.run_main(main)
