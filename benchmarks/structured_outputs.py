"""Structured outputs on CPU with the built-in tiny model: throughput and first-token latency.

One engine (``LLM()`` defaults on the built-in tiny model, or ``--model``), greedy decoding of
prompts cut from the tiny corpus (``--prompt-len`` tokens).  ``finished`` counts the requests
that stopped before ``max_tokens`` (their grammar complete, then EOS).  The JSON schemas are a fixed
subset (``--schemas``) of the structured-outputs test corpus,
``plugins/samplers/tests/schema_corpus.py`` (imported from its path: one source of schemas).

1. Throughput at each ``--batch-sizes`` B: B requests of at most ``--max-tokens`` new tokens, as

   - ``unconstrained``: no grammar, ``ignore_eos=True`` (exactly ``max_tokens`` each);
   - ``json``: request i constrained to schema ``i % len(schemas)``
     (``StructuredOutputsParams(json=...)``); a request stops when its grammar finishes, so
     it may generate fewer tokens, and the batch thins out while the longest still runs;
   - ``len-matched``: unconstrained, each request ``ignore_eos`` with ``max_tokens`` set to
     its ``json`` twin's length (from the warm-up): the same work as ``json`` without a grammar;
   - ``json-full``: ``json`` with ``ignore_eos=True``: once the grammar finishes only EOS is
     allowed and it is repeated up to ``max_tokens``, so every request generates as many
     tokens as an ``unconstrained`` one.

   Wall time of ``llm.generate``; tok/s = generated tokens / wall time; the median of
   ``--repeats`` runs (the modes interleaved, after one warm-up of every mode, so every schema
   is compiled and cached before timing).  Two slowdowns: ``tok/s`` = unconstrained tok/s /
   the mode's tok/s - 1, which for ``json`` also counts the thinner batches; and
   ``equal-work`` = the mode's wall time / the wall time of the same tokens unconstrained - 1
   (``json`` vs ``len-matched``, ``json-full`` vs ``unconstrained``): the cost of the grammar.
2. First-token latency (``RequestOutput.metrics.ttft``: arrival to first sampled token, which
   includes compiling the grammar, as ``add_request`` builds the matcher) of one request with
   ``max_tokens=1``: schema ``--ttft-schema`` made new to the engine (a unique ``title``, so
   the llguidance backend's compiled-grammar cache misses: ``cold``), the same spec again
   (``cached``), and no grammar (``unconstrained``); medians of ``--ttft-repeats``.  The
   backend's ``cache_info()`` hits and misses over each kind are recorded as proof.
3. Continuous batching (``--queue-factor`` Q, default 16; 0 skips it): Q x B requests given at
   once with at most B running (the scheduler's ``max_num_seqs`` set to B), so requests whose
   grammar finishes early are replaced from the queue and the batch stays full until it
   drains — the throughput a server at concurrency B sees; ``unconstrained``, ``json`` and
   ``len-matched`` (each request as long as its ``json`` twin: the same prefills and tokens,
   so ``json`` vs ``len-matched`` is the grammar's cost under continuous batching).
4. With ``--profile``: cProfile of ``--repeats`` runs of each mode (but ``len-matched``) at
   the largest batch size, the time split into the model forward, the grammar (mask fill,
   token consumption, matcher creation) and the sampler (which copies, unpacks and applies
   the bitmask); cProfile's per-call cost inflates the Python-heavy parts, so read the parts
   relative to each other.

Prints tables and writes JSON (default ``benchmarks/results/structured_outputs.json``)::

    OMP_NUM_THREADS=1 python benchmarks/structured_outputs.py --profile

``--threads`` (default 1) sets torch's intra-op threads: the tiny model gains nothing from
more, and on a busy machine more threads wait on each other (docs/testing.md).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import importlib.util
import itertools
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from deepinfer_core import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from deepinfer_core.benchmarking.harness import log, positive_ints, print_table, timed, write_json  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "structured_outputs.json"
CORPUS_PATH = ROOT / "plugins" / "samplers" / "tests" / "schema_corpus.py"
TINY_CORPUS = ROOT / "deepinfer_core" / "models" / "deepseek_v4" / "tiny_corpus.txt"
# objects, arrays, formats, patterns, anyOf: realistic documents of the corpus
DEFAULT_SCHEMAS = (
    "person,order,tool_call,config_file,event_log,"
    "object_of_formats,array_of_objects,object_nested_three_levels"
)
MODES = ("unconstrained", "json", "json-full")


def load_schema_corpus() -> ModuleType:
    """The test corpus module, imported from its path (it is not in a package on sys.path)."""
    spec = importlib.util.spec_from_file_location("schema_corpus", CORPUS_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pick_schemas(names: list[str]) -> list[tuple[str, dict[str, Any]]]:
    corpus = dict(load_schema_corpus().SCHEMAS)
    missing = [n for n in names if n not in corpus]
    if missing:
        raise SystemExit(f"unknown schema names {missing}; the corpus has {sorted(corpus)}")
    return [(n, corpus[n]) for n in names]


def make_prompts(llm: LLM, num: int, length: int) -> list[list[int]]:
    """``num`` prompts of ``length`` ids: BOS then windows of the tiny corpus."""
    tok = llm.get_tokenizer()
    ids = tok.encode(TINY_CORPUS.read_text(encoding="utf-8"), add_bos=False)
    return [[tok.bos_token_id, *ids[(i * 97) % (len(ids) - length) :][: length - 1]] for i in range(num)]


def mode_params(
    mode: str, batch: int, schemas: list[tuple[str, dict]], max_tokens: int
) -> list[SamplingParams]:
    if mode == "unconstrained":
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * batch
    return [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=mode == "json-full",
            structured_outputs=StructuredOutputsParams(json=schemas[i % len(schemas)][1]),
        )
        for i in range(batch)
    ]


def timed_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    steps0 = llm.get_metrics()["num_steps"]
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs, seconds = timed(lambda: llm.generate(requests, params, use_tqdm=False))
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return {
        "lengths": lengths,
        "seconds": seconds,
        "new_tokens": sum(lengths),
        "tok_s": sum(lengths) / seconds,
        "steps": llm.get_metrics()["num_steps"] - steps0,
        "min_len": min(lengths),
        "max_len": max(lengths),
        "grammar_finished": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
    }


def bench_throughput(llm: LLM, args: argparse.Namespace, schemas: list[tuple[str, dict]]) -> list[dict]:
    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(llm, batch, args.prompt_len)
        params = {m: mode_params(m, batch, schemas, args.max_tokens) for m in MODES}
        # warm-up: compiles (and caches) every schema; the json run's lengths make len-matched
        warm = {m: timed_generate(llm, prompts, params[m]) for m in MODES}
        lengths = warm["json"]["lengths"]
        params["len-matched"] = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths
        ]
        modes = ("unconstrained", "len-matched", "json", "json-full")
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for m in modes:
                runs[m].append(timed_generate(llm, prompts, params[m]))
        med: dict[str, dict] = {}
        for m in modes:
            med[m] = {
                "batch": batch,
                "mode": m,
                **sorted(runs[m], key=lambda r: r["seconds"])[len(runs[m]) // 2],
                "all_seconds": [r["seconds"] for r in runs[m]],
                "same_lengths_every_run": all(r["lengths"] == runs[m][0]["lengths"] for r in runs[m]),
            }
            med[m]["ms_per_step"] = 1e3 * med[m]["seconds"] / med[m]["steps"]
        # tok/s vs unconstrained; wall time vs the run of equal work (same tokens per request)
        equal_work = {"len-matched": None, "json": "len-matched", "json-full": "unconstrained"}
        for m, ref in equal_work.items():
            med[m]["slowdown"] = med["unconstrained"]["tok_s"] / med[m]["tok_s"] - 1
            if ref is not None:
                med[m]["equal_work_ref"] = ref
                med[m]["equal_work_slowdown"] = med[m]["seconds"] / med[ref]["seconds"] - 1
        for m in modes:
            row = {k: v for k, v in med[m].items() if k != "lengths"}
            rows.append(row)
            log(
                f"batch {batch:3d} {m:13s} {row['seconds']:6.3f} s {row['tok_s']:8.1f} tok/s "
                f"({row['new_tokens']} tokens, {row['steps']} steps)"
            )
    return rows


def bench_served(llm: LLM, args: argparse.Namespace, schemas: list[tuple[str, dict]]) -> list[dict]:
    """Continuous batching: ``--queue-factor`` x B requests at once with at most B running
    (``max_num_seqs`` = B), so a request that finishes early is replaced by a waiting one and
    the batch stays full until the queue drains: the throughput a server at concurrency B
    sees.  Modes ``unconstrained``, ``json`` and ``len-matched`` as above; the median of
    ``--repeats``."""
    rows = []
    scheduler = llm.engine.scheduler
    saved = scheduler.max_num_seqs
    try:
        for batch in args.batch_sizes:
            scheduler.max_num_seqs = batch
            n = args.queue_factor * batch
            prompts = make_prompts(llm, n, args.prompt_len)
            params = {m: mode_params(m, n, schemas, args.max_tokens) for m in ("unconstrained", "json")}
            warm = {m: timed_generate(llm, prompts, params[m]) for m in params}
            lengths = warm["json"]["lengths"]
            params["len-matched"] = [
                SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in lengths
            ]
            runs: dict[str, list[dict]] = {m: [] for m in params}
            for _ in range(args.repeats):
                for m in params:
                    runs[m].append(timed_generate(llm, prompts, params[m]))
            med = {m: sorted(r, key=lambda x: x["seconds"])[len(r) // 2] for m, r in runs.items()}
            for m in params:
                row = {k: v for k, v in med[m].items() if k != "lengths"}
                row.update(batch=batch, mode=m, requests=n, all_seconds=[r["seconds"] for r in runs[m]])
                row["ms_per_step"] = 1e3 * row["seconds"] / row["steps"]
                row["slowdown"] = med["unconstrained"]["tok_s"] / row["tok_s"] - 1
                if m == "json":
                    row["equal_work_ref"] = "len-matched"
                    row["equal_work_slowdown"] = row["seconds"] / med["len-matched"]["seconds"] - 1
                rows.append(row)
                log(f"served batch {batch:3d} {m:13s} {row['tok_s']:8.1f} tok/s ({n} requests)")
    finally:
        scheduler.max_num_seqs = saved
    return rows


THROUGHPUT_COLUMNS = [
    ("batch", "batch", "d"), ("mode", "mode", ""), ("wall s", "seconds", ".3f"),
    ("new tok", "new_tokens", "d"),
    ("tok/s", "tok_s", ".1f"), ("steps", "steps", "d"), ("ms/step", "ms_per_step", ".2f"),
    ("tok/s slowdown", "slowdown", "+.1%"), ("equal-work slowdown", "equal_work_slowdown", "+.1%"),
    ("vs", "equal_work_ref", ""),
]  # fmt: skip


def print_served(rows: list[dict], factor: int) -> None:
    print(f"\ncontinuous batching: {factor} x B requests, at most B running")
    shown = [{**r, "slowdown": None if r["mode"] == "unconstrained" else r["slowdown"]} for r in rows]
    print_table(shown, [*THROUGHPUT_COLUMNS[:3], ("requests", "requests", "d"), *THROUGHPUT_COLUMNS[3:]])


def bench_ttft(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    backend = llm.engine.structured.backend("llguidance")  # private; the only path to cache_info()
    schema = dict(load_schema_corpus().SCHEMAS)[args.ttft_schema]
    prompt = make_prompts(llm, 1, args.prompt_len)
    counter = itertools.count()

    def one(params: SamplingParams) -> tuple[float, float, tuple[int, int]]:
        before = backend.cache_info()
        (out,), wall = timed(lambda: llm.generate([{"prompt_token_ids": prompt[0]}], params, use_tqdm=False))
        after = backend.cache_info()
        if out.error:
            raise RuntimeError(out.error)
        assert out.metrics is not None and out.metrics.ttft is not None
        return out.metrics.ttft, wall, (after.hits - before.hits, after.misses - before.misses)

    def structured(spec_schema: dict) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=spec_schema)
        )

    one(SamplingParams(temperature=0.0, max_tokens=1))  # warm-up
    samples: dict[str, list[tuple[float, float, tuple[int, int]]]] = {
        "cold": [],
        "cached": [],
        "unconstrained": [],
    }
    for _ in range(args.ttft_repeats):
        fresh = copy.deepcopy(schema)
        fresh["title"] = f"structured-outputs-benchmark-{os.getpid()}-{time.time_ns()}-{next(counter)}"
        samples["cold"].append(one(structured(fresh)))
        samples["cached"].append(one(structured(copy.deepcopy(fresh))))
        samples["unconstrained"].append(one(SamplingParams(temperature=0.0, max_tokens=1)))
    out: dict[str, Any] = {"schema": args.ttft_schema, "repeats": args.ttft_repeats}
    for kind, s in samples.items():
        out[kind] = {
            "ttft_ms": 1e3 * statistics.median(t for t, _, _ in s),
            "generate_ms": 1e3 * statistics.median(w for _, w, _ in s),
            "all_ttft_ms": [1e3 * t for t, _, _ in s],
            "cache_hits": sum(h for _, _, (h, _) in s),
            "cache_misses": sum(m for _, _, (_, m) in s),
        }
    out["cache_info_end"] = dataclasses.asdict(backend.cache_info())
    return out


# (label, (file suffix, function name)): cumulative time of each, from the profile
PROFILE_PARTS: list[tuple[str, tuple[str, str]]] = [
    ("engine step (total)", ("engine/llm_engine.py", "step")),
    ("model forward (runner.execute)", ("engine/model_runner.py", "execute")),
    ("_sample (grammar masks + sampler)", ("engine/llm_engine.py", "_sample")),
    ("  structured.apply (wait for / fill the masks)", ("engine/structured.py", "apply")),
    ("    matcher.fill_bitmask (mask compute)", ("llguidance_backend.py", "fill_bitmask")),
    ("    matcher.consume (advance grammar)", ("llguidance_backend.py", "consume")),
    ("  sampler (bitmask copy, unpack, apply)", ("sampling/sampler.py", "__call__")),
    ("    apply_allowed_bias_bans_padded", ("sampling/penalties.py", "apply_allowed_bias_bans_padded")),
    ("scheduler.complete (append, detokenize)", ("engine/scheduler.py", "complete")),
    ("backend.matcher (per-request matcher copy)", ("llguidance_backend.py", "matcher")),
]


def profile_run(llm: LLM, args: argparse.Namespace, schemas: list[tuple[str, dict]]) -> dict[str, Any]:
    """cProfile ``--repeats`` runs of each mode (interleaved) at the largest batch size;
    cumulative seconds per part, per run."""
    batch = max(args.batch_sizes)
    prompts = make_prompts(llm, batch, args.prompt_len)
    params = {m: mode_params(m, batch, schemas, args.max_tokens) for m in MODES}
    profs = {m: cProfile.Profile() for m in MODES}
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for m in MODES:
        timed_generate(llm, prompts, params[m])  # warm (cached grammars)
    for _ in range(args.repeats):
        for m in MODES:
            profs[m].enable()
            runs[m].append(timed_generate(llm, prompts, params[m]))
            profs[m].disable()
    out: dict[str, Any] = {"batch": batch, "runs_per_mode": args.repeats, "modes": {}}
    for m in MODES:
        stats: dict = pstats.Stats(profs[m]).stats  # type: ignore[attr-defined]
        cum = dict.fromkeys((key for _, key in PROFILE_PARTS), 0.0)
        for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.items():
            for suffix, name in cum:
                if func == name and file.endswith(suffix):
                    cum[(suffix, name)] += ct
        top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:12]
        n = len(runs[m])
        out["modes"][m] = {
            "steps_per_run": statistics.mean(r["steps"] for r in runs[m]),
            "new_tokens_per_run": statistics.mean(r["new_tokens"] for r in runs[m]),
            "parts_s_per_run": {label: cum[key] / n for label, key in PROFILE_PARTS},
            "top_self_time_per_run": [
                {"function": f"{Path(f).name}:{ln}({fn})", "self_s": v[2] / n, "calls": v[1] // n}
                for (f, ln, fn), v in top
            ],
        }
    return out


def print_profile(p: dict[str, Any]) -> None:
    modes = p["modes"]
    print(
        f"\ncProfile at batch {p['batch']}, {p['runs_per_mode']} runs per mode: "
        "cumulative ms per run (ms per step)"
    )
    print(f"{'part':<44}" + "".join(f"{m:>22}" for m in modes))
    for label, _ in PROFILE_PARTS:
        cells = ""
        for m in modes.values():
            ms = 1e3 * m["parts_s_per_run"][label]
            cells += f"{ms:>13.1f} ({ms / m['steps_per_run']:5.2f})"
        print(f"{label:<44}{cells}")
    print("top self time per run, json-full:")
    for f in modes["json-full"]["top_self_time_per_run"][:8]:
        print(f"  {1e3 * f['self_s']:7.1f} ms {f['calls']:>7} calls  {f['function']}")


def print_throughput(rows: list[dict]) -> None:
    print()
    columns = [*THROUGHPUT_COLUMNS, ("len min", "min_len", "d"), ("len max", "max_len", "d")]
    print_table(rows, [*columns, ("finished", "grammar_finished", "d")])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("--batch-sizes", type=positive_ints, default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed runs per mode and batch; the median is kept"
    )
    ap.add_argument("--schemas", default=DEFAULT_SCHEMAS, help="comma-separated names from the schema corpus")
    ap.add_argument("--ttft-schema", default="order", help="corpus schema of the first-token latency test")
    ap.add_argument("--ttft-repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--profile", action="store_true", help="cProfile each mode at the largest batch size")
    ap.add_argument(
        "--queue-factor",
        type=int,
        default=16,
        help="continuous batching: this many x B requests with at most B running (0: skip)",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    schemas = pick_schemas([s.strip() for s in args.schemas.split(",") if s.strip()])
    max_batch = max(args.batch_sizes)
    llm = LLM(model=args.model, max_num_seqs=max(max_batch, 1))
    import llguidance

    header = {
        "llguidance": getattr(llguidance, "__version__", None),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "model": llm.config.model,
        "engine": {
            "backend": llm.config.backend,
            "dtype": llm.config.dtype,
            "max_num_seqs": llm.config.max_num_seqs,
            "async_scheduling": llm.config.async_scheduling,
            "vocab_size": llm.engine.model_config.vocab_size,
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "schemas": [n for n, _ in schemas],
    }
    report: dict[str, Any] = {**header}

    log("throughput")
    report["throughput"] = bench_throughput(llm, args, schemas)
    log("first-token latency")
    report["ttft"] = bench_ttft(llm, args)
    if args.profile:
        log(f"profile: every mode at batch {max_batch}")
        report["profile"] = profile_run(llm, args, schemas)
    report["served"] = []
    if args.queue_factor > 0:
        log("continuous batching")
        report["served"] = bench_served(llm, args, schemas)

    print_throughput(report["throughput"])
    if report["served"]:
        print_served(report["served"], args.queue_factor)
    t = report["ttft"]
    print(f"\nfirst-token latency, schema {t['schema']!r}, median of {t['repeats']} (max_tokens=1)")
    ttft_rows = [{"request": kind, **t[kind]} for kind in ("cold", "cached", "unconstrained")]
    print_table(ttft_rows, [("request", "request", ""), ("TTFT ms", "ttft_ms", ".2f"),
                            ("generate ms", "generate_ms", ".2f"), ("cache hits", "cache_hits", "d"),
                            ("misses", "cache_misses", "d")])  # fmt: skip
    if "profile" in report:
        print_profile(report["profile"])
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
