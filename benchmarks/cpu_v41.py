"""The tiny DeepSeek-V4.1 on CPU: throughput, prefix caching and the decoder-side prefill tail."""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

from deepinfer_core.benchmarking import harness as h
from deepinfer_core.models.deepseek_v41.model import TAIL_ENV


def engine(model_dir: Path, tail: str | None = None, **kw):
    """An engine over the tiny V4.1 with the prefill tail set (read when the model is built)."""
    from deepinfer_core import LLM

    os.environ.pop(TAIL_ENV, None)
    os.environ.update({TAIL_ENV: tail} if tail else {})
    llm = LLM(str(model_dir), backend="reference", dtype="float32", **kw)
    os.environ.pop(TAIL_ENV, None)
    return llm


def throughput(model_dir: Path, a) -> dict:
    """Prefill and decode tokens/s of a batch of equal prompts."""
    prompts = h.random_prompts(a.num_prompts, a.prompt_len, seed=0)
    llm = engine(model_dir, max_num_seqs=a.num_prompts, max_num_batched_tokens=2048)

    def median_s(n: int) -> float:
        h.generate(llm, prompts, h.greedy(n))  # warm-up
        return statistics.median_high(h.generate(llm, prompts, h.greedy(n))[1] for _ in range(a.repeats))

    prefill, both = median_s(1), median_s(a.max_tokens)
    return {"num_prompts": a.num_prompts, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
            "prefill_s": prefill, "prefill_tok_s": a.num_prompts * a.prompt_len / prefill,
            "decode_s": both - prefill,
            "decode_tok_s": a.num_prompts * (a.max_tokens - 1) / (both - prefill)}  # fmt: skip


def prefix(model_dir: Path, a) -> dict:
    """TTFT (one request at a time, after the first warmed the cache) and prefix hit rate."""
    shared = h.random_prompts(1, a.prefix_len, seed=1)[0]
    prompts = [shared + p for p in h.random_prompts(a.num_prompts, a.suffix_len, seed=2)]
    out: dict = {"prefix_len": a.prefix_len, "suffix_len": a.suffix_len, "num_prompts": len(prompts)}
    for name, caching in (("cold", False), ("hot", True)):
        llm = engine(model_dir, enable_prefix_caching=caching, max_num_seqs=1)
        h.generate(llm, prompts[:1], h.greedy(1))
        llm.reset_metrics()
        ttft = [h.generate(llm, [p], h.greedy(1))[1] for p in prompts[1:]]
        m, total = llm.get_metrics(), sum(map(len, prompts[1:]))
        hit, replayed = m["num_prefix_hit_tokens"], m["num_replayed_tokens"]
        out[name] = {"ttft_ms": 1e3 * statistics.median(ttft), "hit_rate": hit / total,
                     "computed_prompt_tokens": total - hit + replayed}  # fmt: skip
    out["ttft_speedup"] = out["cold"]["ttft_ms"] / out["hot"]["ttft_ms"]
    return out


def tail(model_dir: Path, a) -> dict:
    """Prefill time without and with the tail (timed in turn, so machine load hits both alike)."""
    prompts = h.random_prompts(a.tail_prompts, a.tail_len, seed=3)
    engines = {n: engine(model_dir, t, max_num_seqs=1, max_num_batched_tokens=a.tail_len)
               for n, t in (("full", None), ("tail", "auto"))}  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in engines}
    for i in range(a.repeats + 1):  # the first round warms up
        for n, llm in engines.items():
            s = sum(h.generate(llm, [p], h.greedy(1))[1] for p in prompts)
            times[n] += [s] if i else []
    out: dict = {"prompt_len": a.tail_len, "num_prompts": len(prompts)}
    for n, ts in times.items():
        s = statistics.median(ts)
        out[n] = {"prefill_s": s, "prefill_tok_s": len(prompts) * a.tail_len / s}
    out["speedup"] = out["full"]["prefill_s"] / out["tail"]["prefill_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    ints = {"num_prompts": 8, "prompt_len": 64, "max_tokens": 32, "prefix_len": 448, "suffix_len": 16}
    ap = h.parser(__doc__, "cpu_v41", threads=0, **ints, tail_len=512, tail_prompts=4, repeats=3)
    ap.add_argument("--model-dir", type=Path, default=None, help="a tiny V4.1 (default: made in a temp dir)")
    args = h.parse(ap, argv)
    from deepinfer_core.models.deepseek_v41.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or make_tiny(Path(tmp) / "v41")
        report = {part.__name__: part(model_dir, args) for part in (throughput, prefix, tail)}
    t, p, d = report["throughput"], report["prefix"], report["tail"]
    print(f"prefill tok/s ({t['num_prompts']}x{t['prompt_len']}): {t['prefill_tok_s']:.1f}")
    print(f"decode tok/s ({t['num_prompts']} seqs): {t['decode_tok_s']:.1f}")
    print(f"prefix hit rate (hot): {p['hot']['hit_rate']:.3f}")
    print(f"TTFT cold / hot (ms): {p['cold']['ttft_ms']:.1f} / {p['hot']['ttft_ms']:.1f}")
    print(f"prefill s full / tail: {d['full']['prefill_s']:.3f} / {d['tail']['prefill_s']:.3f}")
    print(f"tail speedup: {d['speedup']:.2f}")
    h.write_json(args.output, report)


if __name__ == "__main__":
    h.run_main(main)
