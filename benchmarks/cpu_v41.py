"""CPU benchmark of the tiny DeepSeek-V4.1 (``make-tiny --arch deepseek_v41``): throughput,
prefix caching and the decoder-side prefill tail.

Three workloads on the same engine options (reference backend, fp32, greedy, EOS ignored):

- ``throughput``: ``--num-prompts`` random prompts of ``--prompt-len`` tokens, all submitted at
  once; prefill tokens/s from a run with one new token each, decode tokens/s from the extra
  time of a run with ``--max-tokens`` new tokens each;
- ``prefix``: ``--num-prompts`` prompts sharing a ``--prefix-len``-token prefix plus
  ``--suffix-len`` unique tokens, one at a time (TTFT = the time to the first token of a
  request alone), prefix caching off (cold) and on (hot: the first prompt warms the cache,
  the others hit it): hit rate (hit tokens / prompt tokens) and TTFT;
- ``tail``: ``--tail-prompts`` prompts of ``--tail-len`` tokens (the tiny window is 8), prefill
  only (one new token), with ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`` off (every row through every
  layer) and ``auto`` (the layers after the last kv source on each request's last ``W + S``
  rows), one at a time; plus the last-token logit error of the tail (max |difference|).

Each timing is the median of ``--repeats`` runs after a warm-up.  Prints a table and writes
JSON (default ``benchmarks/results/cpu_v41.json``)::

    OMP_NUM_THREADS=1 python benchmarks/cpu_v41.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deepinfer_core.config import EngineConfig
from deepinfer_core.engine.llm_engine import LLMEngine
from deepinfer_core.llm import LLM
from deepinfer_core.models.deepseek_v41.model import TAIL_ENV
from deepinfer_core.models.deepseek_v41.tiny import make_tiny
from deepinfer_core.sampling.params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "cpu_v41.json"


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(4, 500, (n,), generator=g).tolist()


def _llm(model_dir: Path, tail: str | None = None, **kw) -> LLM:
    """An engine over the tiny V4.1, with the prefill tail set (read when the model is built)."""
    if tail is None:
        os.environ.pop(TAIL_ENV, None)
    else:
        os.environ[TAIL_ENV] = tail
    cfg = EngineConfig(model=str(model_dir), backend="reference", dtype="float32", **kw)
    return LLM.from_engine(LLMEngine(cfg))


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def throughput(model_dir: Path, args: argparse.Namespace) -> dict:
    """Prefill and decode tokens/s of a batch of equal prompts."""
    g = torch.Generator().manual_seed(0)
    reqs = [{"prompt_token_ids": _tokens(g, args.prompt_len)} for _ in range(args.num_prompts)]
    llm = _llm(model_dir, max_num_seqs=args.num_prompts, max_num_batched_tokens=2048)
    prefill = _median_s(lambda: llm.generate(reqs, _params(1), use_tqdm=False), args.repeats)
    both = _median_s(lambda: llm.generate(reqs, _params(args.max_tokens), use_tqdm=False), args.repeats)
    decoded = args.num_prompts * (args.max_tokens - 1)
    return {
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "prefill_s": prefill,
        "prefill_tok_s": args.num_prompts * args.prompt_len / prefill,
        "decode_s": both - prefill,
        "decode_tok_s": decoded / (both - prefill),
    }


def prefix(model_dir: Path, args: argparse.Namespace) -> dict:
    """Hit rate and TTFT of a shared-prefix workload, prefix caching off and on."""
    g = torch.Generator().manual_seed(1)
    shared = _tokens(g, args.prefix_len)
    prompts = [shared + _tokens(g, args.suffix_len) for _ in range(args.num_prompts)]
    out: dict = {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "num_prompts": len(prompts)}
    for name, caching in (("cold", False), ("hot", True)):
        llm = _llm(model_dir, enable_prefix_caching=caching, max_num_seqs=1)
        llm.generate([{"prompt_token_ids": prompts[0]}], _params(1), use_tqdm=False)  # warms the cache
        before = llm.get_metrics()
        ttft = []
        for p in prompts[1:]:
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}], _params(1), use_tqdm=False)
            ttft.append(time.perf_counter() - t0)
        after = llm.get_metrics()
        hit = after["num_prefix_hit_tokens"] - before["num_prefix_hit_tokens"]
        replayed = after["num_replayed_tokens"] - before["num_replayed_tokens"]
        total = sum(len(p) for p in prompts[1:])
        out[name] = {
            "ttft_ms": 1e3 * statistics.median(ttft),
            "hit_rate": hit / total,
            "computed_prompt_tokens": total - hit + replayed,
        }
    out["ttft_speedup"] = out["cold"]["ttft_ms"] / out["hot"]["ttft_ms"]
    return out


def tail(model_dir: Path, args: argparse.Namespace) -> dict:
    """Prefill time with and without the decoder-side tail on long prompts (the two engines
    timed in turn, so a change of machine load hits both), and the tail's logit error."""
    g = torch.Generator().manual_seed(2)
    reqs = [{"prompt_token_ids": _tokens(g, args.tail_len)} for _ in range(args.tail_prompts)]
    out: dict = {"prompt_len": args.tail_len, "num_prompts": len(reqs)}
    engines = {
        name: _llm(model_dir, setting, max_num_seqs=1, max_num_batched_tokens=args.tail_len)
        for name, setting in (("full", None), ("tail", "auto"))
    }
    os.environ.pop(TAIL_ENV, None)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(args.repeats + 1):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            for r in reqs:
                llm.generate([r], _params(1), use_tqdm=False)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        s = statistics.median(ts)
        out[name] = {"prefill_s": s, "prefill_tok_s": len(reqs) * args.tail_len / s}
    logits = {name: _last_logits(llm, reqs) for name, llm in engines.items()}
    out["speedup"] = out["full"]["prefill_s"] / out["tail"]["prefill_s"]
    out["max_abs_logit_error"] = float((logits["tail"] - logits["full"]).abs().max())
    out["argmax_agreement"] = float((logits["tail"].argmax(-1) == logits["full"].argmax(-1)).float().mean())
    return out


def _last_logits(llm: LLM, reqs: list[dict]) -> torch.Tensor:
    """The last prompt token's logits of each request (one step of the engine's runner)."""
    from deepinfer_core.contract.batch import SeqChunk

    runner = llm.engine.runner
    rows = []
    for r in reqs:
        ids = r["prompt_token_ids"]
        kv = runner.kv_cache
        pages = kv.allocate_pages(kv.pages_needed(len(ids)))
        rows.append(runner.execute([SeqChunk(0, ids, 0, pages, sample=True)])[-1])
        kv.free_pages(pages)
    return torch.stack(rows)


def print_table(report: dict) -> None:
    t, p, d = report["throughput"], report["prefix"], report["tail"]
    print(f"{'workload':<40} {'value':>12}")
    print(
        f"{'prefill tok/s (' + str(t['num_prompts']) + 'x' + str(t['prompt_len']) + ')':<40} "
        f"{t['prefill_tok_s']:>12.1f}"
    )
    print(f"{'decode tok/s (' + str(t['num_prompts']) + ' seqs)':<40} {t['decode_tok_s']:>12.1f}")
    print(f"{'prefix hit rate (hot)':<40} {p['hot']['hit_rate']:>12.3f}")
    print(f"{'TTFT cold / hot (ms)':<40} {p['cold']['ttft_ms']:>6.1f}/{p['hot']['ttft_ms']:<5.1f}")
    print(f"{'prefill s full / tail':<40} {d['full']['prefill_s']:>6.3f}/{d['tail']['prefill_s']:<5.3f}")
    print(f"{'tail speedup':<40} {d['speedup']:>12.2f}")
    print(f"{'tail max |logit error|':<40} {d['max_abs_logit_error']:>12.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=448)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--tail-len", type=int, default=512)
    ap.add_argument("--tail-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    ap.add_argument("--model-dir", type=Path, default=None, help="a tiny V4.1 (default: made in a temp dir)")
    ap.add_argument("--output", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or make_tiny(Path(tmp) / "v41")
        report = {
            "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
            "throughput": throughput(model_dir, args),
            "prefix": prefix(model_dir, args),
            "tail": tail(model_dir, args),
        }
    print_table(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
