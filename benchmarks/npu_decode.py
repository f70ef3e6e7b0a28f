"""Decode and prefill tok/s of the ``ascend950`` backend on an Ascend NPU, per chip, beside the
public anchor: CANN's reference implementation decodes DeepSeek-V4-Flash at 19.6 ms/step at 8k
context x batch 8 on 8 x Ascend 950PR (8 tokens / 19.6 ms = 408 tok/s, 51 tok/s per chip).

``--batch`` requests of ``--context`` prompt tokens each are prefilled together (timed: prefill
tok/s), then decode ``--decode-steps`` tokens each (timed after the first token: decode tok/s and
ms/step).  One process drives ``--chips`` NPUs (the engine's tensor / expert parallelism is not
set up here; with ``--chips 1`` the model must fit one chip); per-chip figures divide by it.
Prints a table and writes JSON (default ``benchmarks/results/npu_decode.json``)::

    deepinfer bench npu-decode --model /path/to/DeepSeek-V4-Flash --batch 8 --context 8192

Without an NPU (no ``torch_npu``, no CANN, no visible device) it prints one line saying why and
exits with status 2: the figures exist only on the hardware.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ANCHOR = {
    "source": "CANN reference implementation, DeepSeek-V4-Flash on 8 x Ascend 950PR",
    "context": 8192,
    "batch": 8,
    "chips": 8,
    "ms_per_step": 19.6,
}
"""The public decode anchor the results are printed beside."""
DEFAULT_OUTPUT = Path(__file__).parent / "results" / "npu_decode.json"


def anchor_tok_s_per_chip() -> float:
    """The anchor's decode tok/s per chip (one token per request per step)."""
    return ANCHOR["batch"] / (ANCHOR["ms_per_step"] / 1000) / ANCHOR["chips"]


def npu_problem() -> str | None:
    """Why this machine cannot run the benchmark (``None`` when an NPU is usable)."""
    try:
        from deepinfer_ascend950.backend import is_available
    except ImportError:
        return "the ascend950 plugin is not installed (pip install -e 'plugins/ascend950[npu]')"
    ok, reason = is_available()
    return None if ok else reason


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=False, help="checkpoint directory (DeepSeek-V4 / V4.1)")
    p.add_argument("--batch", type=int, default=ANCHOR["batch"], help="concurrent requests")
    p.add_argument("--context", type=int, default=ANCHOR["context"], help="prompt tokens per request")
    p.add_argument("--decode-steps", type=int, default=64, help="new tokens per request")
    p.add_argument("--chips", type=int, default=1, help="NPUs the run uses (per-chip figures divide by it)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON output path")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Prefill then decode on the NPU; the measured figures (seconds, tok/s, per chip)."""
    import torch

    from deepinfer_core import LLM, SamplingParams
    from deepinfer_core.benchmarking.harness import timed

    llm = LLM(
        model=args.model,
        backend="ascend950",
        device="npu",
        dtype=args.dtype,
        max_num_seqs=args.batch,
        max_model_len=args.context + args.decode_steps + 1,
    )
    vocab = llm.engine.runner.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (args.context,), generator=gen).tolist() for _ in range(args.batch)]
    sync = torch.npu.synchronize  # type: ignore[attr-defined]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:1], first, use_tqdm=False)  # warm-up
    _, prefill_s = timed(lambda: llm.generate(prompts, first, use_tqdm=False), sync)
    full = SamplingParams(temperature=0, max_tokens=args.decode_steps + 1, ignore_eos=True)
    _, total_s = timed(lambda: llm.generate(prompts, full, use_tqdm=False), sync)
    decode_s = max(total_s - prefill_s, 1e-9)
    decode_tok_s = args.batch * args.decode_steps / decode_s
    prefill_tok_s = args.batch * args.context / prefill_s
    return {
        "batch": args.batch,
        "context": args.context,
        "decode_steps": args.decode_steps,
        "chips": args.chips,
        "prefill_s": prefill_s,
        "prefill_tok_s_per_chip": prefill_tok_s / args.chips,
        "decode_ms_per_step": 1000 * decode_s / args.decode_steps,
        "decode_tok_s_per_chip": decode_tok_s / args.chips,
        "anchor": {**ANCHOR, "decode_tok_s_per_chip": anchor_tok_s_per_chip()},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = npu_problem()
    if problem is not None:
        print(f"npu-decode: no usable Ascend NPU here, nothing to measure: {problem}", file=sys.stderr)
        return 2
    if not args.model:
        print("npu-decode: --model is required (a DeepSeek-V4 / V4.1 checkpoint directory)", file=sys.stderr)
        return 2
    from deepinfer_core.benchmarking.harness import print_table, write_json

    report = run(args)
    rows = [
        {"what": "this run", **{k: report[k] for k in ("decode_ms_per_step", "decode_tok_s_per_chip")}},
        {
            "what": "anchor (CANN, 8 x 950PR)",
            "decode_ms_per_step": ANCHOR["ms_per_step"],
            "decode_tok_s_per_chip": anchor_tok_s_per_chip(),
        },
    ]
    columns = [("", "what", "s"), ("ms/step", "decode_ms_per_step", ".1f")]
    print_table(rows, [*columns, ("tok/s/chip", "decode_tok_s_per_chip", ".1f")])
    print(f"prefill: {report['prefill_tok_s_per_chip']:.0f} tok/s per chip")
    write_json(args.output, report, device="npu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
