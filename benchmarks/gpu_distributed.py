"""DP N + EP N decode, CP N prefill and EPLB on N GPUs of one host, each against one GPU.

The e2e model (``gpu_e2e.py``'s); N is ``--world``; NCCL with NVLink multicast off
(docs/benchmarks.md)."""

from __future__ import annotations

import os

# NVLink multicast off before torch (and NCCL) load (/work/.library/device/KINDS.md); ranks inherit it
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(NCCL_SAFE_ENV)
# ruff: noqa: E402

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import _gpu_model as gm
import gpu_e2e as e2e

from deepinfer_core import LLM
from deepinfer_core.benchmarking.harness import choice_list, log, positive_ints, print_table, run_main
from deepinfer_core.distributed.processes import LOG_DIR_ENV
from deepinfer_core.errors import ConfigError
from deepinfer_core.models.context_parallel import CP_MIN_TOKENS_ENV, cp_min_tokens
from deepinfer_core.testing.observe import counting_context_parallel_forwards

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_distributed.json"
PARTS = ("decode", "cp", "eplb")
HOT_PERCENT = 90  # the eplb part's prompts: this share of the ids from the eplb_hot_ids ones
FILLER_LEN = 8  # prompt ids of the eplb part's filler requests (one per rank)
TIMEOUT_S = 180.0  # NCCL's
DEFAULTS: dict[str, tuple[Any, Any, str]] = {  # flag: (default of a GPU run, with --smoke, help)
    "parts": ("decode,cp", ",".join(PARTS), f"comma-separated subset of {','.join(PARTS)}"),
    "backend": ("cuda_sm100", "reference", "DeepInfer backend"),
    "batch_sizes": ("64,256", "2,4", "decode batch sizes per GPU"),
    "prompt_len": (512, 24, "decode prompts' length"),
    "new_tokens": (32, 6, "tokens per decode request (>= 2)"),
    "cp_prompt_len": (32768, 300, "the CP prefill prompt"),
    "cp_chunk": (8192, 128, "max_num_batched_tokens of the CP engines"),
    "cp_repeats": (2, 2, "measured CP prompts, best TTFT kept"),
}
FIXED: dict[str, tuple[Any, Any]] = {  # settings without a flag: (a GPU run's, --smoke's)
    "device": ("cuda", "cpu"), "dtype": ("bfloat16", "float32"),
    "chunk": (8192, 64),  # max_num_batched_tokens of the decode / eplb engines
    "cp_new_tokens": (4, 3), "cp_min_tokens": (None, 64),  # the latter sets CP_MIN_TOKENS_ENV
    "eplb_hot_ids": (4, 2),  # eplb: HOT_PERCENT % of the prompt ids come from this many ids
}  # fmt: skip
COLUMNS = "name value:.1f unit per_gpu_vs_1gpu:.2f decode_step_ms_full_batch:.2f ttft_ms:.1f"
COLUMNS += " speedup_vs_1gpu:.2f max_over_mean_load:.3f placement"
COLUMNS += " per_gpu_vs_before:.2f why"


class Bench(e2e.Runner):
    """The measurements (docs/benchmarks.md), one engine alive at a time."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, vocab: int, **header: Any):
        super().__init__(args, model_dir, vocab, **header)
        n = self.world = args.world
        ep = {"data_parallel_size": n, "enable_expert_parallel": True}
        self.kinds = {"1gpu": {}, f"dp{n}ep{n}": ep, f"dp{n}": {"data_parallel_size": n}}
        self.fmt = "fp8_fp4" if args.keep_quantized else {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]

    def skewed_prompts(self, tag: str, count: int, length: int) -> list[list[int]]:
        """``HOT_PERCENT`` % of the ids from ``eplb_hot_ids`` fixed ids, the rest uniform (V4's
        hash-routed layers send a token by its id, so these few ids load few experts)."""
        hot = self.prompts("eplb-hot", 1, self.args.eplb_hot_ids)[0]
        picks = self.prompts(f"{tag}-pick", count, length)
        return [
            [hot[x % len(hot)] if pick % 100 < HOT_PERCENT else x for x, pick in zip(p, q, strict=True)]
            for p, q in zip(self.prompts(tag, count, length), picks, strict=True)
        ]

    def options(self, seqs: int, chunk: int, max_len: int, **extra: Any) -> dict[str, Any]:
        """An engine's ``LLM`` options beyond the common ones."""
        base = {"max_num_seqs": seqs, "max_num_batched_tokens": chunk, "max_model_len": max_len}
        return {**base, "enforce_eager": self.args.enforce_eager, "distributed_timeout_s": TIMEOUT_S, **extra}

    def engine(self, name: str, **options: Any) -> LLM:
        if self.args.log_dir is not None:  # the workers' rank<k>.log files of this engine
            os.environ[LOG_DIR_ENV] = str(self.args.log_dir / name)
        return super().engine(name, **options)

    def engine_info(self, llm: LLM, name: str, options: dict[str, Any]) -> dict[str, Any]:
        """The engine's figures (a distributed one's process group backend included)."""
        world = options.get("data_parallel_size", 1) * options.get("context_parallel_size", 1)
        dist = torch.distributed
        backend = dist.get_backend() if world > 1 and dist.is_initialized() else None
        info = {"engine": name, "world": world, "options": options}
        info |= {"kv_cache_capacity_tokens": llm.kv_cache_capacity_tokens, "dist_backend": backend}
        info["rank0_weight_gib"] = llm.engine.runner.model.weight_bytes() / 2**30
        return info | {"graph_buckets": sorted(llm.engine.runner.graph_manager.graphs("decode"))}

    def run(self) -> None:
        """The parts of ``--parts``, in the order given."""
        for part in self.args.parts:
            {"decode": self.run_decode, "cp": self.run_cp, "eplb": self.run_eplb}[part]()
            self.free()

    # -- decode
    def run_decode(self) -> None:
        a = self.args
        max_len = a.prompt_len + a.new_tokens + 16
        for kind in ("1gpu", *a.decode_modes):
            options = self.options(max(a.batch_sizes), a.chunk, max_len, **self.kinds[kind])
            for b in a.batch_sizes:
                self.job(f"decode.{kind}.B{b}", self.decode, kind, b, engine=(f"decode.{kind}", options))

    def decode(self, llm: LLM, kind: str, batch: int) -> None:
        """B requests per GPU (``world * B`` in all); tok/s per GPU from rank 0's steps."""
        a, world = self.args, 1 if kind == "1gpu" else self.world
        warmup = self.prompts(f"warmup-decode-w{world}-B{batch}", batch * world, min(a.prompt_len, 128))
        e2e.run_llm(llm, warmup, 4)
        row = self.measure_decode(llm, self.prompts(f"decode-B{batch}", batch * world, a.prompt_len), batch)
        row = {"name": f"decode.{kind}.B{batch}", **row, "mode": kind}
        if world > 1:
            if one := self.result(f"decode.1gpu.B{batch}").get("value"):
                row["per_gpu_vs_1gpu"] = row["value"] / one
            ranks = llm.get_metrics().get("per_rank", [])
            row["per_rank_generated_tokens"] = [m.get("num_generated_tokens") for m in ranks]
        self.add(row, f"{row['value']:.1f} tok/s per GPU, {row['aggregate_tok_s']:.1f} in all")

    def measure_decode(self, llm: LLM, prompts: list[list[int]], batch: int) -> dict[str, Any]:
        """Generate ``prompts`` (``batch`` on each rank), ``--new-tokens`` each: decode tok/s per GPU
        from rank 0's steps in which its whole batch decodes (the ranks step in lockstep)."""
        a, world = self.args, len(prompts) // batch
        outs, steps, wall = e2e.run_llm(llm, prompts, a.new_tokens)
        d = e2e.decode_stats(outs[::world], steps, batch, a.new_tokens)  # rank 0's: replicas alternate
        p = e2e.prefill_stats(outs)
        runner, most = llm.engine.runner, max((s.num_seqs for _, s in steps), default=0)
        row: dict[str, Any] = {
            "value": d["decode_tok_s"], "unit": "tok/s/GPU", "fmt": self.fmt, "world": world,
            "batch_per_gpu": batch, "requests": len(prompts), "aggregate_tok_s": d["decode_tok_s"] * world,
            "wall_s": wall, "end_to_end_tok_s_per_gpu": len(prompts) * a.new_tokens / wall / world,
            "rank0_max_seqs_in_a_step": most, "ttft_mean_s": p["ttft_mean_s"],
            "prefill_tok_s_per_gpu": p["prefill_tok_s"] / world,
            "graphs": bool(runner.graph_manager.graphs("decode")),
            "ep_graph_stats": dict(getattr(runner, "ep_graph_stats", None) or {}), **d,
        }  # fmt: skip
        if most != batch:
            row["note"] = f"rank 0 held up to {most} requests in a step, expected {batch}"
        return row

    # -- cp
    def run_cp(self) -> None:
        a = self.args
        for world in (1, self.world):
            mode, cp = ("1gpu", {}) if world == 1 else (f"cp{world}", {"context_parallel_size": world})
            options = self.options(2, a.cp_chunk, a.cp_prompt_len + a.cp_new_tokens + 128, **cp)
            name = f"prefill.{mode}.{a.cp_prompt_len}"
            self.job(name, self.cp, mode, world, engine=(f"cp.{mode}", options))

    def cp(self, llm: LLM, mode: str, world: int) -> None:
        """One long prompt at a time: TTFT and prompt tok/s, best of ``--cp-repeats``."""
        a, model = self.args, llm.engine.runner.model
        with counting_context_parallel_forwards(model) as split:
            e2e.run_llm(llm, self.prompts("warmup-cp", 1, a.cp_prompt_len), a.cp_new_tokens)
            split[0] = 0
            ttfts = []
            for r in range(a.cp_repeats):
                outs, _, _ = e2e.run_llm(llm, self.prompts(f"cp-{r}", 1, a.cp_prompt_len), a.cp_new_tokens)
                ttfts.append(outs[0].metrics.first_token_time - outs[0].metrics.arrival_time)
        best, tok_s = min(ttfts), a.cp_prompt_len / min(ttfts)
        row: dict[str, Any] = {
            "name": f"prefill.{mode}.{a.cp_prompt_len}", "value": tok_s, "unit": "tok/s", "mode": mode,
            "fmt": self.fmt, "world": world, "prompt_tokens": a.cp_prompt_len,
            "max_num_batched_tokens": a.cp_chunk,
            "cp_min_tokens": getattr(model, "cp_min_tokens", None), "ttft_s": best, "ttft_all_s": ttfts,
            "tok_s_per_gpu": tok_s / world, "rank0_forwards_with_cp_plan": split[0],
        }  # fmt: skip
        if world > 1:
            if (ref := self.result(f"prefill.1gpu.{a.cp_prompt_len}")).get("value"):
                row.update(speedup_vs_1gpu=tok_s / ref["value"], ttft_vs_1gpu=best / ref["ttft_s"])
            if split[0] == 0:  # kept with its figures, but the run fails
                row["error"] = f"CP split no step (cp_min_tokens {row['cp_min_tokens']}, chunk {a.cp_chunk})"
        self.add(row, f"TTFT {best * 1e3:.1f} ms, {tok_s:.0f} tok/s ({tok_s / world:.0f} per GPU)")

    # -- eplb
    def run_eplb(self) -> None:
        """DP N + EP N with EPLB (``--batch-sizes``' first per GPU, N redundant experts): window and
        interval ``R`` twice a bound of one round's steps (prefill in chunks, the decode steps,
        slack), so that the warm-up and the "before" round end before the rebalancing."""
        a, n, batch = self.args, self.world, self.args.batch_sizes[0]
        r = 2 * (-(-batch * (a.prompt_len + a.new_tokens) // a.chunk) + a.new_tokens + 4) + 2
        eplb = {"window_steps": r, "rebalance_interval": r, "num_redundant_experts": n}
        max_len = max(a.prompt_len, FILLER_LEN) + a.new_tokens + 16
        options = self.options(batch, a.chunk, max_len, **self.kinds[f"dp{n}ep{n}"], eplb=eplb)
        self.job("eplb", self.eplb, eplb, batch, engine=(f"eplb.dp{n}ep{n}", options))

    def eplb(self, llm: LLM, eplb: dict[str, int], batch: int) -> None:
        """A skewed round before the rebalancing at step ``R`` and one after it, filler requests up
        to ``R`` and ``2R``; rows ``eplb.before`` / ``eplb.after``: decode tok/s per GPU and the
        max/mean GPU expert load of steps ``1..R`` and ``R+1..2R`` (the checks at ``R`` and ``2R``)."""
        a, interval, n = self.args, eplb["window_steps"], batch * self.world
        e2e.run_llm(llm, self.skewed_prompts("eplb-warmup", n, a.prompt_len), a.new_tokens)  # in window 1
        rows: dict[str, dict[str, Any]] = {}
        for phase, due in (("before", interval), ("after", 2 * interval)):
            first = self.eplb_state(llm)["steps"]
            row = self.measure_decode(llm, self.skewed_prompts(f"eplb-{phase}", n, a.prompt_len), batch)
            state = self.eplb_state(llm)
            if (last := state["steps"]) >= due:
                raise RuntimeError(f"the '{phase}' round ran to step {last}, past the check at step {due}")
            while state["steps"] < due:  # filler requests, one a rank, up to the check
                steps = state["steps"]
                prompts = self.skewed_prompts(f"eplb-fill-{steps}", self.world, FILLER_LEN)
                e2e.run_llm(llm, prompts, min(due - steps, a.new_tokens))
                state = self.eplb_state(llm)
                if state["steps"] <= steps:
                    raise RuntimeError(f"the engine's EPLB step count stays at {steps} ({state})")
            check = next((c for c in state["checks"] if c["step"] == due), None)
            if check is None:
                raise RuntimeError(f"no rebalancing check at engine step {due}: {state}")
            rows[phase] = {
                "name": f"eplb.{phase}", **row, "mode": f"dp{self.world}ep{self.world}",
                "engine_steps": [first + 1, last], "max_over_mean_load": check["imbalance_before"],
                "load_steps": [due - interval + 1, due], "check": check, "rebalances": state["rebalances"],
                "hot_ids": a.eplb_hot_ids, "hot_percent": HOT_PERCENT, "eplb": eplb,
            }  # fmt: skip
            if phase == "before":  # the placement the check at R put in place
                ranks = llm.get_metrics().get("per_rank", [])
                rows[phase].update(
                    placement="initial", rebalanced_at_check=check["rebalanced"],
                    predicted_max_over_mean_load_after=check["imbalance_after"],
                    experts_received_per_rank=[m.get("eplb", {}).get("last_experts_received") for m in ranks],
                )  # fmt: skip
        before, after = rows["before"], rows["after"]
        after["placement"] = "rebalanced" if before["rebalanced_at_check"] else "initial (not rebalanced)"
        after["predicted_max_over_mean_load"] = before["predicted_max_over_mean_load_after"]
        after["per_gpu_vs_before"] = after["value"] / before["value"] if before["value"] else None
        after["load_vs_before"] = after["max_over_mean_load"] / before["max_over_mean_load"]
        if not before["rebalanced_at_check"]:
            after["note"] = "the policy found no better placement at the first check: no rebalancing"
        results = self.data["results"]
        results[:] = [r for r in results if r["name"] != "eplb"]  # an earlier run's failure (--append)
        for row in (before, after):
            self.add(row, f"{row['value']:.1f} tok/s/GPU, load {row['max_over_mean_load']:.3f}")

    def eplb_state(self, llm: LLM) -> dict[str, Any]:
        """The engine's EPLB figures, ``get_metrics()["eplb"]`` (fresh after a ``generate``)."""
        state = llm.get_metrics().get("eplb")
        if state is None:
            raise RuntimeError("the engine reports no EPLB figures (get_metrics()['eplb'] is missing)")
        return state


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add, smoke = ap.add_argument, "--smoke" in (sys.argv[1:] if argv is None else argv)
    add("--smoke", action="store_true", help="CPU, gloo, reference backend, built-in tiny model")
    add("--world", type=int, default=2, help="ranks (GPUs) of every distributed engine (default 2)")
    for key, (full, small, text) in DEFAULTS.items():  # string defaults go through the type too
        kind = {"parts": choice_list(PARTS), "batch_sizes": positive_ints}.get(key, type(full or 0))
        help = f"{text} (default {full}; --smoke {small})"
        add("--" + key.replace("_", "-"), type=kind, default=small if smoke else full, help=help)
    add("--decode-modes", help="decode part's N-GPU engines: dpNepN (default), dpN (no EP); e.g. dp8ep8,dp8")
    add("--keep-quantized", choices=("on", "off"), default="off", help="on: FP8/FP4 weights kept")
    add("--enforce-eager", action="store_true", help="no decode graphs on any engine")
    add("--layers", type=int, default=4, help="decoder layers of the e2e model")
    add("--experts", type=int, default=64, help="routed experts of the e2e model (a multiple of --world)")
    add("--model-dir", type=Path, help="e2e checkpoint folder: reused when it holds it, else written")
    add("--log-dir", type=Path, help=f"worker logs: <dir>/<engine>/rank<k>.log (sets {LOG_DIR_ENV})")
    out = Path(tempfile.gettempdir()) / "gpu_distributed_smoke.json" if smoke else DEFAULT_OUT
    add("--out", "--output", "--json", type=Path, default=out, help=f"results JSON (default {out})")
    add("--append", action="store_true", help="merge into an existing --out (rows replaced by name)")
    add("--time-budget", type=float, default=0.0, help="seconds from the start; later parts are skipped")
    args = ap.parse_args(argv)
    vars(args).update({key: values[args.smoke] for key, values in FIXED.items()})
    n, args.keep_quantized = args.world, args.keep_quantized == "on"
    try:
        args.decode_modes = choice_list((f"dp{n}ep{n}", f"dp{n}"))(args.decode_modes or f"dp{n}ep{n}")
    except argparse.ArgumentTypeError as e:
        ap.error(f"--decode-modes: {e}")
    least = {"world": 2, "new_tokens": 2}
    if low := [k for k, v in vars(args).items() if type(v) is int and v < least.get(k, 1)]:
        ap.error(f"--{low[0].replace('_', '-')} must be >= {least.get(low[0], 1)}")
    return args


def preflight(args: argparse.Namespace) -> None:
    """What the run needs, checked before anything is built; a one-line :class:`ConfigError` otherwise."""
    from deepinfer_core.backends.resolve import resolve_backend

    n, device = args.world, torch.device(args.device)
    if args.experts % n:
        why = f"{args.experts} routed experts do not divide over --world {n} ranks (expert parallelism)"
        raise ConfigError(f"{why}: give --experts a multiple of {n}")
    if device.type == "cuda" and (gpus := torch.cuda.device_count()) < n:
        raise ConfigError(f"needs {n} GPUs (--world {n}), torch sees {gpus} (--smoke: the CPU)")
    if device.type == "cuda" and not torch.distributed.is_nccl_available():
        raise ConfigError("NCCL is not available in this torch build")
    spec, _ = resolve_backend(args.backend)  # an unknown or unavailable one: a BackendError line
    if spec.device_type != device.type and args.backend != "reference":
        raise ConfigError(f"backend {args.backend!r} runs on {spec.device_type}, not on {args.device}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model_dir
    if args.smoke:  # the tiny model: one thread avoids OpenMP stalls on a small, shared CPU
        from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir

        torch.set_num_threads(1)
        model_dir = builtin_tiny_model_dir()
        cfg = json.loads((model_dir / "config.json").read_text())
        args.layers, args.experts = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    else:
        cfg = gm.flash_config(args.layers, args.experts)
    preflight(args)
    if args.cp_min_tokens is not None:  # read when a model is built; the workers inherit it
        os.environ[CP_MIN_TOKENS_ENV] = str(args.cp_min_tokens)
    if args.cp_chunk < cp_min_tokens():
        log(f"warning: --cp-chunk {args.cp_chunk} < cp_min_tokens {cp_min_tokens()}: CP will not split")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    nccl_env = {k: os.environ.get(k) for k in NCCL_SAFE_ENV}
    with tempfile.TemporaryDirectory(prefix="gpu_distributed_model_", ignore_cleanup_errors=True) as tmp:
        model_dir = model_dir or Path(tmp)  # a temporary checkpoint is removed at the end
        model = {"config": cfg, "dir": str(model_dir)}
        bench = Bench(args, model_dir, cfg["vocab_size"], model=model, nccl_env=nccl_env)
        data = bench.data
        data.pop("pareto", None)
        try:
            if not args.smoke:
                bench.checkpoint(cfg)
            bench.run()
        finally:
            bench.free()
    data["total_s"] = time.perf_counter() - e2e.T_START
    bench.save()
    results = data["results"]
    shown = [{**r, "ttft_ms": r.get("ttft_s", 0) * 1e3 or None} for r in results]
    for r in shown:  # a skip or a failure, cut to a table cell
        r["why"] = (r.get("error") or r.get("skipped") or "")[:80] or None
    print_table(shown, COLUMNS)
    print(f"\nwrote {args.out}")
    errors, skipped = ([r["name"] for r in results if key in r] for key in ("error", "skipped"))
    log(f"FAILED measurements: {errors}" if errors else f"all done, skipped: {skipped or 'none'}")
    return 1 if errors else 0


if __name__ == "__main__":
    run_main(main)
