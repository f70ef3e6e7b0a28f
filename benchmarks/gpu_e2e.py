"""End-to-end GPU benchmark: DeepInfer vs HF transformers on a 4-layer DeepSeek-V4-Flash-width model.

What it measures, how, and the commands of full and partial runs: docs/benchmarks.md (gpu_e2e.py);
``--smoke`` runs every part on the CPU at tiny widths, in seconds."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
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

from deepinfer_core import LLM  # noqa: E402
from deepinfer_core.benchmarking import harness as h  # noqa: E402
from deepinfer_core.benchmarking.harness import log, positive_ints  # noqa: E402
from deepinfer_core.distributed.gpu_specs import device_hbm_bandwidth  # noqa: E402
from deepinfer_core.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from deepinfer_core.models.deepseek_v4.loader import load_checkpoint  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gpu_e2e.json"
LAYERS, SEED, FMTS = 4, 0, ("bf16", "fp8_fp4")  # SEED: prompts and weights
BATCHES = (1, 16, 64, 256)  # the decode steps whose weight bytes the report gives
BF16_FLOPS = 989e12  # an H100's / H200's dense bf16 FLOP/s: the prefill rooflines'
BUILD_S = 75.0  # --time-budget a job that builds an engine needs beyond its start
HF_IMPL = ("attn_implementation", "experts_implementation")  # HF's choices, kept with its figures
# (full run, --smoke) values; flags left unset take their mode's; prefill rows: (prompts, length)
MODE: dict[str, tuple[Any, Any]] = dict(device=("cuda" if torch.cuda.is_available() else "cpu", "cpu"))
MODE |= dict(dtype=("bfloat16", "float32"), experts=(64, 8), batch_sizes=([1, 16, 64, 256], [1, 4]))
MODE |= dict(prompt_len=(512, 32), new_tokens=(32, 4), chunk=(8192, 64), hf_batch_sizes=([1, 16], [1, 4]))
MODE |= dict(prefill=([(16, 512), (1, 8192)], [(4, 32), (1, 256)]), pareto_prompt_len=(2048, 48))
MODE |= dict(pareto_batch_sizes=([1, 2, 4, 8, 16], [1, 2]), pareto_chunks=([2048, 8192], [64, 128]))
MODE |= dict(context_batch=(16, 2), out=(OUT, OUT.with_name("gpu_e2e_smoke.json")))
CONTEXTS = ("4096,32768,131072,1@4096,1@1048576", "64,256,1@64,1@1024")  # --contexts alone
T_START = time.perf_counter()  # --time-budget counts from here


class Unfit(Exception):
    """A measurement that cannot run on this machine (recorded as one line, no traceback)."""


# ---- generation and its statistics, the shared runner (also used by gpu_distributed.py) -------------
def run_llm(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], list, float]:
    """Generate greedily (EOS ignored); returns (outputs, [(time.monotonic(), StepStats)] of every
    engine step, wall seconds)."""
    metrics, steps = llm.engine.metrics, []
    original = metrics.update
    metrics.update = lambda stats: (original(stats), steps.append((time.monotonic(), stats)))
    try:
        outs, wall = h.generate(llm, prompts, h.greedy(max_tokens))
    finally:
        del metrics.update  # the instance attribute: the class method shows again
    for o in outs:
        n = len(o.outputs[0].token_ids) if not o.error else -1
        if n != max_tokens:
            raise RuntimeError(f"request {o.request_id}: {o.error or f'{n} tokens, expected {max_tokens}'}")
    return outs, steps, wall


def prefill_stats(outs: list[Any]) -> dict[str, float]:
    """Prompt tokens / (last first token - first arrival), and TTFTs, from request metrics."""
    ms, tokens = [o.metrics for o in outs], sum(len(o.prompt_token_ids) for o in outs)
    ttfts = [m.first_token_time - m.arrival_time for m in ms]
    secs = max(m.first_token_time for m in ms) - min(m.arrival_time for m in ms)
    tok_s, mean = tokens / secs, sum(ttfts) / len(ttfts)
    return {"prompt_tokens": tokens, "prefill_tok_s": tok_s, "ttft_mean_s": mean, "ttft_max_s": max(ttfts)}


def decode_stats(outs: list[Any], steps: list[tuple[float, Any]], batch: int, new_tokens: int) -> dict:
    """Decode tok/s over the steps in which all ``batch`` requests decode (``decode_tok_s`` when
    there are 3 or more), else over the steps after the last first token (else ``None``); with
    the full-batch steps' mean and median durations (the median leaves out the odd slow step,
    e.g. the first one after the prefill) and their median wait for the sampled tokens (near 0:
    the host, not the device, sets the pace)."""
    all_first = max(o.metrics.first_token_time for o in outs)
    out: dict[str, Any] = {"decode_tok_s": None, "decode_method": None, "steps": len(steps)}
    out["preemptions"] = sum(s.num_preempted for _, s in steps)
    k = next(i for i, (t, _) in enumerate(steps) if t >= all_first)
    after = [(t, s.num_generated_tokens) for t, s in steps[k + 1 :] if s.num_generated_tokens > 0]
    if after:
        out["tokens_after_all_first"] = tokens = sum(n for _, n in after)
        out["decode_tok_s"] = out["decode_tok_s_after_all_first"] = tokens / (after[-1][0] - steps[k][0])
        out["decode_method"] = "after all first"
    whole = [(t - steps[i - 1][0], s) for i, (t, s) in enumerate(steps) if i]  # (seconds, StepStats)
    full = [(d, s) for d, s in whole if s.num_seqs == s.num_decode_seqs == s.num_tokens == batch]
    if full:
        secs = sum(d for d, _ in full)
        out["full_batch_steps"], out["decode_step_ms_full_batch"] = len(full), 1e3 * secs / len(full)
        out["decode_step_ms_median"] = 1e3 * statistics.median(d for d, _ in full)  # one slow step left out
        out["host_wait_ms_median"] = 1e3 * statistics.median(s.host_wait_s for _, s in full)
        out["decode_tok_s_full_batch"] = sum(s.num_generated_tokens for _, s in full) / secs
    if len(full) >= 3:
        out["decode_tok_s"], out["decode_method"] = out["decode_tok_s_full_batch"], "full-batch steps"
    return out


class Runner:
    """What the GPU benchmarks share: the report (``data``: rows of results, written to ``--out``
    after every change; ``--append`` merges into the file's, rows replaced by name), seeded
    prompts, one engine alive at a time, and jobs whose failure or skip is recorded as their row
    (not raised: the other measurements still run).  The run's entry of ``runs``: its flags,
    its machine (date and command line included) and ``header``."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, vocab: int, **header: Any):
        self.args, self.model_dir, self.vocab = args, model_dir, vocab
        self.data: dict[str, Any] = {"runs": [], "results": [], "pareto": {}, "engines": []}
        if args.append and args.out.is_file():
            self.data.update(json.loads(args.out.read_text()))
        header = {"params": dict(vars(args)), "machine": h.machine_info(args.device), **header}
        self.data["runs"].append(header)
        self.data.update({k: v for k, v in header.items() if k in ("machine", "model")})
        self.device, self.dtype = torch.device(args.device), getattr(torch, args.dtype)
        self.cuda = self.device.type == "cuda"
        self.llm: LLM | None = None
        self.name: str | None = None  # the live engine's
        self.failed: dict[str, str] = {}  # engines that failed to build: why

    def prompts(self, tag: str, count: int, length: int) -> list[list[int]]:
        """``count`` random prompts of ``length`` ids in ``[4, vocab)``, the same for the same ``tag``."""
        return h.random_prompts(count, length, SEED * 1_000_003 + zlib.crc32(tag.encode()), self.vocab)

    def checkpoint(self, cfg: dict[str, Any]) -> None:
        """The random checkpoint of ``cfg`` written to ``model_dir`` (or reused), its figures reported."""
        self.data["checkpoint"] = gm.write_checkpoint(self.model_dir, cfg, SEED, self.device, self.dtype, log)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def save(self) -> None:
        h.write_json(self.args.out, self.data, quiet=True)

    def add(self, row: dict[str, Any], note: str = "") -> None:
        """Add (or replace) the row of ``row["name"]``, then save; ``note``: logged with the name."""
        self.data["results"] = [*(r for r in self.data["results"] if r["name"] != row["name"]), row]
        self.save()
        if note:
            log(f"  {row['name']}: {note}")

    def error(self, name: str, err: BaseException | str, kind: str = "error") -> None:
        text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        self.add({"name": name, "value": None, "unit": None, kind: text[:2000]})

    def result(self, name: str) -> dict[str, Any]:
        """The row ``name`` (``{}`` when there is none)."""
        return next((r for r in self.data["results"] if r["name"] == name), {})

    def job(self, name: str, fn: Callable, *fn_args: Any, engine: tuple[str, dict] | None = None) -> None:
        """``fn(*fn_args)``, or ``fn(llm, *fn_args)`` on the ``engine`` (name, options); a failure is
        the row ``name``, as is a skip: an engine that failed to build, or a start past
        ``--time-budget`` (with :data:`BUILD_S` for an engine to build)."""
        (eng, options), budget = engine or ("", {}), self.args.time_budget
        elapsed = time.perf_counter() - T_START
        need = BUILD_S if eng and eng != self.name else 0.0
        why = f"engine {eng} failed to build ({self.failed[eng][:300]})" if eng in self.failed else ""
        if not why and budget and elapsed + need > budget:
            why = f"time budget of {budget:.0f} s (elapsed {elapsed:.0f} s, {need:.0f} s for a build)"
        if why:
            log(f"{name}: skipped: {why}")
            return self.error(name, f"skipped: {why}", "skipped")
        log(f"{name} ...")
        try:
            fn(self.engine(eng, **options), *fn_args) if eng else fn(*fn_args)
        except Exception as e:
            log(f"{name} FAILED: {type(e).__name__}: {e}")
            if not isinstance(e, Unfit):
                traceback.print_exc()
            self.error(name, e)
            self.free()  # a distributed run that failed is ended: built afresh next time

    def engine(self, name: str, **options: Any) -> LLM:
        """The engine ``name``: ``LLM`` with the run's model, backend, device, dtype and weights and
        ``options``, built after freeing any other one; its figures (``engine_info``) join the
        report's ``engines``."""
        if self.llm is not None and self.name == name:
            return self.llm
        self.free()
        a, t0 = self.args, time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        log(f"  building engine {name}: {options}")
        try:
            kw = dict(backend=a.backend, device=a.device, dtype=a.dtype, keep_quantized=a.keep_quantized)
            self.llm, self.name = LLM(str(self.model_dir), seed=SEED, **kw, **options), name
            self.sync()
            info = self.engine_info(self.llm, name, options) | {"build_s": time.perf_counter() - t0}
        except Exception as e:
            self.failed[name] = f"{type(e).__name__}: {e}"
            raise RuntimeError(f"engine {name} failed to build: {self.failed[name]}") from e
        if self.cuda:
            info["rank0_gpu_mem_allocated_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
        log(f"  engine {info}")
        self.data["engines"].append(info)
        self.save()
        return self.llm

    def free(self) -> None:
        """Shut the live engine down (a distributed one's worker ranks exit) and free memory."""
        if self.llm is not None:
            if self.cuda and self.data["engines"]:
                peak = torch.cuda.max_memory_allocated(self.device) / 2**30
                self.data["engines"][-1]["rank0_gpu_peak_allocated_gib"] = peak
                self.save()
            try:
                self.llm.shutdown()
            except Exception as e:
                log(f"  shutdown of {self.name}: {type(e).__name__}: {e}")
        self.llm = self.name = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


# ---- the benchmark ---------------------------------------------------------------------------------


def hbm_bandwidth(device: str) -> tuple[float, str]:
    """HBM bytes/s of the decode rooflines and the GPU kind they are for: the distributed cost
    model's preset of the GPU that runs (H200: 4.24 TB/s, measured on one; H100 and H800, the same
    HBM3: 3.0 TB/s, FlashMLA's achieved on the H800), the H200's for another device (said so)."""
    name = torch.cuda.get_device_name() if device == "cuda" else device
    bandwidth, kind, known = device_hbm_bandwidth(name)
    if not known:
        log(f"roofline: no preset for {name!r}; the H200's HBM bandwidth is used")
    return bandwidth, kind


class Bench(Runner):
    """The measurements (docs/benchmarks.md) of the model of ``cfg_dict``, its parameter counts
    and decode-step weight bytes in the report."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, cfg_dict: dict[str, Any]):
        super().__init__(args, model_dir, cfg_dict["vocab_size"])
        self.cfg_dict, self.cfg = cfg_dict, DeepseekV4Config.from_dict(cfg_dict)
        self.counts = gm.param_counts(self.cfg)
        lens = [args.prompt_len + args.new_tokens, *(n + 1 for _, n in args.prefill)]
        self.max_model_len = max(lens + [args.pareto_prompt_len + 1] * args.pareto)
        self.data["model"] = {"config": cfg_dict, "param_counts": self.counts}
        steps = {str(b): {f: gm.weight_bytes_per_step(self.cfg, b, f) for f in FMTS} for b in BATCHES}
        self.hbm_bw, gpu = hbm_bandwidth(args.device)
        roofline = {"gpu": gpu, "hbm_bytes_per_s": self.hbm_bw, "peak_flops": BF16_FLOPS}
        self.data["roofline"] = roofline | {"decode_step_weight_bytes": steps}

    def row(self, name: str, tok_s: float, tokens: int = 0, steps: list | None = None, kv: float = 0, **kw):
        """A result row: ``tok_s`` over the GPU's read bound of a decode step of ``tokens`` tokens
        (weights, plus ``kv`` KV-cache bytes) or of a prefill in ``steps`` (tokens per step; also
        the bound of 2 FLOPs per active matmul weight per token)."""
        row = {"name": name, "value": tok_s, "unit": "tok/s"}
        for f in FMTS:
            step_bytes = sum(gm.weight_bytes_per_step(self.cfg, t, f) + kv for t in steps or [tokens])
            bound = sum(steps or [tokens]) * self.hbm_bw / step_bytes
            row |= {f"roofline_tok_s_{f}": bound, f"roofline_frac_{f}": tok_s / bound}
        if steps:
            bound = BF16_FLOPS / (2 * self.counts["active_per_token"])
            row |= {"roofline_tok_s_compute": bound, "roofline_frac_compute": tok_s / bound}
        return row | kw

    def ours_engine(self, seqs: int, chunk: int, max_len: int = 0) -> LLM:
        """The DeepInfer engine of this shape (``max_len`` 0: long enough for every row but the contexts)."""
        a, max_len = self.args, max_len or self.max_model_len
        opts = dict(max_num_seqs=seqs, max_num_batched_tokens=chunk, max_model_len=max_len)
        opts |= dict(kv_cache_dtype=a.kv_cache_dtype, enforce_eager=a.enforce_eager)
        return self.engine(f"S{seqs}.chunk{chunk}.len{max_len}", **opts)

    def engine_info(self, llm: LLM, name: str, options: dict[str, Any]) -> dict[str, Any]:
        info = {k: options[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")}
        info |= {"backend": llm.engine.backend.name, "kv_cache_tokens": llm.kv_cache_capacity_tokens}
        return info | {"weight_gib": llm.engine.runner.model.weight_bytes() / 2**30}

    # -- DeepInfer
    def ours(self) -> None:
        a, chunk, jobs = self.args, self.args.chunk, []
        for b in [] if a.skip_decode else a.batch_sizes:
            s = max(a.batch_sizes) if a.shared_engine else b
            jobs.append(((s, chunk), f"ours.decode.B{b}", lambda b=b, s=s: self.our_decode(b, s)))
        if not a.skip_prefill:
            fn = lambda: self.our_prefill(chunk, a.prefill)  # noqa: E731
            jobs.append(((a.prefill[0][0], chunk), "ours.prefill", fn))
        for c in a.pareto_chunks if a.pareto else []:
            pts = [(b, a.pareto_prompt_len) for b in a.pareto_batch_sizes]
            fn = lambda c=c, p=pts: self.our_prefill(c, p, pareto=True)  # noqa: E731
            jobs.append(((max(a.pareto_batch_sizes), c), f"ours.pareto.chunk{c}", fn))
        for b, ctx in a.contexts:  # one engine per batch, long enough for its longest context
            key = (b, chunk, max(c for bb, c in a.contexts if bb == b))
            jobs.append((key, f"ours.context.B{b}.{ctx}", lambda b=b, ctx=ctx: self.our_context(b, ctx)))
        for key in dict.fromkeys(k for k, _, _ in jobs):  # jobs sharing an engine run together
            for name, fn in [(n, f) for k, n, f in jobs if k == key]:
                self.job(name, fn)
        self.free()

    def our_decode(self, batch: int, seqs: int) -> None:
        a = self.args
        llm = self.ours_engine(seqs, a.chunk)
        run_llm(llm, self.prompts(f"warmup-decode{batch}", batch, min(a.prompt_len, 128)), 4)
        log(f"  warmed up; measuring {batch} prompts of {a.prompt_len} tokens")  # a stall shows which
        outs, steps, wall = run_llm(llm, self.prompts(f"decode-B{batch}", batch, a.prompt_len), a.new_tokens)
        d = decode_stats(outs, steps, batch, a.new_tokens)
        row = self.row(f"ours.decode.B{batch}", d["decode_tok_s"], batch, batch=batch, max_num_seqs=seqs)
        row |= d | {"wall_s": wall, "ttft_mean_s": prefill_stats(outs)["ttft_mean_s"]}
        self.add(row, f"{d['decode_tok_s']:.1f} tok/s ({d['decode_method']})")

    def our_prefill(self, chunk: int, runs: list[tuple[int, int]], pareto: bool = False) -> None:
        """Prefill rows (``max_tokens=1``) of ``runs`` (prompts, length) or the Pareto points."""
        most, series = max(c for c, _ in runs), f"DeepInfer chunk {chunk}" if pareto else None
        llm = self.ours_engine(most, chunk)
        if series:
            self.data["pareto"][series] = []
        for i, (count, length) in enumerate(runs):
            name = f"ours.pareto.chunk{chunk}.B{count}" if pareto else f"ours.prefill.{count}x{length}"
            if not (pareto and i):  # a warm-up of each prefill shape, one of the sweep's largest batch
                run_llm(llm, self.prompts(f"warmup-{name}", most if pareto else count, length), 1)
            outs, _, wall = run_llm(llm, self.prompts(name, count, length), 1)
            p = prefill_stats(outs) | ({"batch": count} if pareto else {"wall_s": wall})
            full, rest = divmod(count * length, chunk)  # the prefill's steps: full chunks, then the rest
            steps = [chunk] * full + [rest] * (rest > 0)
            self.prefill_row(name, p, steps, series, max_num_batched_tokens=chunk)

    def prefill_row(self, name: str, p: dict[str, Any], steps: list[int], series: str | None, **kw: Any):
        """The prefill row ``name`` of the figures ``p``, and with ``series`` its Pareto point."""
        note = f"{p['prefill_tok_s']:.1f} tok/s, TTFT mean {p['ttft_mean_s'] * 1e3:.1f} ms"
        self.add(self.row(name, p["prefill_tok_s"], steps=steps, **p, **kw), note)
        if series:
            keys = ("batch", "ttft_mean_s", "ttft_max_s", "prefill_tok_s")
            self.data["pareto"][series].append({k: p.get(k) for k in keys})

    def our_context(self, batch: int, ctx: int) -> None:
        """Decode at a steady batch of ``batch`` sequences of ``ctx`` tokens (docs/benchmarks.md)."""
        a, cfg, chunk = self.args, self.cfg, self.args.chunk
        ctxs = [c for b, c in a.contexts if b == batch]
        longest, base_name = max(ctxs), f"ours.context.B{batch}.{min(ctxs)}"
        rows = gm.kv_row_bytes(cfg, a.kv_cache_dtype, self.dtype.itemsize)
        if longest > cfg.max_position_embeddings:
            raise Unfit(f"context {longest} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        if self.cuda and self.name != f"S{batch}.chunk{chunk}.len{longest}":  # the cache fits?
            self.free()
            kv_gib = batch * gm.kv_bytes(cfg, longest, rows, read=False) / 2**30
            w_gib = gm.weight_bytes_per_step(cfg, 10**9, "fp8_fp4" if a.keep_quantized else "bf16") / 2**30
            if kv_gib + w_gib > 0.9 * (free := torch.cuda.mem_get_info(self.device)[0] / 2**30):
                raise Unfit(f"B={batch} x {longest} tokens need {kv_gib:.1f} GiB of KV cache beside "
                            f"{w_gib:.1f} GiB of weights; the GPU has {free:.1f} GiB free")  # fmt: skip
        # every request keeps decoding until the last prompt is prefilled: the steps after it
        # are a steady batch of `batch` decodes of a.new_tokens tokens or more
        max_tokens = a.new_tokens + -(-batch * ctx // max(chunk - batch, 1)) + batch
        if ctx <= max_tokens:
            raise Unfit(f"context {ctx} is shorter than the {max_tokens} tokens B={batch} decodes")
        llm = self.ours_engine(batch, chunk, longest)
        run_llm(llm, self.prompts(f"warmup-context{batch}", batch, min(ctx, 128)), 4)
        prompts = self.prompts(f"ctx{ctx}-B{batch}", batch, ctx - max_tokens)
        outs, steps, wall = run_llm(llm, prompts, max_tokens)
        d, p = decode_stats(outs, steps, batch, max_tokens), prefill_stats(outs)
        if "decode_tok_s_full_batch" not in d:
            raise RuntimeError(f"no step decoded all {batch} requests")
        kv, tok_s = batch * gm.kv_bytes(cfg, ctx, rows), d.pop("decode_tok_s_full_batch")
        step_ms = d.pop("decode_step_ms_full_batch")
        base = self.result(base_name) or {"step_ms": step_ms}
        row = self.row(f"ours.context.B{batch}.{ctx}", tok_s, batch, kv=kv, context_batch=batch, context=ctx)
        row |= {"step_ms": step_ms, "kv_read_bytes_per_step": kv, "kv_row_bytes": rows}
        row |= {"max_tokens": max_tokens, "base_context": min(ctxs), "step_ratio": step_ms / base["step_ms"]}
        row |= {"ttft_s": p["ttft_max_s"], "prefill_tok_s": p["prefill_tok_s"], "wall_s": wall} | d
        self.add(row, f"{step_ms:.2f} ms/step, {tok_s:.1f} tok/s, x{row['step_ratio']:.2f}")

    # -- HF transformers
    def hf(self) -> None:
        a, model = self.args, []
        self.job("hf.load", lambda: model.append(self.hf_model()))
        if not model:
            return
        warm = self.prompts("warmup-hf", 1, min(a.prompt_len, 128))
        self.job("hf.warmup", h.hf_generate, model[0], warm, 4, self.sync)
        for b in [] if a.skip_decode else a.hf_batch_sizes:
            self.job(f"hf.decode.B{b}", self.hf_decode, model[0], b)
        for count, length in [] if a.skip_prefill else a.prefill:
            self.job(f"hf.prefill.{count}x{length}", self.hf_prefill, model[0], count, length)
        if a.pareto:
            self.data["pareto"]["HF transformers (eager)"] = []
        for b in a.pareto_batch_sizes if a.pareto else []:
            self.job(f"hf.pareto.B{b}", self.hf_prefill, model[0], b, a.pareto_prompt_len, True)
        model.clear()
        self.free()

    def hf_model(self) -> Any:
        """HF ``DeepseekV4ForCausalLM`` (eager attention) on the device, loaded with the checkpoint
        as DeepInfer's loader dequantises it (HF names; FP8/FP4 -> ``--dtype``); its figures join
        the report's ``engines``."""
        t0 = time.perf_counter()  # transformers' import included
        from transformers import DeepseekV4Config as HFConfig
        from transformers import DeepseekV4ForCausalLM

        dtype, device = self.dtype, self.device
        hf_cfg = HFConfig(**{k: v for k, v in self.cfg_dict.items() if k != "quantization_config"})
        with torch.device(device):
            model = DeepseekV4ForCausalLM._from_config(hf_cfg, dtype=dtype, attn_implementation="eager")
        model = model.to(device)  # anything torch.device() did not place
        state = load_checkpoint(self.model_dir, DeepseekV4Config.from_file(self.model_dir), dtype, device)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("inv_freq")]
        if missing or unexpected:
            raise RuntimeError(f"HF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.generation_config.eos_token_id = None  # ignore EOS: every request runs to max_new_tokens
        info = {"engine": "hf", "build_s": time.perf_counter() - t0}
        self.data["engines"].append(info | {k: getattr(model.config, f"_{k}", None) for k in HF_IMPL})
        return model.eval()

    def hf_decode(self, model: Any, batch: int) -> None:
        n, prompts = self.args.new_tokens, self.prompts(f"decode-B{batch}", batch, self.args.prompt_len)
        _, wall, times = h.hf_generate(model, prompts, n, self.sync)
        secs = times[-1] - times[0]
        row = self.row(f"hf.decode.B{batch}", batch * (n - 1) / secs, batch, batch=batch, wall_s=wall)
        row |= {"ttft_s": times[0], "decode_step_ms": 1e3 * secs / max(len(times) - 1, 1)}
        self.add(row, f"{row['value']:.1f} tok/s")

    def hf_prefill(self, model: Any, count: int, length: int, pareto: bool = False) -> None:
        """A prefill row (``max_tokens=1``) of ``count`` prompts of ``length``, or a Pareto point."""
        name = f"hf.pareto.B{count}" if pareto else f"hf.prefill.{count}x{length}"
        _, wall, (ttft, *_) = h.hf_generate(model, self.prompts(name, count, length), 1, self.sync)
        p = {"prompt_tokens": count * length, "prefill_tok_s": count * length / ttft, "ttft_mean_s": ttft}
        p |= {"ttft_max_s": ttft} | ({"batch": count} if pareto else {})
        series = "HF transformers (eager)" if pareto else None
        self.prefill_row(name, p, [count * length], series, ttft_s=ttft, wall_s=wall)


# ---- output ----------------------------------------------------------------------------------------
ROOF = [("roof bf16", "roofline_frac_bf16", ".1%"), ("roof fp8/4", "roofline_frac_fp8_fp4", ".1%")]
TABLE = [("name", "name", "s"), ("value", "value", ".1f"), ("unit", "unit", "s"), *ROOF]
TABLE += [("roof FLOP", "roofline_frac_compute", ".1%")]
TABLE += [("step ms", "decode_step_ms_full_batch", ".3f"), ("median ms", "decode_step_ms_median", ".3f")]
TABLE += [("wait ms", "host_wait_ms_median", ".3f")]
CONTEXT_TABLE = [("context", "name", "s"), ("step ms", "step_ms", ".2f"), ("tok/s", "value", ".1f")]
CONTEXT_TABLE += [("KV MB/step", "kv_mb", ".2f"), *ROOF, ("x base", "step_ratio", ".2f")]
CONTEXT_TABLE += [("TTFT s", "ttft_s", ".2f"), ("prefill tok/s", "prefill_tok_s", ".0f")]


def print_tables(rows: list[dict[str, Any]]) -> None:
    """Every row (a failed or skipped one with its reason), then the ``--contexts`` rows."""
    print()
    h.print_table([r | {"unit": r.get("error") or r.get("skipped") or r["unit"]} for r in rows], TABLE)
    ctx = [r | {"kv_mb": r["kv_read_bytes_per_step"] / 1e6} for r in rows if r.get("step_ms") is not None]
    if ctx:
        print()
        h.print_table(ctx, CONTEXT_TABLE)


# ---- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " (docs/benchmarks.md)")
    add = ap.add_argument
    add("--smoke", action="store_true", help="CPU, tiny widths, a few tokens: checks the code path")
    add("--backend", default="auto", help="DeepInfer backend (default auto)")
    add("--enforce-eager", action="store_true", help="LLM(enforce_eager=True): no device graphs")
    h.add_keep_quantized(ap, "LLM(keep_quantized=None|True|False): FP8/FP4 weights kept quantised")
    add("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="LLM(kv_cache_dtype=...)")
    add("--batch-sizes", type=positive_ints, help="decode batch sizes (default 1,16,64,256)")
    add("--new-tokens", type=int, help="tokens generated per decode request (default 32)")
    add("--shared-engine", action="store_true", help="one engine (the largest batch) for every decode batch")
    add("--hf-batch-sizes", type=positive_ints, help="HF decode batch sizes (default 1,16)")
    add("--pareto", action="store_true", help="prefill tok/s vs TTFT sweep (the JSON's pareto points)")
    add("--pareto-batch-sizes", type=positive_ints, help="default 1,2,4,8,16")
    add("--pareto-chunks", type=positive_ints, help="max_num_batched_tokens values (default 2048,8192)")
    add("--contexts", nargs="?", const="", help=f"CTX or B@CTX items to decode at (alone: {CONTEXTS[0]})")
    add("--context-batch", type=int, help="batch of the --contexts items without B@ (default 16)")
    for part in ("ours", "hf", "decode", "prefill"):
        add(f"--skip-{part}", action="store_true", help=f"leave out the {part} rows")
    add("--out", type=Path, help="results JSON (default benchmarks/results/gpu_e2e.json)")
    add("--append", action="store_true", help="merge into an existing --out (rows replaced by name)")
    add("--model-dir", type=Path, help="checkpoint folder, reused or written and kept (default: temporary)")
    add("--time-budget", type=float, default=0.0, help="seconds from the start after which measurements skip")
    args = ap.parse_args(argv)
    mode = int(args.smoke)
    for key, values in MODE.items():
        if getattr(args, key, None) is None:
            setattr(args, key, values[mode])
    args.keep_quantized = h.KEEP_QUANTIZED[args.keep_quantized]
    items = [] if args.contexts is None else (args.contexts or CONTEXTS[mode]).split(",")
    try:
        pairs = [i.rpartition("@") for i in items]
        args.contexts = [(int(b or args.context_batch), int(c)) for b, _, c in pairs]
    except ValueError:
        args.contexts = [(0, 0)]
    if any(min(p) < 1 for p in args.contexts):
        ap.error(f"--contexts takes positive CTX or B@CTX items separated by commas, got {','.join(items)!r}")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode needs a token after the first)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:  # tiny matmuls: one thread avoids OpenMP stalls on a small, shared CPU
        torch.set_num_threads(1)
    cfg_dict = gm.flash_config(LAYERS, args.experts, smoke=args.smoke)
    with tempfile.TemporaryDirectory(prefix="gpu_e2e_model_", ignore_cleanup_errors=True) as tmp:
        model_dir = args.model_dir or Path(tmp)  # a temporary checkpoint is removed at the end
        bench = Bench(args, model_dir, cfg_dict)
        data = bench.data
        log(f"model: {LAYERS} layers, {args.experts} experts, {bench.counts['total'] / 1e9:.2f} B params")
        bench.checkpoint(cfg_dict)
        if not args.skip_ours:
            bench.ours()
        if not args.skip_hf:
            bench.hf()
        data["total_s"] = time.perf_counter() - T_START
        bench.save()
        print_tables(data["results"])
        print(f"\nwrote {args.out}")
        failed = [r["name"] for r in data["results"] if r["name"].startswith("ours") and "error" in r]
        if failed:
            log(f"DeepInfer measurements failed: {failed}")
        return int(bool(failed))


if __name__ == "__main__":
    h.run_main(main)
