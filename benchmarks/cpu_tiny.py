"""CPU throughput of DeepInfer vs HF transformers' ``generate`` on the built-in tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepinfer_core.benchmarking import harness as h
from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir
from deepinfer_core.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return (and write) the JSON report."""
    ap = h.parser(__doc__, "cpu_tiny", threads=0, num_prompts=64, max_tokens=64, prompt_len=32)
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the built-in tiny model)")
    ap.add_argument("--skip-hf", action="store_true", help="time DeepInfer only")
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine; the fastest is reported")
    ap.add_argument("--backend", default="auto", help="DeepInfer's backend (default: the one 'auto' picks)")
    args = h.parse(ap, argv)
    from deepinfer_core import LLM

    model_dir = args.model or builtin_tiny_model_dir()
    tok = load_tokenizer(model_dir)
    workloads = {
        w: h.corpus_prompts(tok, args.num_prompts, args.prompt_len, w == "mixed") for w in ("equal", "mixed")
    }
    hf, backend = None, ""
    if not args.skip_hf:
        from transformers import DeepseekV4ForCausalLM

        hf = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # not min_new_tokens: that masks EOS, changing argmax
        h.hf_generate(hf, workloads["equal"][:2], 2)  # warm-up
    runs: dict[str, list[float]] = {"hf": [], "equal": [], "mixed": []}
    new: dict[str, int] = {}
    for _ in range(args.repeat):  # the engines in turn, each one's fastest kept: the VM is noisy
        if hf is not None:
            ids, s, _ = h.hf_generate(hf, workloads["equal"], args.max_tokens)
            new["hf"] = sum(map(len, ids))
            runs["hf"].append(s)
        for w, prompts in workloads.items():  # a fresh engine each run: no prefix hits across runs
            llm = LLM(model=str(model_dir), backend=args.backend, dtype="float32", max_num_seqs=len(prompts))
            h.generate(llm, prompts[:2], h.greedy(2))  # warm-up
            outs, s = h.generate(llm, prompts, h.greedy(args.max_tokens))
            backend = llm.engine.backend.name
            new[w] = h.new_tokens(outs)
            runs[w].append(s)
    results = []
    for w, times in runs.items():
        if times:
            engine, workload = ("hf", "equal") if w == "hf" else ("deepinfer", w)
            prompts = workloads[workload]
            results.append({"engine": engine, "workload": workload, "num_prompts": len(prompts),
                            "prompt_tokens": sum(map(len, prompts)), "new_tokens": new[w],
                            "seconds": min(times), "tokens_per_s": new[w] / min(times)})  # fmt: skip
    for r in results:
        r["vs_hf"] = r["tokens_per_s"] / results[0]["tokens_per_s"] if hf is not None else None
    print(f"deepinfer backend: {backend}")
    cols = "engine workload num_prompts:d prompt_tokens:d new_tokens:d seconds:.2f tokens_per_s:.1f vs_hf:.2f"
    h.print_table(results, cols)
    report = {"args": vars(args), "model_dir": str(model_dir), "backend": backend, "results": results,
              "all_runs_seconds": runs}  # fmt: skip
    h.write_json(args.output, report)
    return report


if __name__ == "__main__":
    h.run_main(main)
