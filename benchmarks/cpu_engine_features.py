"""Prefix caching and async scheduling, each on and off, on CPU with the built-in tiny model."""

from __future__ import annotations

from deepinfer_core.benchmarking import harness as h


def run_once(llm, waves: list[list[list[int]]], max_tokens: int) -> dict:
    """The waves through ``llm`` in turn: time, throughput and prompt tokens hit / replayed."""
    h.generate(llm, h.random_prompts(1, 8, seed=99), h.greedy(2))  # warm-up
    llm.reset_metrics()
    runs = [h.generate(llm, wave, h.greedy(max_tokens)) for wave in waves]
    outs, seconds, m = [o for got, _ in runs for o in got], sum(s for _, s in runs), llm.get_metrics()
    hit, replayed = m["num_prefix_hit_tokens"], m["num_replayed_tokens"]
    prompt, new = sum(len(p) for wave in waves for p in wave), h.new_tokens(outs)
    return {"seconds": seconds, "prompt_tokens": prompt, "new_tokens": new,
            "total_tok_s": (prompt + new) / seconds, "output_tok_s": new / seconds,
            "prefix_hit_tokens": hit, "replayed_tokens": replayed,
            "computed_prompt_tokens": prompt - hit + replayed}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ints = {"num_prompts": 32, "prefix_len": 512, "suffix_len": 16, "max_tokens": 32, "seed": 0}
    ap = h.parser(__doc__, "cpu_engine_features", **ints)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    args = h.parse(ap, argv)
    from deepinfer_core import LLM
    from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir

    prefix = h.random_prompts(1, args.prefix_len, args.seed)[0]
    shared = [prefix + s for s in h.random_prompts(args.num_prompts, args.suffix_len, args.seed + 1)]
    independent = h.random_prompts(args.num_prompts, args.suffix_len + 16, args.seed + 2)
    workloads = {"shared-prefix": ("prefix_caching", [shared[:1], shared[1:]], "enable_prefix_caching"),
                 "async": ("async_scheduling", [independent], "async_scheduling")}  # fmt: skip
    model, rows = args.model or str(builtin_tiny_model_dir()), []
    for workload, (feature, waves, option) in workloads.items():
        for on in (False, True):
            kw = {"enable_prefix_caching": False, option: on}
            llm = LLM(model=model, backend="reference", dtype="float32", max_num_seqs=64, **kw)
            rows.append({"workload": workload, "feature": feature, "enabled": on,
                         **run_once(llm, waves, args.max_tokens)})  # fmt: skip
    cols = "workload feature enabled seconds:.2f total_tok_s:.0f output_tok_s:.0f prompt_tokens:d"
    h.print_table(rows, cols + " computed_prompt_tokens:d prefix_hit_tokens:d replayed_tokens:d")
    for workload in workloads:
        off, on = (r for r in rows if r["workload"] == workload)
        print(f"{workload}: feature on is {off['seconds'] / on['seconds']:.2f}x the speed of off")
    h.write_json(args.output, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    h.run_main(main)
