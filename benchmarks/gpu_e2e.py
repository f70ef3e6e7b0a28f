"""End-to-end GPU benchmark: DeepInfer vs HF transformers on a 4-layer DeepSeek-V4-Flash-width model.

The model (:mod:`_gpu_model`): V4-Flash widths (hidden 4096, 64 heads x 512, q/o LoRA 1024 with
8 output groups, indexer 64 x 128 top-512, window 128, CSA ratio 4 / HCA ratio 128, mHC x4,
vocab 129280) cut to ``--layers`` layers ``[sliding, CSA, HCA, CSA]`` with ``--experts`` routed
experts (width 2048, top-6, one shared expert, hash routing on the first 3 layers).  Random
seeded weights are drawn on the GPU and written as a native checkpoint (FP8 dense linears, FP4
routed experts, about 6 GiB at the defaults) to ``--model-dir`` or a temporary folder.  Prompts
are random token ids (no tokenizer); every request is greedy with ``ignore_eos``.

Measured in one run (each engine is freed before the next is built):

- DeepInfer ``LLM(backend=--backend, dtype=bfloat16, max_num_seqs=B)`` decode tok/s at each
  ``--batch-sizes`` B (B prompts of ``--prompt-len`` ids, ``--new-tokens`` tokens each);
- DeepInfer prefill tok/s: ``--prefill-batch`` x ``--prompt-len`` prompts and one
  ``--prefill-long`` prompt, ``max_tokens=1`` (time from arrival to the last first token);
- HF ``DeepseekV4ForCausalLM`` (eager attention, weights dequantised to bf16 by DeepInfer's
  loader) decode at ``--hf-batch-sizes`` and the same prefills (``--skip-hf`` to leave out;
  failures such as OOM are recorded, not raised);
- with ``--pareto``: prefill tok/s vs time to first token over ``--pareto-batch-sizes`` x
  ``--pareto-chunks`` (``max_num_batched_tokens``) for DeepInfer and the batch sizes for HF,
  drawn to ``--pareto-png`` when matplotlib is importable.

Decode tok/s is taken over the steps where all B requests decode (the steady batch); the
brief's per-request figure ``B*(new-1) / (last token - last first token)`` and the exact
token count after the last first token are stored beside it.  Roofline fractions divide the
measurement by the weight-read bound at ``--hbm-bw`` bytes/s (every weight read once per step;
routed experts: the expected number of distinct experts ``E*(1-(1-k/E)^T)`` that ``T`` uniformly
routed tokens touch; KV-cache reads not counted), for weights in bf16 as DeepInfer loads them
today and in the checkpoint's FP8/FP4 format; prefill rows also give the fraction of the
matmul-FLOP bound at ``--peak-flops``.  Prints a table; writes JSON (``--out``) after every
measurement, so a run cut short keeps what it measured.

On an H200, everything in one command (the model is written to a temporary folder)::

    python benchmarks/gpu_e2e.py --pareto --out $OUT/gpu_e2e.json --pareto-png $OUT/prefill_pareto.png

or in parts that each fit a 10-minute command, keeping the checkpoint in an ignored folder and
merging the rows into one JSON (``--time-budget`` skips, and records, what would start late)::

    A="--model-dir out/gpu_e2e_model --append --time-budget 480"
    timeout 590 python benchmarks/gpu_e2e.py $A --skip-hf; cp benchmarks/results/gpu_e2e.json $OUT/
    timeout 590 python benchmarks/gpu_e2e.py $A --skip-ours; cp benchmarks/results/gpu_e2e.json $OUT/
    timeout 590 python benchmarks/gpu_e2e.py $A --skip-decode --skip-prefill --pareto \
        --pareto-png $OUT/prefill_pareto.png; cp benchmarks/results/gpu_e2e.json $OUT/

``--smoke`` runs every part on the CPU at tiny widths with a few tokens (seconds): the code path.
``--plot-only JSON`` redraws the chart from a results file.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import _gpu_model as gm  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.benchmarking.harness import (  # noqa: E402
    H200_BF16_FLOPS,
    H200_HBM_BW,
    KEEP_QUANTIZED,
    add_keep_quantized,
    compute_tok_s,
    log,
    machine_info,
    positive_ints,
    weight_read_tok_s,
)
from deepinfer_core.benchmarking.harness import (  # noqa: E402
    print_table as harness_table,
)
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from deepinfer_core.models.deepseek_v4.loader import load_checkpoint  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_e2e.json"
DEFAULT_PNG = ROOT / "docs" / "prefill_pareto.png"
FIRST_ID = 4  # prompts draw ids in [FIRST_ID, vocab): 0..3 are BOS/EOS/chat specials by convention
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# Defaults: (full run, --smoke).  Arguments left unset take the column of the mode.
MODE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "device": (None, "cpu"),
    "dtype": ("bfloat16", "float32"),
    "experts": (64, 8),
    "batch_sizes": ([1, 16, 64, 256], [1, 4]),
    "prompt_len": (512, 32),
    "new_tokens": (32, 4),
    "max_num_batched_tokens": (8192, 64),
    "prefill_batch": (16, 4),
    "prefill_long": (8192, 256),
    "hf_batch_sizes": ([1, 16], [1, 4]),
    "pareto_batch_sizes": ([1, 2, 4, 8, 16], [1, 2]),
    "pareto_chunks": ([2048, 8192], [64, 128]),
    "pareto_prompt_len": (2048, 48),
    "context_batch": (16, 2),
}
CONTEXTS = ("4096,32768,131072,1@4096,1@1048576", "64,256,1@64,1@1024")  # --contexts alone: (full, smoke)


class Unfit(Exception):
    """A measurement that cannot run on this machine (recorded as one line, no traceback)."""


T_START = time.perf_counter()  # --time-budget counts from here


# ---- results ---------------------------------------------------------------------------------------
class Report:
    """Rows of results, written to ``path`` as JSON after every change."""

    def __init__(self, path: Path, header: dict[str, Any], append: bool):
        self.path = path
        self.data: dict[str, Any] = {"runs": [], "results": [], "pareto": {}, "engines": []}
        if append and path.is_file():
            self.data.update(json.loads(path.read_text()))
        self.data["runs"].append(header)
        self.data.update({k: v for k, v in header.items() if k in ("machine", "model", "roofline")})

    def add(self, row: dict[str, Any]) -> None:
        rows = [r for r in self.data["results"] if r["name"] != row["name"]]
        self.data["results"] = [*rows, row]
        self.save()

    def error(self, name: str, err: BaseException | str, kind: str = "error") -> None:
        text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        self.add({"name": name, "value": None, "unit": None, kind: text[:2000]})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


class Roofline:
    """Weight-read and matmul-FLOP bounds of the benchmark model."""

    def __init__(self, cfg: DeepseekV4Config, hbm_bw: float, peak_flops: float):
        self.cfg, self.bw, self.peak = cfg, hbm_bw, peak_flops
        self.counts = gm.param_counts(cfg)

    def step_bytes(self, tokens: int, fmt: str) -> float:
        return gm.weight_bytes_per_step(self.cfg, tokens, fmt)

    def decode_tok_s(self, batch: int, fmt: str, kv_bytes: float = 0.0) -> float:
        """Decode tok/s if a step of ``batch`` tokens took exactly its weight (+ KV) read time."""
        return weight_read_tok_s(batch, self.step_bytes(batch, fmt) + kv_bytes, self.bw)

    def prefill_tok_s(self, step_tokens: list[int], fmt: str) -> float:
        """Prefill tok/s if each step (of ``step_tokens`` tokens) took its weight-read time."""
        seconds = sum(self.step_bytes(t, fmt) for t in step_tokens) / self.bw
        return sum(step_tokens) / seconds

    def compute_tok_s(self) -> float:
        """Prefill tok/s at the FLOP peak counting matmul weights only (2 FLOPs per active
        weight per token; attention scores and the indexer excluded)."""
        return compute_tok_s(2 * self.counts["active_per_token"], self.peak)

    def fractions(
        self, value: float, *, batch: int | None = None, steps: list[int] | None = None, kv: float = 0.0
    ) -> dict:
        """``value`` as a fraction of the read bounds of a decode step of ``batch`` tokens (weights
        plus ``kv`` KV-cache bytes), or of a prefill run in ``steps`` (tokens per step; prefill
        also gets the FLOP bound)."""
        out: dict[str, float] = {}
        for f in ("bf16", "fp8_fp4"):
            bound = (
                self.decode_tok_s(batch, f, kv) if batch is not None else self.prefill_tok_s(steps or [], f)
            )
            out[f"roofline_tok_s_{f}"] = bound
            out[f"roofline_frac_{f}"] = value / bound
        if batch is None:
            out["roofline_tok_s_compute"] = self.compute_tok_s()
            out["roofline_frac_compute"] = value / out["roofline_tok_s_compute"]
        return out

    def describe(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "hbm_bytes_per_s": self.bw,
            "peak_flops": self.peak,
            "param_counts": self.counts,
            "decode_step_weight_bytes": {
                str(b): {f: self.step_bytes(b, f) for f in ("bf16", "fp8_fp4")} for b in (1, 16, 64, 256)
            },
            "assumptions": (
                "weight-read bound: every weight read once per forward step at hbm_bytes_per_s; KV-cache, "
                "activation and index reads not counted. 'bf16' = as DeepInfer loads the checkpoint today "
                "(matmul weights and embedding rows bf16, norms/mHC/sinks/biases fp32); 'fp8_fp4' = the "
                "checkpoint format (non-expert linears FP8 + fp32 scale per 128x128 tile, routed experts "
                "packed FP4 + fp32 scale per 32, compressor/indexer/router projections and lm_head bf16). "
                f"Routed experts: per layer E*(1-(1-k/E)^T) distinct experts for T tokens routed uniformly "
                f"(E={c.n_routed_experts}, k={c.num_experts_per_tok}; k at T=1, <= min(E, T*k)); hash "
                "layers route random prompt ids uniformly. Decode: T = batch. Prefill: T = tokens per step "
                "(chunks of max_num_batched_tokens for DeepInfer, the whole batch in one forward for HF). "
                "Compute bound (prefill): 2 FLOPs per active matmul weight per token at peak_flops, "
                "attention-score and indexer FLOPs excluded."
            ),
        }


# ---- prompts and timing ----------------------------------------------------------------------------
def make_prompts(tag: str, count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` random prompts of ``length`` ids, the same for the same (tag, seed)."""
    rng = random.Random(seed * 1_000_003 + zlib.crc32(tag.encode()))
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(count)]


class StepLog:
    """Timestamps every engine step (``time.monotonic``, the clock of ``RequestMetrics``) by
    wrapping the engine's ``metrics.update`` for the duration of a ``with`` block."""

    def __init__(self, llm: LLM):
        self.metrics = llm.engine.metrics
        self.steps: list[tuple[float, Any]] = []

    def __enter__(self) -> StepLog:
        original = self.metrics.update

        def update(stats: Any) -> None:
            original(stats)
            self.steps.append((time.monotonic(), stats))

        self.metrics.update = update
        return self

    def __exit__(self, *exc: object) -> None:
        del self.metrics.update  # the instance attribute: the class method shows again


def run_llm(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], list, float]:
    """Generate greedily (EOS ignored); returns (outputs, step log, wall seconds)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with StepLog(llm) as steps:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    for o in outs:
        if o.error:
            raise RuntimeError(f"request {o.request_id} failed: {o.error}")
        n = len(o.outputs[0].token_ids)
        if n != max_tokens:
            raise RuntimeError(f"request {o.request_id} produced {n} tokens, expected {max_tokens}")
    return outs, steps.steps, wall


def prefill_stats(outs: list[Any]) -> dict[str, float]:
    """Prompt tokens / (last first token - first arrival), and TTFTs, from request metrics."""
    ms = [o.metrics for o in outs]
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    start = min(m.arrival_time for m in ms)
    end = max(m.first_token_time for m in ms)
    ttfts = [m.first_token_time - m.arrival_time for m in ms]
    return {
        "prompt_tokens": tokens,
        "prefill_tok_s": tokens / (end - start),
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_max_s": max(ttfts),
    }


def decode_stats(outs: list[Any], steps: list[tuple[float, Any]], batch: int, new_tokens: int) -> dict:
    """Decode tok/s three ways (see the module docstring); ``decode_tok_s`` is the headline."""
    ms = [o.metrics for o in outs]
    all_first = max(m.first_token_time for m in ms)
    last = max(m.last_token_time for m in ms)
    out: dict[str, Any] = {
        "decode_tok_s_request_metrics": batch * (new_tokens - 1) / (last - all_first)
        if last > all_first
        else None
    }
    # exact: tokens sampled in the steps after the one that gave the last request its first token
    k = next(i for i, (t, _) in enumerate(steps) if t >= all_first)
    after = [(t, s) for t, s in steps[k + 1 :] if s.num_generated_tokens > 0]
    if after:
        tokens = sum(s.num_generated_tokens for _, s in after)
        out["decode_tok_s_after_all_first"] = tokens / (after[-1][0] - steps[k][0])
        out["tokens_after_all_first"] = tokens
    # steady batch: steps in which all `batch` requests decode one token each
    full = [
        (t - steps[i - 1][0], s.num_generated_tokens)
        for i, (t, s) in enumerate(steps)
        if i > 0 and s.num_seqs == batch and s.num_decode_seqs == batch and s.num_tokens == batch
    ]
    if full:
        secs = sum(d for d, _ in full)
        out["full_batch_steps"] = len(full)
        out["decode_tok_s_full_batch"] = sum(n for _, n in full) / secs
        out["decode_step_ms_full_batch"] = 1e3 * secs / len(full)
    if len(full) >= 3:
        out["decode_tok_s"], out["decode_method"] = out["decode_tok_s_full_batch"], "full-batch steps"
    elif "decode_tok_s_after_all_first" in out:
        out["decode_tok_s"], out["decode_method"] = out["decode_tok_s_after_all_first"], "after all first"
    else:
        out["decode_tok_s"], out["decode_method"] = out["decode_tok_s_request_metrics"], "request metrics"
    out["steps"] = len(steps)
    out["preemptions"] = sum(s.num_preempted for _, s in steps)
    return out


# ---- the benchmark ---------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace, model_dir: Path, cfg_dict: dict[str, Any], report: Report):
        self.args, self.model_dir, self.report = args, model_dir, report
        self.cfg_dict = cfg_dict
        self.cfg = DeepseekV4Config.from_dict(cfg_dict)
        self.vocab = self.cfg.vocab_size
        self.device = torch.device(args.device)
        self.roof = Roofline(self.cfg, args.hbm_bw, args.peak_flops)
        self.llm: LLM | None = None
        self.llm_key: tuple[int, int, int] | None = None
        lens = [args.prompt_len + args.new_tokens, args.prefill_long + 1]
        if args.pareto:
            lens.append(args.pareto_prompt_len + 1)
        self.max_model_len = max(lens)

    # -- plumbing
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prompts(self, tag: str, count: int, length: int) -> list[list[int]]:
        return make_prompts(tag, count, length, self.vocab, self.args.seed)

    def over_budget(self) -> bool:
        b = self.args.time_budget
        return bool(b) and time.perf_counter() - T_START > b

    def job(self, name: str, fn: Callable[[], None], on_error: Callable[[], None] | None = None) -> None:
        if self.over_budget():
            log(f"{name}: skipped (time budget {self.args.time_budget:.0f} s spent)")
            self.report.error(name, f"skipped: time budget of {self.args.time_budget:.0f} s spent", "skipped")
            return
        log(f"{name} ...")
        try:
            fn()
        except Exception as e:  # recorded, not raised: the other measurements still run
            log(f"{name} FAILED: {type(e).__name__}: {e}")
            if not isinstance(e, Unfit):
                traceback.print_exc()
            self.report.error(name, e)
            if on_error is not None:
                on_error()
            self.free_memory()

    def free_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def engine(self, max_num_seqs: int, chunk: int, max_len: int | None = None) -> LLM:
        """The DeepInfer engine of this shape, built after freeing any other one."""
        key = (max_num_seqs, chunk, max_len or self.max_model_len)
        if self.llm is not None and self.llm_key == key:
            return self.llm
        self.free_engine()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        a = self.args
        t0 = time.perf_counter()
        llm = LLM(
            model=str(self.model_dir),
            backend=a.backend,
            device=a.device,
            dtype=a.dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=chunk,
            max_model_len=key[2],
            enforce_eager=a.enforce_eager,
            keep_quantized=a.keep_quantized,
            kv_cache_dtype=a.kv_cache_dtype,
            seed=a.seed,
        )
        self.sync()
        info = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": chunk,
            "max_model_len": key[2],
            "backend": getattr(getattr(llm.engine, "backend", None), "name", None),
            "build_s": time.perf_counter() - t0,
            "kv_cache_capacity_tokens": llm.kv_cache_capacity_tokens,
            "keep_quantized": llm.config.keep_quantized,
            "kv_cache_dtype": llm.config.kv_cache_dtype,
            "weight_gib": llm.engine.runner.model.weight_bytes() / 2**30,
            "graph_buckets": sorted(getattr(llm.engine.runner, "graphs", {}) or []),
        }
        if self.device.type == "cuda":
            info["gpu_mem_allocated_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
        log(f"  engine {info}")
        self.report.data["engines"].append(info)
        self.report.save()
        self.llm, self.llm_key = llm, key
        return llm

    def free_engine(self) -> None:
        if self.llm is not None:
            if self.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(self.device) / 2**30
                self.report.data["engines"][-1]["gpu_peak_allocated_gib"] = peak
                self.report.save()
            self.llm = self.llm_key = None
        self.free_memory()

    # -- DeepInfer
    def ours(self) -> None:
        a = self.args
        chunk = a.max_num_batched_tokens
        jobs: list[tuple[tuple[int, int], str, Callable[[], None]]] = []
        for b in [] if a.skip_decode else a.batch_sizes:
            seqs = max(a.batch_sizes) if a.shared_engine else b
            jobs.append(
                ((seqs, chunk), f"ours.decode.B{b}", lambda b=b, s=seqs: self.our_decode(b, s, chunk))
            )
        if not a.skip_prefill:
            pb = a.prefill_batch
            jobs.append(((pb, chunk), "ours.prefill", lambda: self.our_prefill(pb, chunk)))
        if a.pareto:
            for c in a.pareto_chunks:
                seqs = max(a.pareto_batch_sizes)
                jobs.append(((seqs, c), f"ours.pareto.chunk{c}", lambda c=c, s=seqs: self.our_pareto(s, c)))
        for b, ctx in a.contexts:  # one engine per batch, long enough for its longest context
            longest = max(c for bb, c in a.contexts if bb == b)
            fn = lambda b=b, ctx=ctx: self.our_context(b, ctx, chunk)  # noqa: E731
            jobs.append(((b, chunk, longest), f"ours.context.B{b}.{ctx}", fn))
        order = list(dict.fromkeys(key for key, _, _ in jobs))  # jobs sharing an engine run together
        for key in order:
            for k, name, fn in jobs:
                if k == key:
                    self.job(name, fn, on_error=self.free_engine)
        self.free_engine()

    def warmup(self, llm: LLM, tag: str, count: int, length: int, max_tokens: int) -> None:
        if not self.args.no_warmup:
            run_llm(llm, self.prompts(f"warmup-{tag}", count, length), max_tokens)

    def our_decode(self, batch: int, seqs: int, chunk: int) -> None:
        a = self.args
        llm = self.engine(seqs, chunk)
        self.warmup(llm, f"decode{batch}", batch, min(a.prompt_len, 128), 4)
        prompts = self.prompts(f"decode-B{batch}", batch, a.prompt_len)
        outs, steps, wall = run_llm(llm, prompts, a.new_tokens)
        d = decode_stats(outs, steps, batch, a.new_tokens)
        p = prefill_stats(outs)
        name = f"ours.decode.B{batch}"
        tokens = [o.outputs[0].token_ids for o in outs]
        row = {
            "name": name,
            "value": d["decode_tok_s"],
            "unit": "tok/s",
            **self.roof.fractions(d["decode_tok_s"], batch=batch),
        }
        row.update(batch=batch, max_num_seqs=seqs, wall_s=wall, ttft_mean_s=p["ttft_mean_s"], **d)
        row["distinct_output_tokens"] = len({t for ts in tokens for t in ts})  # degenerate model -> 1
        if batch <= 16:  # kept for HF's greedy agreement (also across runs merged with --append)
            row["output_token_ids"] = tokens
        self.report.add(row)
        log(f"  {name}: {d['decode_tok_s']:.1f} tok/s ({d['decode_method']})")

    def our_context(self, batch: int, ctx: int, chunk: int) -> None:
        """Decode at a steady batch of ``batch`` sequences near ``ctx`` tokens (docs/benchmarks.md)."""
        a, cfg = self.args, self.cfg
        ctxs = [c for b, c in a.contexts if b == batch]
        longest, base_name = max(ctxs), f"ours.context.B{batch}.{min(ctxs)}"
        rows = gm.kv_row_bytes(cfg, a.kv_cache_dtype, DTYPES[a.dtype].itemsize)
        if longest > cfg.max_position_embeddings:
            raise Unfit(f"context {longest} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        if self.device.type == "cuda" and self.llm_key != (batch, chunk, longest):
            self.free_engine()
            need = batch * gm.kv_bytes(cfg, longest, rows, read=False)
            weights = self.roof.step_bytes(10**9, "fp8_fp4" if a.keep_quantized else "bf16")
            free = torch.cuda.mem_get_info(self.device)[0]
            if need + weights > 0.9 * free:
                raise Unfit(
                    f"B={batch} x {longest} tokens need {need / 2**30:.1f} GiB of KV cache beside "
                    f"{weights / 2**30:.1f} GiB of weights; the GPU has {free / 2**30:.1f} GiB free"
                )
        # every request keeps decoding until the last prompt is prefilled: the steps after it
        # are a steady batch of `batch` decodes of a.new_tokens tokens or more
        max_tokens = a.new_tokens + -(-batch * ctx // max(chunk - batch, 1)) + batch
        if ctx <= max_tokens:
            raise Unfit(f"context {ctx} is shorter than the {max_tokens} tokens B={batch} decodes")
        llm = self.engine(batch, chunk, longest)
        self.warmup(llm, f"context{batch}", batch, min(ctx, 128), 4)
        outs, steps, wall = run_llm(
            llm, self.prompts(f"ctx{ctx}-B{batch}", batch, ctx - max_tokens), max_tokens
        )
        d, p = decode_stats(outs, steps, batch, max_tokens), prefill_stats(outs)
        if "decode_tok_s_full_batch" not in d:
            raise RuntimeError(f"no step decoded all {batch} requests")
        kv = batch * gm.kv_bytes(cfg, ctx, rows)
        tok_s, step_ms = d["decode_tok_s_full_batch"], d["decode_step_ms_full_batch"]
        base = next((r for r in self.report.data["results"] if r["name"] == base_name), None)
        row = {"name": f"ours.context.B{batch}.{ctx}", "value": tok_s, "unit": "tok/s"}
        row.update(self.roof.fractions(tok_s, batch=batch, kv=kv), context_batch=batch, context=ctx)
        row.update(step_ms=step_ms, kv_read_bytes_per_step=kv, kv_row_bytes=rows, max_tokens=max_tokens)
        row.update(base_context=(base or row)["context"], step_ratio=step_ms / (base or row)["step_ms"])
        row.update(ttft_s=p["ttft_max_s"], prefill_tok_s=p["prefill_tok_s"], wall_s=wall, **d)
        self.report.add(row)
        log(f"  {row['name']}: {step_ms:.2f} ms/step, {tok_s:.1f} tok/s, x{row['step_ratio']:.2f}")

    def _prefill_row(self, name: str, outs: list[Any], chunk: int | None, extra: dict) -> dict:
        p = prefill_stats(outs)
        steps = gm.step_token_counts(p["prompt_tokens"], chunk or p["prompt_tokens"])
        row = {"name": name, "value": p["prefill_tok_s"], "unit": "tok/s"}
        row.update(self.roof.fractions(p["prefill_tok_s"], steps=steps), **p, **extra)
        self.report.add(row)
        log(f"  {name}: {p['prefill_tok_s']:.1f} tok/s, TTFT mean {p['ttft_mean_s'] * 1e3:.1f} ms")
        return row

    def our_prefill(self, batch: int, chunk: int) -> None:
        a = self.args
        llm = self.engine(batch, chunk)
        for count, length in ((batch, a.prompt_len), (1, a.prefill_long)):
            name = f"ours.prefill.{count}x{length}"
            self.warmup(llm, name, count, length, 1)
            outs, _, wall = run_llm(llm, self.prompts(name, count, length), 1)
            self._prefill_row(name, outs, chunk, {"max_num_batched_tokens": chunk, "wall_s": wall})

    def our_pareto(self, seqs: int, chunk: int) -> None:
        a = self.args
        llm = self.engine(seqs, chunk)
        self.warmup(llm, f"pareto{chunk}", max(a.pareto_batch_sizes), a.pareto_prompt_len, 1)
        points = []
        for b in a.pareto_batch_sizes:
            name = f"ours.pareto.chunk{chunk}.B{b}"
            outs, _, _ = run_llm(llm, self.prompts(name, b, a.pareto_prompt_len), 1)
            row = self._prefill_row(name, outs, chunk, {"batch": b, "max_num_batched_tokens": chunk})
            points.append(
                {
                    "batch": b,
                    "ttft_mean_s": row["ttft_mean_s"],
                    "ttft_max_s": row["ttft_max_s"],
                    "prefill_tok_s": row["value"],
                }
            )
        self.report.data["pareto"][f"DeepInfer chunk {chunk}"] = points
        self.report.save()

    # -- HF transformers
    def hf(self) -> None:
        a = self.args
        holder: dict[str, Any] = {}

        def load() -> None:
            t0 = time.perf_counter()
            holder["model"] = build_hf_model(self.model_dir, self.cfg_dict, DTYPES[a.dtype], self.device)
            self.sync()
            info = {"engine": "hf", "build_s": time.perf_counter() - t0}
            info["experts_implementation"] = getattr(holder["model"].config, "_experts_implementation", None)
            info["attn_implementation"] = getattr(holder["model"].config, "_attn_implementation", None)
            self.report.data["engines"].append(info)
            self.report.save()
            log(f"  hf model {info}")

        self.job("hf.load", load)
        if "model" not in holder:
            return
        model = holder.pop("model")
        self.job(
            "hf.warmup",
            lambda: (
                None
                if a.no_warmup
                else self.hf_generate(model, self.prompts("warmup-hf", 1, min(a.prompt_len, 128)), 4)
            ),
        )
        for b in [] if a.skip_decode else a.hf_batch_sizes:
            self.job(f"hf.decode.B{b}", lambda b=b: self.hf_decode(model, b))
        if not a.skip_prefill:
            for count, length in ((a.prefill_batch, a.prompt_len), (1, a.prefill_long)):
                name = f"hf.prefill.{count}x{length}"
                self.job(name, lambda n=name, c=count, L=length: self.hf_prefill(model, n, c, L))
        if a.pareto:
            points: list[dict[str, Any]] = []
            for b in a.pareto_batch_sizes:
                name = f"hf.pareto.B{b}"
                self.job(
                    name,
                    lambda n=name, b=b: points.append(
                        self.hf_prefill(model, n, b, a.pareto_prompt_len, batch=b)
                    ),
                )
            self.report.data["pareto"]["HF transformers (eager)"] = points
            self.report.save()
        model = None
        self.free_memory()

    def hf_generate(self, model: Any, prompts: list[list[int]], new_tokens: int) -> tuple:
        """HF greedy generate; returns (new token ids, start time, per-token logits times, end)."""
        from transformers import LogitsProcessor, LogitsProcessorList

        sync = self.sync

        class Clock(LogitsProcessor):
            """Timestamps every generation step (called once per new token, after its forward)."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                sync()
                self.times.append(time.perf_counter())
                return scores

        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        clock = Clock()
        self.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
                pad_token_id=0,
            )
        self.sync()
        t1 = time.perf_counter()
        new = out[:, ids.shape[1] :].tolist()
        if any(len(t) != new_tokens for t in new):
            raise RuntimeError(f"HF generated {[len(t) for t in new]} tokens, expected {new_tokens}")
        return new, t0, clock.times, t1

    def hf_decode(self, model: Any, batch: int) -> None:
        a = self.args
        prompts = self.prompts(f"decode-B{batch}", batch, a.prompt_len)  # the prompts DeepInfer ran
        new, t0, times, t1 = self.hf_generate(model, prompts, a.new_tokens)
        tok_s = batch * (a.new_tokens - 1) / (times[-1] - times[0])
        name = f"hf.decode.B{batch}"
        row = {"name": name, "value": tok_s, "unit": "tok/s", **self.roof.fractions(tok_s, batch=batch)}
        row.update(
            batch=batch,
            wall_s=t1 - t0,
            ttft_s=times[0] - t0,
            decode_step_ms=1e3 * (times[-1] - times[0]) / max(len(times) - 1, 1),
        )
        ours = next(
            (
                r.get("output_token_ids")
                for r in self.report.data["results"]
                if r["name"] == f"ours.decode.B{batch}"
            ),
            None,
        )
        row["distinct_output_tokens"] = len({t for ts in new for t in ts})
        if ours is not None and len(ours) == batch and all(len(o) == a.new_tokens for o in ours):
            same = sum(x == y for o, h in zip(ours, new, strict=True) for x, y in zip(o, h, strict=True))
            row["greedy_tokens_equal_to_ours"] = f"{same}/{batch * a.new_tokens}"
            first_diff = [
                next((i for i, (x, y) in enumerate(zip(o, h, strict=True)) if x != y), None)
                for o, h in zip(ours, new, strict=True)
            ]
            row["first_divergence_per_request"] = first_diff[:16]
        self.report.add(row)
        log(f"  {name}: {tok_s:.1f} tok/s")

    def hf_prefill(self, model: Any, name: str, count: int, length: int, batch: int | None = None) -> dict:
        _, t0, times, t1 = self.hf_generate(model, self.prompts(name, count, length), 1)
        tokens = count * length
        tok_s = tokens / (times[0] - t0)
        row = {"name": name, "value": tok_s, "unit": "tok/s"}
        row.update(self.roof.fractions(tok_s, steps=[tokens]), prompt_tokens=tokens, ttft_s=times[0] - t0)
        row.update(ttft_mean_s=times[0] - t0, ttft_max_s=times[0] - t0, wall_s=t1 - t0)
        if batch is not None:
            row["batch"] = batch
        self.report.add(row)
        log(f"  {name}: {tok_s:.1f} tok/s, TTFT {1e3 * (times[0] - t0):.1f} ms")
        return {
            "batch": batch,
            "ttft_mean_s": times[0] - t0,
            "ttft_max_s": times[0] - t0,
            "prefill_tok_s": tok_s,
        }


def build_hf_model(model_dir: Path, cfg_dict: dict, dtype: torch.dtype, device: torch.device) -> Any:
    """HF ``DeepseekV4ForCausalLM`` (eager attention) built on ``device`` and loaded with the
    checkpoint as DeepInfer's loader dequantises it (HF names; FP8/FP4 -> ``dtype``)."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM

    hf_cfg = HFConfig(**{k: v for k, v in cfg_dict.items() if k != "quantization_config"})
    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(hf_cfg, dtype=dtype, attn_implementation="eager")
    placed = {p.device for p in model.parameters()}
    if placed != {device} and not (device.type == "cuda" and {d.type for d in placed} == {"cuda"}):
        model = model.to(device)
    state = load_checkpoint(model_dir, DeepseekV4Config.from_file(model_dir), dtype, device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    del state
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    model.generation_config.eos_token_id = None  # ignore EOS: every request runs to max_new_tokens
    return model


# ---- output ----------------------------------------------------------------------------------------
def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'name':34s} {'value':>12s} {'unit':6s} {'roof bf16':>10s} {'roof fp8/4':>10s} {'roof FLOP':>10s}"
    )

    def frac(r: dict, key: str) -> str:
        v = r.get(key)
        return f"{v:10.1%}" if isinstance(v, float) else f"{'-':>10s}"

    for r in rows:
        if r.get("value") is None:
            why = r.get("error") or r.get("skipped") or "no value"
            print(f"{r['name']:34s} {'-':>12s} {'':6s} {why[:80]}")
            continue
        print(
            f"{r['name']:34s} {r['value']:12.1f} {r['unit']:6s} {frac(r, 'roofline_frac_bf16')} "
            f"{frac(r, 'roofline_frac_fp8_fp4')} {frac(r, 'roofline_frac_compute')}"
        )


CONTEXT_COLUMNS = [
    ("context", "name", "s"),
    ("step ms", "step_ms", ".2f"),
    ("tok/s", "value", ".1f"),
    ("KV MB/step", "kv_mb", ".2f"),
    ("roof bf16", "roofline_frac_bf16", ".1%"),
    ("roof fp8/4", "roofline_frac_fp8_fp4", ".1%"),
    ("x base", "step_ratio", ".2f"),
    ("TTFT s", "ttft_s", ".2f"),
    ("prefill tok/s", "prefill_tok_s", ".0f"),
]


def print_context_table(rows: list[dict[str, Any]]) -> None:
    """The --contexts rows: step time, KV bytes, roofline (weights + KV) and step / base context."""
    ctx = [r | {"kv_mb": r["kv_read_bytes_per_step"] / 1e6} for r in rows if r.get("step_ms") is not None]
    if ctx:
        print()
        harness_table(ctx, CONTEXT_COLUMNS)


def plot_pareto(pareto: dict[str, list[dict[str, Any]]], png: Path, title: str) -> str | None:
    """Draw prefill tok/s vs mean TTFT, one line per series; returns the path or None (with a note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not importable; the Pareto chart is skipped (its points are in the JSON)")
        return None
    series = {k: [p for p in v if p.get("prefill_tok_s")] for k, v in pareto.items()}
    if not any(series.values()):
        print("note: no Pareto points to draw")
        return None
    fig, ax = plt.subplots(figsize=(7, 5))
    for label, pts in series.items():
        if not pts:
            continue
        x = [p["ttft_mean_s"] * 1e3 for p in pts]
        y = [p["prefill_tok_s"] for p in pts]
        ax.plot(x, y, marker="o", label=label)
        for xi, yi, p in zip(x, y, pts, strict=True):
            ax.annotate(f"B{p['batch']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("time to first token, mean over the batch (ms)")
    ax.set_ylabel("prefill tokens/s per GPU")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)
    plt.close(fig)
    print(f"wrote {png}")
    return str(png)


# ---- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, tiny widths, a few tokens: checks the code path"
    )
    ap.add_argument("--backend", default="auto", help="DeepInfer backend (default auto)")
    ap.add_argument("--device", help="torch device (default cuda when available, else cpu; --smoke: cpu)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default bfloat16 (--smoke: float32)")
    ap.add_argument("--enforce-eager", action="store_true", help="LLM(enforce_eager=True): no device graphs")
    add_keep_quantized(
        ap, "LLM(keep_quantized=None|True|False): FP8/FP4 weights kept quantised for the kernels"
    )
    ap.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="LLM(kv_cache_dtype=...)"
    )
    ap.add_argument("--layers", type=int, default=4, help="decoder layers [sliding, CSA, HCA, CSA, ...]")
    ap.add_argument("--experts", type=int, help="routed experts (default 64; --smoke 8)")
    ap.add_argument("--batch-sizes", type=positive_ints, help="decode batch sizes (default 1,16,64,256)")
    ap.add_argument("--prompt-len", type=int, help="prompt ids per decode / prefill request (default 512)")
    ap.add_argument("--new-tokens", type=int, help="tokens generated per decode request (default 32)")
    ap.add_argument("--max-num-batched-tokens", type=int, help="DeepInfer step token budget (default 8192)")
    ap.add_argument(
        "--shared-engine",
        action="store_true",
        help="one DeepInfer engine (max_num_seqs = largest batch) for every decode batch size",
    )
    ap.add_argument("--prefill-batch", type=int, help="prompts of the batched prefill (default 16)")
    ap.add_argument("--prefill-long", type=int, help="length of the single-prompt prefill (default 8192)")
    ap.add_argument(
        "--contexts",
        nargs="?",
        const="",
        type=str,
        help="decode at a steady batch at these contexts: CTX (at --context-batch) or B@CTX items; "
        f"alone: {CONTEXTS[0]} (--smoke: {CONTEXTS[1]})",
    )
    ap.add_argument("--context-batch", type=int, help="batch of the --contexts items without B@ (default 16)")
    ap.add_argument("--skip-ours", action="store_true", help="leave out DeepInfer")
    ap.add_argument("--skip-hf", action="store_true", help="leave out HF transformers")
    ap.add_argument("--skip-decode", action="store_true", help="leave out the decode rows")
    ap.add_argument("--skip-prefill", action="store_true", help="leave out the prefill rows")
    ap.add_argument("--hf-batch-sizes", type=positive_ints, help="HF decode batch sizes (default 1,16)")
    ap.add_argument("--pareto", action="store_true", help="prefill tok/s vs TTFT sweep and chart")
    ap.add_argument("--pareto-batch-sizes", type=positive_ints, help="default 1,2,4,8,16")
    ap.add_argument(
        "--pareto-chunks", type=positive_ints, help="max_num_batched_tokens values (default 2048,8192)"
    )
    ap.add_argument("--pareto-prompt-len", type=int, help="prompt length of the sweep (default 2048)")
    ap.add_argument("--pareto-png", type=Path, help=f"chart path (default {DEFAULT_PNG.relative_to(ROOT)})")
    ap.add_argument(
        "--plot-only", type=Path, metavar="JSON", help="draw the chart from a results JSON; run nothing"
    )
    ap.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument(
        "--append", action="store_true", help="merge into an existing --out (rows replaced by name)"
    )
    ap.add_argument(
        "--model-dir",
        type=Path,
        help="checkpoint folder: reused when it holds this config's checkpoint, else written "
        "there and kept (default: a temporary folder, deleted at the end)",
    )
    ap.add_argument("--gen-device", help="device that draws and quantises the weights (default --device)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-warmup", action="store_true", help="skip the warm-up generate before each measurement"
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds from the start; measurements that would start later are recorded as skipped (0 = none)",
    )
    ap.add_argument("--hbm-bw", type=float, default=H200_HBM_BW, help="bytes/s of the weight-read roofline")
    ap.add_argument(
        "--peak-flops", type=float, default=H200_BF16_FLOPS, help="FLOP/s of the compute roofline"
    )
    args = ap.parse_args(argv)
    mode = 1 if args.smoke else 0
    for key, values in MODE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, values[mode])
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.gen_device = args.gen_device or args.device
    args.keep_quantized = KEEP_QUANTIZED[args.keep_quantized]
    if args.out is None:
        args.out = DEFAULT_OUT.with_name("gpu_e2e_smoke.json") if args.smoke else DEFAULT_OUT
    if args.pareto_png is None:
        args.pareto_png = (
            Path(tempfile.gettempdir()) / "prefill_pareto_smoke.png" if args.smoke else DEFAULT_PNG
        )
    items = (args.contexts or CONTEXTS[mode]).split(",") if args.contexts is not None else []
    try:
        args.contexts = [
            (int(b or args.context_batch), int(c)) for b, _, c in (x.rpartition("@") for x in items)
        ]
    except ValueError:
        args.contexts = [(0, 0)]
    if any(min(p) < 1 for p in args.contexts):
        ap.error(f"--contexts takes positive CTX or B@CTX items separated by commas, got {','.join(items)!r}")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode needs a token after the first)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only is not None:
        data = json.loads(args.plot_only.read_text())
        plot_pareto(data.get("pareto", {}), args.pareto_png, _title(data))
        return 0
    device = torch.device(args.device)
    if args.smoke:  # tiny matmuls: one thread avoids OpenMP stalls on a small, shared CPU
        torch.set_num_threads(1)
    cfg_dict = gm.flash_config(args.layers, args.experts, smoke=args.smoke)
    cfg = DeepseekV4Config.from_dict(cfg_dict)
    roof = Roofline(cfg, args.hbm_bw, args.peak_flops)
    header = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [sys.executable, *sys.argv] if argv is None else ["gpu_e2e.py", *argv],
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_info(device),
        "model": {"config": cfg_dict, "param_counts": roof.counts},
        "roofline": roof.describe(),
    }
    report = Report(args.out, header, args.append)
    c = roof.counts
    log(
        f"model: {args.layers} layers, {args.experts} experts, {c['total'] / 1e9:.2f} B params "
        f"({c['routed_experts'] / 1e9:.2f} B routed experts, "
        f"{c['active_per_token'] / 1e9:.3f} B active per token)"
    )

    temp_dir = None
    if args.model_dir is None:
        temp_dir = Path(tempfile.mkdtemp(prefix="gpu_e2e_model_"))
        model_dir = temp_dir
    else:
        model_dir = args.model_dir
    rc = 0
    try:
        if gm.model_ready(model_dir, cfg_dict, args.seed):
            log(f"reusing the checkpoint in {model_dir}")
            info = json.loads((model_dir / gm.MARKER).read_text())
            info.pop("config", None)
            report.data["checkpoint"] = info | {"reused": True}
        else:
            if model_dir.is_dir() and any(model_dir.iterdir()) and not (model_dir / "config.json").is_file():
                raise SystemExit(f"--model-dir {model_dir} holds other files; give an empty or new folder")
            log(f"writing the checkpoint to {model_dir} (weights drawn on {args.gen_device})")
            info = gm.write_checkpoint(
                model_dir,
                cfg_dict,
                args.seed,
                torch.device(args.gen_device),
                DTYPES[args.dtype],
                log=log,
            )
            info.pop("config")
            report.data["checkpoint"] = info | {"reused": False}
            log(f"checkpoint: {info['bytes_on_disk'] / 2**30:.2f} GiB in {info['write_s']:.1f} s")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report.save()
        bench = Bench(args, model_dir, cfg_dict, report)
        if not args.skip_ours:
            bench.ours()
        if not args.skip_hf:
            bench.hf()
        if args.pareto and report.data["pareto"]:
            report.data["pareto_png"] = plot_pareto(
                report.data["pareto"], args.pareto_png, _title(report.data)
            )
        report.data["total_s"] = time.perf_counter() - T_START
        report.save()
        print_table(report.data["results"])
        print_context_table(report.data["results"])
        print(f"\nwrote {args.out}")
        ours_failed = [
            r["name"] for r in report.data["results"] if r["name"].startswith("ours") and "error" in r
        ]
        if ours_failed:
            log(f"DeepInfer measurements failed: {ours_failed}")
            rc = 1
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
    return rc


def _title(data: dict[str, Any]) -> str:
    """The chart's title from a results dict (params of the latest run, machine, backend)."""
    p = (data.get("runs") or [{}])[-1].get("params", {})
    machine = data.get("machine", {})
    backends = sorted({e["backend"] for e in data.get("engines", []) if e.get("backend")})
    width = "smoke widths" if p.get("smoke") else "V4-Flash width"
    return (
        f"Prefill Pareto, {p.get('layers')}-layer {width}, {p.get('experts')} experts, "
        f"prompts of {p.get('pareto_prompt_len')} tokens\n{machine.get('gpu') or machine.get('device')}, "
        f"backend {'/'.join(backends) or p.get('backend')}, {p.get('dtype')}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
