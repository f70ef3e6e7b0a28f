"""Speculative decoding: DSpark vs fixed-length verification vs none, tokens per target forward
and throughput, on a workload with repetition or on real text.

The workload: ``B * --requests-per-slot`` prompts served with ``max_num_seqs=B`` (continuous
batching refills a slot as soon as its request finishes, so a request whose drafts keep
failing does not hold the whole batch back), each ``--prompt-len`` tokens: with ``--prompts
repeat`` random tokens (a random block repeated, so the n-gram drafter finds matches in the
prompt too), with ``--prompts text`` windows of the built-in trained model's held-out text
(its drafts at their real operating point); decoded greedily with
``presence_penalty=--presence-penalty`` (negative: tokens already present are favoured, so
even the random-weight tiny model produces repetitive text, some requests looping, others
wandering) plus ``--sampled`` seeded-sampling requests mixed in.  Every mode produces the same
tokens (checked): speculation changes only the work.

For each batch size ``B`` (``--batch-sizes``) and mode (``none``, ``fixed``, ``dspark``; the
drafter is ``--drafter``, default ``ngram``, with at most ``--max-draft-tokens``): wall time of
``llm.generate`` (median of ``--repeats`` after a warm-up; the modes' engines of one batch
size are built first and their runs interleaved, so drifting machine load hits each alike),
generated tok/s, target forwards
(engine steps) and tokens per forward, the drafts' acceptance rate and mean acceptance length;
with both ``fixed`` and ``dspark``, a line of DSpark's paired per-run throughput ratios to
``fixed`` (median, mean ± sd, the mean's 95 % confidence interval, runs at least 1: the
the noise to judge a difference by; ``vs_fixed_per_run`` in the JSON).

    OMP_NUM_THREADS=1 python benchmarks/speculative.py            # CPU, built-in tiny model
    python benchmarks/speculative.py --prompts text --presence-penalty 0 --drafter mtp  # real text
    python benchmarks/speculative.py --drafter mtp --model bigram-mtp   # an MTP layer that is right
    python benchmarks/speculative.py --model DIR --backend cuda_sm100 --batch-sizes 1,16,64

Prints a table and writes JSON (default ``benchmarks/results/speculative.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.benchmarking.harness import KEEP_QUANTIZED, add_keep_quantized, positive_ints, write_json

REPO = Path(__file__).resolve().parents[1]


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens: a random block of a quarter of the length, repeated."""
    rng = random.Random(seed)
    block = max(1, length // 4)
    out = []
    for _ in range(num):
        b = [rng.randrange(3, vocab) for _ in range(block)]
        out.append((b * (length // block + 1))[:length])
    return out


def text_prompts(tok: Any, num: int, length: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` ids: BOS then a window of the built-in trained model's
    held-out text (:func:`~deepinfer_core.models.deepseek_v4.trained.load_corpus`), at seeded
    random offsets."""
    from deepinfer_core.models.deepseek_v4.trained import load_corpus

    ids = tok.encode("".join(load_corpus()[1]), add_bos=False)
    rng = random.Random(seed)
    starts = [rng.randrange(len(ids) - length) for _ in range(num)]
    return [[tok.bos_token_id, *ids[s : s + length - 1]] for s in starts]


def workload_params(num: int, args: argparse.Namespace) -> list[SamplingParams]:
    """Greedy requests with a presence penalty, every ``args.sampled``-th one seeded sampling;
    ``max_tokens`` each, or with ``args.length_spread`` drawn uniformly (seeded) from
    ``max_tokens * (1 ± spread)``."""
    rng = random.Random(args.seed + 1)
    params = []
    for i in range(num):
        sampled = args.sampled and i % args.sampled == args.sampled - 1
        spread = args.length_spread * args.max_tokens
        length = round(args.max_tokens + rng.uniform(-spread, spread)) if spread else args.max_tokens
        params.append(
            SamplingParams(
                temperature=0.8 if sampled else 0.0,
                seed=i if sampled else None,
                presence_penalty=args.presence_penalty,
                max_tokens=max(length, 1),
                ignore_eos=True,
            )
        )
    return params


class ModeRun:
    """One mode's engine for one batch size, warmed up; :meth:`timed` runs the workload once."""

    def __init__(self, mode: str, batch: int, args: argparse.Namespace) -> None:
        spec = None if mode == "none" else {
            "method": mode, "drafter": args.drafter, "max_draft_tokens": args.max_draft_tokens,
        }  # fmt: skip
        kw: dict[str, Any] = {"max_num_seqs": batch, "speculative": spec}
        if args.model:
            kw["model"] = args.model
        if args.backend:
            kw["backend"] = args.backend
        if KEEP_QUANTIZED[args.keep_quantized] is not None:
            kw["keep_quantized"] = KEEP_QUANTIZED[args.keep_quantized]
        if args.mixed_graph_max_tokens is not None:
            kw["mixed_graph_max_tokens"] = args.mixed_graph_max_tokens
        self.mode, self.batch = mode, batch
        self.llm = LLM(**kw)
        vocab = self.llm.engine.model_config.vocab_size
        num = batch * args.requests_per_slot
        if args.prompts == "text":
            ids = text_prompts(self.llm.get_tokenizer(), num, args.prompt_len, args.seed)
        else:
            ids = make_prompts(num, args.prompt_len, vocab, args.seed)
        self.prompts = [{"prompt_token_ids": p} for p in ids]
        self.params = workload_params(num, args)
        self.llm.generate(self.prompts, self.params, use_tqdm=False)  # warm-up
        self.times: list[float] = []
        self.outs: Any = None
        self.metrics: dict[str, Any] = {}

    def timed(self) -> None:
        """Run the workload once; its wall time joins :attr:`times`, its metrics replace the last."""
        self.llm.reset_metrics()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        self.times.append(time.perf_counter() - t0)
        self.metrics = self.llm.get_metrics()

    def row(self, profile_top: int) -> dict[str, Any]:
        """The mode's result row (median wall time; metrics of the last timed run); with
        ``profile_top``, one more run under cProfile (not timed) and its top functions."""
        m, outs = self.metrics, self.outs
        profile = None
        if profile_top:
            self.llm.reset_metrics()
            prof = cProfile.Profile()
            prof.enable()
            self.llm.generate(self.prompts, self.params, use_tqdm=False)
            prof.disable()
            profile = top_functions(prof, profile_top, self.llm.get_metrics()["num_steps"])
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        wall = statistics.median(self.times)
        decode_steps = m["num_steps"]
        row = {
            "batch": self.batch,
            "mode": self.mode,
            "wall_s": wall,
            "wall_s_runs": list(self.times),
            "tok_per_s": tokens / wall,
            "generated_tokens": tokens,
            "target_forwards": decode_steps,
            "tokens_per_forward": tokens / decode_steps if decode_steps else 0.0,
            "token_ids": [o.outputs[0].token_ids for o in outs],
        }
        if "speculative" in m:
            s = m["speculative"]
            row.update(
                acceptance_rate=s["acceptance_rate"],
                mean_acceptance_length=s["mean_acceptance_length"],
                draft_tokens=s["num_draft_tokens"],
                verify_length_histogram=s["verify_length_histogram"],
                steps_without_drafting=s["num_steps_without_drafting"],
            )
            if "cost_model" in s:
                row["cost_model"] = s["cost_model"]
        if profile is not None:
            row["profile"] = profile
        return row


def top_functions(prof: cProfile.Profile, count: int, steps: int) -> list[dict[str, Any]]:
    """The ``count`` functions of the most cumulative time in ``prof``, in ms per engine step
    (``steps``: the profiled run's)."""
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_, calls, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(path).name}:{line}({name})", "calls": calls, "cum_s": cum})
    rows.sort(key=lambda r: -r["cum_s"])
    per_step = max(steps, 1)
    for r in rows:
        r["ms_per_step"] = 1e3 * r["cum_s"] / per_step
    return rows[:count]


def paired_ratios(base_times: list[float], times: list[float]) -> dict[str, Any]:
    """Throughput ratios of paired timed runs (run ``i`` of each mode ran back to back, so
    drifting machine load hits both alike): ``base / time`` per pair, their median, mean and
    standard deviation, the 95 % confidence interval of the mean (normal approximation:
    ``mean ± 1.96 sd / sqrt(runs)``, so take it from ~10 runs up) and how many are at least 1."""
    ratios = [b / t for b, t in zip(base_times, times, strict=True)]
    mean = statistics.fmean(ratios)
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    half = 1.96 * sd / len(ratios) ** 0.5
    return {
        "ratios": ratios,
        "runs": len(ratios),
        "median": statistics.median(ratios),
        "mean": mean,
        "sd": sd,
        "ci95": [mean - half, mean + half],
        "at_least_1": sum(r >= 1.0 for r in ratios),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        help="model directory (default: the built-in tiny model); 'bigram-mtp': the tiny model "
        "whose MTP layer predicts the target's greedy token after next (written to a temporary "
        "directory: deepinfer_core.testing.checkpoints.write_bigram_mtp_checkpoint)",
    )
    parser.add_argument("--backend", help="backend (default auto)")
    parser.add_argument("--batch-sizes", type=positive_ints, default=[1, 4, 16])
    parser.add_argument("--modes", default="none,fixed,dspark")
    parser.add_argument("--drafter", default="ngram")
    add_keep_quantized(
        parser, "LLM(keep_quantized=None|True|False): FP8/FP4 checkpoint weights kept quantised"
    )
    parser.add_argument(
        "--mixed-graph-max-tokens",
        type=int,
        default=None,
        help="LLM(mixed_graph_max_tokens=N): steps mixing prefills and decodes in graphs (0: eager; "
        "default: the engine's)",
    )
    parser.add_argument("--max-draft-tokens", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--length-spread",
        type=float,
        default=0.0,
        help="requests' max_tokens uniform in max_tokens * (1 ± spread) (0: all equal, so without "
        "speculation they finish together and their successors prefill in one step)",
    )
    parser.add_argument(
        "--prompts",
        choices=("repeat", "text"),
        default="repeat",
        help="repeat: random token blocks repeated; text: windows of the trained tiny model's held-out "
        "text (for the built-in model: drafts at its real operating point; pair with --presence-penalty 0)",
    )
    parser.add_argument("--presence-penalty", type=float, default=-2.0)
    parser.add_argument("--sampled", type=int, default=4, help="every N-th request samples (0: none)")
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=4,
        help="requests per batch slot (continuous batching refills)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "speculative.json")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="cProfile one more run per mode and batch; print (and store) the top N functions",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model == "bigram-mtp":
        from deepinfer_core.testing.checkpoints import write_bigram_mtp_checkpoint

        args.model = str(write_bigram_mtp_checkpoint(Path(tempfile.mkdtemp(prefix="bigram-mtp-"))))
    rows = []
    print(
        f"{'B':>4} {'mode':>7} {'tok/s':>9} {'forwards':>9} {'tok/fwd':>8} {'accept':>7} {'mean len':>8} "
        f"{'vs none':>8}",
        flush=True,
    )
    for b in args.batch_sizes:
        runs = [ModeRun(mode, b, args) for mode in args.modes.split(",")]
        for _ in range(args.repeats):  # interleaved, so drifting machine load hits every mode alike
            for run in runs:
                run.timed()
        base = None
        for run in runs:
            row = run.row(args.profile)
            mode = run.mode
            base = base or row
            row["same_tokens_as_first_mode"] = row["token_ids"] == base["token_ids"]
            row["speedup_vs_first_mode"] = row["tok_per_s"] / base["tok_per_s"]
            rows.append(row)
            print(
                f"{b:>4} {mode:>7} {row['tok_per_s']:>9.1f} {row['target_forwards']:>9} "
                f"{row['tokens_per_forward']:>8.2f} {row.get('acceptance_rate', 0.0):>7.2f} "
                f"{row.get('mean_acceptance_length', 0.0):>8.2f} {row['speedup_vs_first_mode']:>7.2f}x",
                flush=True,
            )
            for f in row.get("profile", []):
                print(f"        {f['ms_per_step']:8.3f} ms/step {f['calls']:>8} calls  {f['function']}")
        by_mode = {run.mode: run for run in runs}
        if "dspark" in by_mode and "fixed" in by_mode:
            paired = paired_ratios(by_mode["fixed"].times, by_mode["dspark"].times)
            low, high = paired["ci95"]
            next(r for r in rows if r["batch"] == b and r["mode"] == "dspark")["vs_fixed_per_run"] = paired
            print(
                f"{b:>4} dspark/fixed per run: median {paired['median']:.3f}, mean {paired['mean']:.3f}"
                f" ± {paired['sd']:.3f} (sd; the mean's 95 % CI {low:.3f}..{high:.3f}),"
                f" {paired['at_least_1']}/{paired['runs']} runs >= 1",
                flush=True,
            )
        del runs
    for r in rows:
        del r["token_ids"]
    result = {
        "benchmark": "speculative decoding: dspark vs fixed vs none",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": rows,
    }
    write_json(args.out, result, device="cuda" if torch.cuda.is_available() else None)
    return result


if __name__ == "__main__":
    main()
