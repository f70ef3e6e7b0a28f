"""Decode and prefill tok/s of the ``ascend950`` backend per Ascend NPU chip, beside CANN's anchor."""

from __future__ import annotations

import sys
from typing import Any

from deepinfer_core.benchmarking import harness as h

ANCHOR: dict[str, Any] = {"source": "CANN reference implementation, DeepSeek-V4-Flash on 8 x Ascend 950PR",
                          "context": 8192, "batch": 8, "chips": 8, "decode_ms_per_step": 19.6}  # fmt: skip
"""The public decode anchor the results are printed beside."""
ANCHOR["decode_tok_s_per_chip"] = ANCHOR["batch"] / (ANCHOR["decode_ms_per_step"] / 1000) / ANCHOR["chips"]


def npu_problem() -> str | None:
    """Why this machine cannot run the benchmark (``None`` when an NPU is usable)."""
    try:
        from deepinfer_ascend950.backend import is_available
    except ImportError:
        return "the ascend950 plugin is not installed (pip install -e 'plugins/ascend950[npu]')"
    ok, reason = is_available()
    return None if ok else reason


def run(a: Any) -> dict[str, Any]:
    """Prefill then decode on the NPU; the measured figures (seconds, tok/s, per chip)."""
    import torch

    from deepinfer_core import LLM

    llm = LLM(model=a.model, backend="ascend950", device="npu", dtype=a.dtype, max_num_seqs=a.batch,
              max_model_len=a.context + a.decode_steps + 1)  # fmt: skip
    prompts = h.random_prompts(a.batch, a.context, 0, llm.engine.model_config.vocab_size)
    sync = torch.npu.synchronize  # type: ignore[attr-defined]
    h.generate(llm, prompts[:1], h.greedy(1))  # warm-up
    _, prefill_s = h.timed(lambda: h.generate(llm, prompts, h.greedy(1)), sync)
    _, total_s = h.timed(lambda: h.generate(llm, prompts, h.greedy(a.decode_steps + 1)), sync)
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"batch": a.batch, "context": a.context, "decode_steps": a.decode_steps, "chips": a.chips,
            "prefill_s": prefill_s, "prefill_tok_s_per_chip": a.batch * a.context / prefill_s / a.chips,
            "decode_ms_per_step": 1000 * decode_s / a.decode_steps, "anchor": ANCHOR,
            "decode_tok_s_per_chip": a.batch * a.decode_steps / decode_s / a.chips}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = h.parser(__doc__, "npu_decode", threads=None)
    ap.add_argument("--model", required=True, help="checkpoint directory (DeepSeek-V4 / V4.1)")
    ap.add_argument("--batch", type=int, default=ANCHOR["batch"], help="concurrent requests")
    ap.add_argument("--context", type=int, default=ANCHOR["context"], help="prompt tokens per request")
    ap.add_argument("--decode-steps", type=int, default=64, help="new tokens per request")
    ap.add_argument("--chips", type=int, default=1, help="NPUs the run uses (per-chip figures divide by it)")
    ap.add_argument("--dtype", default="bfloat16")
    args = h.parse(ap, argv)
    if (problem := npu_problem()) is not None:
        print(f"npu-decode: no usable Ascend NPU here, nothing to measure: {problem}", file=sys.stderr)
        return 2
    report = run(args)
    rows = [{"what": "this run", **report}, {"what": "anchor (CANN, 8 x 950PR)", **ANCHOR}]
    h.print_table(rows, "what decode_ms_per_step:.1f decode_tok_s_per_chip:.1f")
    print(f"prefill: {report['prefill_tok_s_per_chip']:.0f} tok/s per chip")
    h.write_json(args.output, report, device="npu")
    return 0


if __name__ == "__main__":
    h.run_main(main)
