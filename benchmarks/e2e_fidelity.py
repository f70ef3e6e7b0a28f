"""Fidelity of the e2e benchmark model (``gpu_e2e.py``) on a fast GPU backend against the reference.

The fp32 reference runs first (the oracle), then each candidate of ``--candidates``: ``floor``
(the bf16 reference: the bf16 floor) and the backend with its FP8 prefill maths ``w8a16`` (the
default) and ``w8a8``; the JSON (``--output``) is rewritten after every candidate, so a run cut
short keeps the rows it measured.  Each engine loads the whole checkpoint (the fp32 one
dequantises every weight): on an H200 a full run takes several minutes, so the oracle's outputs
are kept (``--oracle-cache``, default ``MODEL_DIR/fidelity_oracle.json``, reused when its
parameters match) and the rows already in ``--output`` for the same parameters are kept beside
the new ones: ``--candidates floor`` then ``--candidates w8a16,w8a8`` measure the whole table in
two shorter runs."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import _gpu_model as gm  # noqa: E402

from deepinfer_core.benchmarking import harness as h  # noqa: E402


def positions(llm: Any, ids: list[list[int]], new_tokens: int, top: int) -> list[dict[str, Any]]:
    """Greedy tokens and ``{token: logprob}`` per position (prompt after the first, then generated)."""
    from deepinfer_core import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=top, prompt_logprobs=top)
    outs, _ = h.generate(llm, ids, params)
    return [{"tokens": list(o.outputs[0].token_ids),
             "positions": [{int(t): float(lp) for t, lp in pos.items()}
                           for pos in [*(o.prompt_logprobs or []), *(o.outputs[0].logprobs or [])] if pos]}
            for o in outs]  # fmt: skip


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """|dlogprob| over the reference's top tokens (a token missing from ``got``'s list counts as
    its floor), top-1 agreement and the first greedy divergence of each prompt."""
    errs, agree, total, divergence = [], 0, 0, []
    for r, g in zip(ref, got, strict=True):
        for rp, gp in zip(r["positions"], g["positions"], strict=False):
            ranked = sorted(rp.items(), key=lambda kv: -kv[1])[:top]
            errs += [abs(gp.get(tok, min(gp.values())) - lp) for tok, lp in ranked]
            total, agree = total + 1, agree + (max(gp, key=gp.get) == ranked[0][0])
        pairs = enumerate(zip(r["tokens"], g["tokens"], strict=False))
        divergence.append(next((i for i, (a, b) in pairs if a != b), None))
    errs.sort()
    return {"max_abs_dlogprob": errs[-1], "p99_abs_dlogprob": errs[int(0.99 * (len(errs) - 1))],
            "mean_abs_dlogprob": sum(errs) / len(errs), "top1_agreement": agree / total, "positions": total,
            "greedy_equal": sum(d is None for d in divergence), "first_divergence": divergence}  # fmt: skip


CANDIDATES = ("floor", "w8a16", "w8a8")
"""``--candidates``: the bf16 reference, the backend with each FP8 prefill math."""
KEYED = ("layers", "experts", "prompts", "prompt_len", "new_tokens", "top", "seed")
"""The parameters that fix the oracle's outputs and a row's meaning."""


def key(args: Any) -> dict[str, int]:
    """The parameters of :data:`KEYED` of a run."""
    return {k: getattr(args, k) for k in KEYED}


def _read(path: Path) -> dict[str, Any]:
    """The JSON object at ``path``; empty where it is absent or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cached_oracle(path: Path, params: dict[str, int]) -> list[dict[str, Any]] | None:
    """The oracle outputs stored at ``path`` for ``params``, or ``None`` (absent, unreadable or
    of other parameters)."""
    data = _read(path)
    return data.get("outputs") if data.get("params") == params else None


def kept_rows(path: Path, params: dict[str, int], measured: set[tuple[str, str]]) -> list[dict[str, Any]]:
    """The rows of an earlier ``--output`` at ``path`` for ``params`` that this run does not
    measure again (``measured``: ``(backend, fp8_prefill)`` pairs)."""
    data = _read(path)
    if {k: data.get("params", {}).get(k) for k in params} != params:
        return []
    return [r for r in data.get("rows", []) if (r.get("backend"), r.get("fp8_prefill")) not in measured]


def main() -> None:
    ints = {"layers": 4, "experts": 64, "prompts": 4, "prompt_len": 512}
    ap = h.parser(__doc__, "e2e_fidelity", threads=None, **ints, new_tokens=16, top=5, seed=0)
    ap.add_argument("--model-dir", type=Path, required=True, help="checkpoint folder (written when absent)")
    ap.add_argument("--backend", default="cuda_sm100")
    ap.add_argument(
        "--candidates", type=h.choice_list(CANDIDATES), default=list(CANDIDATES),
        help=f"comma-separated, of {','.join(CANDIDATES)} (default all)",
    )  # fmt: skip
    ap.add_argument(
        "--oracle-cache", type=Path, help="the oracle's outputs (default MODEL_DIR/fidelity_oracle.json)"
    )
    args = h.parse(ap)
    if not torch.cuda.is_available():
        raise SystemExit("error: e2e_fidelity needs a CUDA GPU")
    from deepinfer_core import LLM

    cfg = gm.flash_config(args.layers, args.experts)
    gm.write_checkpoint(args.model_dir, cfg, args.seed, torch.device("cuda"), torch.bfloat16, h.log)
    ids = h.random_prompts(args.prompts, args.prompt_len, args.seed, cfg["vocab_size"])
    common = {"max_num_seqs": args.prompts, "max_model_len": args.prompt_len + args.new_tokens + 16}
    oracle = {"backend": "reference", "keep_quantized": False, "enforce_eager": True, **common}

    def measure(dtype: str, maths: tuple[str | None, ...] = (None,), **kw: Any) -> list[list[dict[str, Any]]]:
        """One engine's outputs, once per ``DEEPINFER_FP8_PREFILL`` math of ``maths``."""
        llm, got = LLM(str(args.model_dir), dtype=dtype, **kw), []
        for math in maths:
            os.environ.update({"DEEPINFER_FP8_PREFILL": math} if math else {})
            got.append(positions(llm, ids, args.new_tokens, args.top))
        os.environ.pop("DEEPINFER_FP8_PREFILL", None)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return got

    params = key(args)
    cache = args.oracle_cache or args.model_dir / "fidelity_oracle.json"
    ref = cached_oracle(cache, params)
    if ref is None:
        ref = measure("float32", **oracle)[0]
        cache.write_text(json.dumps({"params": params, "outputs": ref}))
        h.log(f"reference (float32, dequantised weights) done, kept in {cache}")
    else:
        h.log(f"reference (float32, dequantised weights) read from {cache}")
    maths = tuple(m for m in ("w8a16", "w8a8") if m in args.candidates)
    measured = {(args.backend, m) for m in maths}
    if "floor" in args.candidates:
        measured.add(("reference", "-"))
    rows = kept_rows(args.output, params, measured)

    def record(backend: str, math: str, got: list[dict[str, Any]]) -> None:
        """One candidate's row, the JSON rewritten with every row so far (a run cut short keeps them)."""
        rows.append({"backend": backend, "fp8_prefill": math, **compare(ref, got, args.top)})
        h.write_json(args.output, {"params": vars(args), "rows": rows}, device="cuda", quiet=True)
        h.log(f"{backend} ({math}) done")

    if "floor" in args.candidates:
        record("reference", "-", measure("bfloat16", **oracle)[0])
    if maths:
        fast = measure("bfloat16", maths, backend=args.backend, keep_quantized=True, **common)
        for math, got in zip(maths, fast, strict=True):
            record(args.backend, math, got)
    cols = "backend fp8_prefill max_abs_dlogprob:.4f p99_abs_dlogprob:.4f mean_abs_dlogprob:.4f"
    h.print_table(rows, cols + " top1_agreement:.3f greedy_equal:d")
    h.write_json(args.output, {"params": vars(args), "rows": rows}, device="cuda")


if __name__ == "__main__":
    h.run_main(main)
