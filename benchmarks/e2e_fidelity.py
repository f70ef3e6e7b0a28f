"""Fidelity of the e2e benchmark model: a fast backend against the reference, on the same checkpoint.

The model of ``benchmarks/gpu_e2e.py`` (DeepSeek-V4-Flash widths, native FP8 / FP4 checkpoint).
The oracle is the ``reference`` backend in float32 on the dequantised weights (``keep_quantized``
off, CUDA graphs off); the candidate is ``--backend`` (default ``cuda_sm100``) in bfloat16 with
the checkpoint's FP8 / FP4 weights kept quantised, once per FP8 prefill math
(``DEEPINFER_FP8_PREFILL`` = ``w8a16``, ``w8a8``); the reference itself in bfloat16 is the
floor (what bf16 rounding alone costs on this model).  Both run the same prompts greedily with
``prompt_logprobs`` and ``logprobs`` (top ``--top``), so every prompt position and every
generated position is compared:

* ``max |dlogprob|`` over the reference's top-``--top`` tokens at every position (the
  candidate's logprob of the same token; missing from its top list counts as its floor);
* top-1 agreement over prompt positions (the candidate's argmax = the reference's);
* greedy tokens equal (first divergence reported).

    python benchmarks/e2e_fidelity.py --model-dir /tmp/m [--prompts 4 --prompt-len 512 --new-tokens 16]

Prints a table and writes JSON (default ``benchmarks/results/e2e_fidelity.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import _gpu_model as gm  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402

FIRST_ID = 4


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random ids in ``[FIRST_ID, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_ID, vocab, (length,), generator=g).tolist() for _ in range(count)]


def run(llm: LLM, ids: list[list[int]], new_tokens: int, top: int) -> list[dict[str, Any]]:
    """Greedy outputs with prompt and sample logprobs: per prompt ``{"tokens", "positions"}``,
    ``positions`` a list of ``{token: logprob}`` (prompt positions after the first, then the
    generated ones)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=top, prompt_logprobs=top)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    result = []
    for out in outs:
        comp = out.outputs[0]
        positions = [
            {int(t): float(lp) for t, lp in pos.items()} for pos in (out.prompt_logprobs or []) if pos
        ]
        positions += [{int(t): float(lp) for t, lp in pos.items()} for pos in comp.logprobs or []]
        result.append({"tokens": list(comp.token_ids), "positions": positions})
    return result


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """The fidelity figures of ``got`` against ``ref`` (see the module docstring)."""
    max_err, errs, agree, total, divergence = 0.0, [], 0, 0, []
    for r, g in zip(ref, got, strict=True):
        n = min(len(r["positions"]), len(g["positions"]))
        for rp, gp in zip(r["positions"][:n], g["positions"][:n], strict=True):
            floor = min(gp.values())
            ranked = sorted(rp.items(), key=lambda kv: -kv[1])[:top]
            for tok, lp in ranked:
                e = abs(gp.get(tok, floor) - lp)
                errs.append(e)
                max_err = max(max_err, e)
            total += 1
            agree += max(gp, key=gp.get) == ranked[0][0]
        first = next(
            (i for i, (a, b) in enumerate(zip(r["tokens"], g["tokens"], strict=False)) if a != b), None
        )
        divergence.append(first)
    errs.sort()
    return {
        "max_abs_dlogprob": max_err,
        "p99_abs_dlogprob": errs[int(0.99 * (len(errs) - 1))] if errs else None,
        "mean_abs_dlogprob": sum(errs) / len(errs) if errs else None,
        "top1_agreement": agree / total if total else None,
        "positions": total,
        "greedy_equal": sum(d is None for d in divergence),
        "first_divergence": divergence,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True, help="checkpoint folder (written when absent)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--backend", default="cuda_sm100")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e_fidelity.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cfg_dict = gm.flash_config(args.layers, args.experts)
    if not gm.model_ready(args.model_dir, cfg_dict, args.seed):
        print(f"writing the checkpoint to {args.model_dir}", flush=True)
        gm.write_checkpoint(args.model_dir, cfg_dict, args.seed, torch.device("cuda"), torch.bfloat16)
    ids = prompts(args.prompts, args.prompt_len, cfg_dict["vocab_size"], args.seed)
    common = {"max_num_seqs": args.prompts, "max_model_len": args.prompt_len + args.new_tokens + 16}
    t0 = time.perf_counter()
    oracle = {"backend": "reference", "dtype": "float32", "keep_quantized": False, "enforce_eager": True}
    ref_llm = LLM(str(args.model_dir), **oracle, **common)
    ref = run(ref_llm, ids, args.new_tokens, args.top)
    del ref_llm
    gc.collect()
    torch.cuda.empty_cache()
    print(f"reference (float32, dequantised weights): {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    # the floor: the reference itself in bfloat16 (same dequantised weights, graphs off)
    bf16_ref = LLM(str(args.model_dir), **(oracle | {"dtype": "bfloat16"}), **common)
    rows.append({"backend": "reference", "dtype": "bfloat16", "fp8_prefill": "-"})
    rows[-1] |= compare(ref, run(bf16_ref, ids, args.new_tokens, args.top), args.top)
    del bf16_ref
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(args.model_dir), backend=args.backend, dtype="bfloat16", keep_quantized=True, **common)
    for math in ("w8a16", "w8a8"):
        os.environ["DEEPINFER_FP8_PREFILL"] = math
        row = {"backend": args.backend, "dtype": "bfloat16", "fp8_prefill": math}
        row |= compare(ref, run(llm, ids, args.new_tokens, args.top), args.top)
        rows.append(row)
    os.environ.pop("DEEPINFER_FP8_PREFILL", None)
    print(f"{'candidate':<34} {'max|dlp|':>9} {'p99|dlp|':>9} {'mean|dlp|':>9} {'top1':>7} {'greedy eq':>10}")
    for r in rows:
        kept = "dequantised" if r["backend"] == "reference" else f"FP8/FP4 kept, {r['fp8_prefill']}"
        label = f"{r['backend']} bf16 {kept}"
        print(
            f"{label:<34} {r['max_abs_dlogprob']:>9.4f} {r['p99_abs_dlogprob']:>9.4f} "
            f"{r['mean_abs_dlogprob']:>9.4f} {r['top1_agreement']:>7.3f} "
            f"{r['greedy_equal']:>6}/{args.prompts}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "e2e model fidelity: backend (bf16, FP8/FP4 kept) vs reference "
                "(fp32, dequantised)",
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "device": torch.cuda.get_device_name(),
                "host": platform.node(),
                "command": [sys.executable, *sys.argv],
                "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
