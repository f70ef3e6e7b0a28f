"""Speculative decoding: DSpark vs fixed-length verification vs none, per batch size."""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from deepinfer_core.benchmarking import harness as h


def make_prompts(llm: Any, num: int, args: Any) -> list[list[int]]:
    """``repeat``: a random block of a quarter of ``--prompt-len`` repeated; ``text``: BOS and a
    window of the trained tiny model's held-out text at a seeded offset."""
    rng, n = random.Random(0), args.prompt_len
    if args.prompts == "text":
        from deepinfer_core.models.deepseek_v4.trained import load_corpus

        tok = llm.get_tokenizer()
        ids = tok.encode("".join(load_corpus()[1]), add_bos=False)
        starts = [rng.randrange(len(ids) - n) for _ in range(num)]
        return [[tok.bos_token_id, *ids[s : s + n - 1]] for s in starts]
    vocab, block = llm.engine.model_config.vocab_size, max(1, n // 4)
    return [([rng.randrange(3, vocab) for _ in range(block)] * (n // block + 1))[:n] for _ in range(num)]


def workload_params(num: int, args: Any) -> list[Any]:
    """Greedy with ``--presence-penalty``, every 4th request seeded sampling; ``max_tokens`` each,
    or uniform (seeded) in ``max_tokens * (1 ± --length-spread)``."""
    rng, spread = random.Random(1), args.length_spread * args.max_tokens
    out = []
    for i in range(num):
        length = max(1, round(args.max_tokens + rng.uniform(-spread, spread))) if spread else args.max_tokens
        sampled = i % 4 == 3
        out.append(h.greedy(length, temperature=0.8 if sampled else 0.0, seed=i if sampled else None,
                            presence_penalty=args.presence_penalty))  # fmt: skip
    return out


class ModeRun:
    """One mode's engine for one batch size, warmed up; :meth:`timed` runs the workload once."""

    def __init__(self, mode: str, batch: int, args: Any) -> None:
        from deepinfer_core import LLM

        spec = {"method": mode, "drafter": args.drafter, "max_draft_tokens": args.max_draft_tokens}
        self.mode, self.batch, self.times, self.outs = mode, batch, [], []
        graphs = args.mixed_graph_max_tokens
        kw = {"keep_quantized": h.KEEP_QUANTIZED[args.keep_quantized], "mixed_graph_max_tokens": graphs}
        spec = None if mode == "none" else spec
        self.llm = LLM(args.model, backend=args.backend, max_num_seqs=batch, speculative=spec, **kw)
        prompts = make_prompts(self.llm, batch * args.requests_per_slot, args)
        self.reqs = [{"prompt_token_ids": p} for p in prompts]
        self.params = workload_params(len(self.reqs), args)
        self.llm.generate(self.reqs, self.params, use_tqdm=False)  # warm-up

    def timed(self) -> None:
        """Run the workload once (its wall time joins :attr:`times`; metrics of the last run kept)."""
        self.llm.reset_metrics()
        sync = torch.cuda.synchronize if torch.cuda.is_available() else None
        self.outs, s = h.timed(lambda: self.llm.generate(self.reqs, self.params, use_tqdm=False), sync)
        self.times.append(s)
        self.metrics = self.llm.get_metrics()

    def row(self) -> dict[str, Any]:
        """The result row: median wall time, throughput, target forwards, the speculation figures."""
        m, tokens, wall = self.metrics, h.new_tokens(self.outs), statistics.median(self.times)
        row = {"batch": self.batch, "mode": self.mode, "wall_s": wall, "wall_s_runs": self.times,
               "tok_per_s": tokens / wall, "generated_tokens": tokens, "target_forwards": m["num_steps"],
               "tokens_per_forward": tokens / m["num_steps"] if m["num_steps"] else 0.0}  # fmt: skip
        if "speculative" in m:
            s = m["speculative"]
            row.update(acceptance_rate=s["acceptance_rate"], draft_tokens=s["num_draft_tokens"],
                       mean_acceptance_length=s["mean_acceptance_length"],
                       verify_length_histogram=s["verify_length_histogram"],
                       steps_without_drafting=s["num_steps_without_drafting"])  # fmt: skip
            row.update({"cost_model": s["cost_model"]} if "cost_model" in s else {})
        return row


def paired_ratios(base_times: list[float], times: list[float]) -> dict[str, Any]:
    """``base / time`` of paired runs (run ``i`` of each mode back to back): median, mean, sd,
    the mean's 95 % interval (normal approximation) and how many are at least 1."""
    ratios = [b / t for b, t in zip(base_times, times, strict=True)]
    mean, sd = statistics.fmean(ratios), statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    half = 1.96 * sd / len(ratios) ** 0.5
    at_least_1 = sum(r >= 1.0 for r in ratios)
    return {"ratios": ratios, "runs": len(ratios), "median": statistics.median(ratios), "mean": mean,
            "sd": sd, "ci95": [mean - half, mean + half], "at_least_1": at_least_1}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ints = {"max_draft_tokens": 5, "prompt_len": 48, "max_tokens": 96, "requests_per_slot": 4, "repeats": 3}
    ap = h.parser(__doc__, "speculative", **ints)
    ap.add_argument("--model", help="model dir (default: the built-in tiny model); 'bigram-mtp': the "
                    "tiny model whose MTP layer predicts the target's greedy token after next")  # fmt: skip
    ap.add_argument("--backend", help="backend (default auto)")
    ap.add_argument("--batch-sizes", type=h.positive_ints, default=[1, 4, 16])
    modes = ("none", "fixed", "dspark")
    ap.add_argument("--modes", type=h.choice_list(modes), default=list(modes))
    ap.add_argument("--drafter", default="ngram")
    h.add_keep_quantized(ap, "LLM(keep_quantized=None|True|False): FP8/FP4 checkpoint weights kept")
    ap.add_argument("--mixed-graph-max-tokens", type=int, help="LLM(mixed_graph_max_tokens=N) (0: eager)")
    ap.add_argument("--length-spread", type=float, default=0.0, help="max_tokens uniform in max_tokens*(1±F)")
    ap.add_argument("--prompts", choices=("repeat", "text"), default="repeat",
                    help="repeat: random blocks repeated; text: the trained tiny model's text")  # fmt: skip
    ap.add_argument("--presence-penalty", type=float, default=-2.0)
    args = h.parse(ap, argv)
    if args.model == "bigram-mtp":
        from deepinfer_core.testing.checkpoints import write_bigram_mtp_checkpoint

        args.model = str(write_bigram_mtp_checkpoint(Path(tempfile.mkdtemp(prefix="bigram-mtp-"))))
    rows = []
    for b in args.batch_sizes:
        runs = {mode: ModeRun(mode, b, args) for mode in args.modes}
        for _ in range(args.repeats):  # interleaved: drifting machine load hits every mode alike
            for run in runs.values():
                run.timed()
        batch_rows = [run.row() for run in runs.values()]
        for row in batch_rows:
            row["speedup_vs_first_mode"] = row["tok_per_s"] / batch_rows[0]["tok_per_s"]
            if row["mode"] == "dspark" and "fixed" in runs:
                row["vs_fixed_per_run"] = paired_ratios(runs["fixed"].times, runs["dspark"].times)
        rows += batch_rows
        del runs
    cols = "batch:d mode tok_per_s:.1f target_forwards:d tokens_per_forward:.2f acceptance_rate:.2f"
    h.print_table(rows, cols + " mean_acceptance_length:.2f speedup_vs_first_mode:.2f")
    for r in rows:
        if p := r.get("vs_fixed_per_run"):
            print(f"B={r['batch']} dspark/fixed per run: median {p['median']:.3f}, mean {p['mean']:.3f} "
                  f"± {p['sd']:.3f} (sd; the mean's 95 % CI {p['ci95'][0]:.3f}..{p['ci95'][1]:.3f}), "
                  f"{p['at_least_1']}/{p['runs']} runs >= 1")  # fmt: skip
    result = {"args": vars(args), "rows": rows}
    h.write_json(args.output, result, device="cuda" if torch.cuda.is_available() else None)
    return result


if __name__ == "__main__":
    h.run_main(main)
