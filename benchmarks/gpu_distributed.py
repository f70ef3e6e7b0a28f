"""Distributed GPU benchmark: DP N + EP N decode, greedy equality,
CP N prefill and EPLB of the e2e model on ``--world`` N GPUs of one host (default 2), each
against one GPU.

The model is the one of ``gpu_e2e.py`` (:mod:`_gpu_model`: DeepSeek-V4-Flash widths, ``--layers``
4 layers ``[sliding, CSA, HCA, CSA]``, ``--experts`` 64 routed experts (a multiple of N), random
seeded weights in a native FP8 / FP4 checkpoint, written to ``--model-dir`` when that folder does
not hold it yet and reused otherwise, so a checkpoint ``gpu_e2e.py`` wrote with the same settings
serves both).  Weights are dequantised to bf16 at load (``--keep-quantized off``, the default) or
kept FP8/FP4 (``--keep-quantized on``).  Prompts are random token ids; every request is greedy
with ``ignore_eos``.  Four parts (``--parts``, run in the order given, by default
``decode,cp,equality``; each engine is shut down and freed before the next is built).  Rows and
engines are named by N: ``dp8ep8``, ``dp8``, ``cp8`` with ``--world 8`` (``dp2ep2``, ``dp2``,
``cp2`` with the default 2):

``decode``
    Decode throughput per GPU at ``--batch-sizes`` B = 64, 256 per GPU, prompts of
    ``--prompt-len`` 512, ``--new-tokens`` 32: one GPU with B requests vs
    ``LLM(data_parallel_size=N, enable_expert_parallel=True)`` with N * B requests (B on each
    rank: the coordinator assigns requests to replicas alternately; ``--decode-modes
    dpNepN,dpN`` adds ``LLM(data_parallel_size=N)``, N full replicas without expert
    parallelism, which separates the exchange's cost).  tok/s per GPU is taken
    from rank 0's steps in which all its B requests decode (``gpu_e2e``'s steady-batch
    figure; the ranks step in lockstep).  Each row records whether rank 0 captured decode
    graphs (``graphs``, and the EP graph statistics where the runner keeps them);
    ``--enforce-eager`` makes every engine eager.  The same two engines then generate a shared
    prompt set (``--eq-prompts`` prompts of 16 .. ``--eq-max-len`` ids, ``--eq-new-tokens``
    tokens, logprobs): the row ``equality.dpNepN.fast`` counts the prompts whose greedy tokens
    equal one GPU's and the largest logprob difference (bf16 batches differ, so a few tokens
    may differ).
``cp``
    Prefill of one ``--cp-prompt-len`` 32768-token prompt: one GPU vs
    ``LLM(context_parallel_size=N)``, both with ``max_num_batched_tokens = --cp-chunk`` (8192:
    every chunk has far more than ``CP_MIN_TOKENS`` = 1024 rows, so each is split zig-zag
    over the N ranks; ``--cp-min-tokens`` sets ``DEEPINFER_CP_MIN_TOKENS``) and
    ``max_model_len`` = prompt + new tokens + 128.  A warm-up prompt of the same length,
    then ``--cp-repeats`` distinct prompts (no prefix-cache hits): TTFT (arrival to first
    token) and prompt tok/s (total and per GPU), best of the repeats; rank 0's forward
    passes with a context-parallel plan are counted (a CP N row with none is an error), and
    the CP N greedy tokens are compared with one GPU's.
``equality``
    The shared prompt set on three eager engines with ``batch_invariant=True`` when the
    backend declares batch invariance on the device (``cuda_sm100`` does on CUDA): one GPU,
    DP N + EP N and DP N (no EP).  Rows ``equality.dpNepN.bi`` / ``equality.dpN.bi``: prompts
    token-equal and whether every logprob is bitwise equal (``tests/distributed/test_nccl.py``
    and ``tests/test_benchmark_scripts.py`` judge them).  Without declared invariance the same rows run
    in the default mode (rows ``.eager``), for information.
``eplb``
    DP N + EP N with ``eplb={"window_steps": R, "rebalance_interval": R,
    "num_redundant_experts": --eplb-redundant}`` (default N replicas; ``R`` = ``--eplb-interval``,
    by default twice a bound of one round's steps) serving a skewed prompt mix: 90 % of the
    prompt ids come from ``--eplb-hot-ids`` 4 fixed ids (V4's first ``num_hash_layers`` layers
    route a token by its id, so few ids load few experts; the learned routers see repetitive
    input).  A warm-up round, the "before" round (``--eplb-batch`` B requests a GPU, default
    the first of ``--batch-sizes``, ``--prompt-len``, ``--new-tokens``), filler requests (one
    a rank) up to engine step R, where the controller rebalances once, the "after" round, and
    fillers up to step 2R (the next check).  Rows ``eplb.before`` / ``eplb.after``: decode
    tok/s per GPU (as in ``decode``), prefill tok/s per GPU, and the max/mean GPU expert load
    (``max_over_mean_load``: per layer the most loaded GPU's routed tokens over the mean,
    load-weighted over the layers) of steps 1..R under the first placement and of R+1..2R under
    the rebalanced one -- both measured on the traffic, from the checks the engine reports in
    ``get_metrics()["eplb"]`` (:meth:`EplbController.metrics_dict`); ``eplb.after`` also has
    the policy's prediction, ``per_gpu_vs_before`` and ``load_vs_before``.  Not a default part
    (one more engine build).

NCCL runs with NVLink multicast off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``, set here before torch loads; the worker ranks inherit them).  The
script checks up front that N GPUs, NCCL and the backend are there and that the experts divide
over N ranks, and fails with one line saying what is missing.  It prints a table, writes JSON
(``--out``, after every measurement, so a run cut short keeps what it measured;
``--time-budget`` skips, and records, what would start late; ``--build-reserve`` seconds must
remain to build a new engine).  Exit status 1 when a measurement failed (raised).

On the 2-GPU H200 kind (``python3`` holds torch there; pydantic carried as wheels; the core and
the ``cuda_sm100`` plugin installed from the repo), everything in one command (the seven engine
builds dominate: about 50 s each with a cold Triton cache, as in ``gpu_e2e.py``, less once it is
warm; ``--time-budget`` keeps what fits), then copy the JSON to
``benchmarks/results/gpu_distributed.json``::

    python3 -m pip install --no-deps --no-build-isolation -e . -e plugins/cuda_sm100
    timeout 590 python3 benchmarks/gpu_distributed.py --model-dir /tmp/m --time-budget 540 \\
        --out $OUT/gpu_distributed.json --log-dir $OUT/rank_logs

or in parts that each fit a 10-minute command, merged into one JSON with ``--append``::

    A="--model-dir /tmp/m --time-budget 500 --out $OUT/gpu_distributed.json --log-dir $OUT/rank_logs --append"
    timeout 590 python3 benchmarks/gpu_distributed.py $A --parts decode
    timeout 590 python3 benchmarks/gpu_distributed.py $A --parts cp,equality

On the 8-GPU H200 kind (``nvidia-h200-x8``; ``--world 4`` on ``nvidia-h200-x4``), all
of it in one command (eight engine builds; not yet run on 8 GPUs -- smoke-tested on the CPU
only; if it does not fit the time budget, the skipped parts are listed and a second command
with ``--append --parts ...`` runs them)::

    timeout 590 python3 benchmarks/gpu_distributed.py --world 8 --model-dir /tmp/m \\
        --batch-sizes 64,256,1024 --cp-prompt-len 131072 --parts decode,cp,equality,eplb \\
        --time-budget 540 --out $OUT/gpu_distributed_w8.json --log-dir $OUT/rank_logs

FP8/FP4 weights kept quantised: add ``--keep-quantized on`` (rows are labelled ``fp8_fp4``).
The NCCL exactness tests of the tiny model:
``timeout 300 python3 -m pytest tests/distributed/test_nccl.py -v``.

``--smoke`` runs every part (eplb included) with the same code on the CPU: gloo, the
``reference`` backend, fp32, the built-in tiny model, B = 2 and 4, short prompts, a 300-token CP
prompt in chunks of 128 with ``DEEPINFER_CP_MIN_TOKENS=64``, batch-invariant equality bitwise,
EPLB on prompts from 2 hot ids (about 15 s on two cores with ``--world 2``, 30 s with
``--world 4``; results in ``<tmp>/gpu_distributed_smoke.json``)::

    python benchmarks/gpu_distributed.py --smoke
"""

from __future__ import annotations

import os

# NVLink multicast off, before torch (and NCCL) load: a program using it can take the host's shared
# GPUs out of service (/work/.library/device/KINDS.md).  Worker ranks inherit this environment.
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(NCCL_SAFE_ENV)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import _gpu_model as gm  # noqa: E402
import gpu_e2e as e2e  # noqa: E402

from deepinfer_core import LLM, SamplingParams  # noqa: E402
from deepinfer_core.benchmarking.harness import choice_list, log, positive_ints  # noqa: E402
from deepinfer_core.distributed.processes import LOG_DIR_ENV  # noqa: E402
from deepinfer_core.models.context_parallel import (  # noqa: E402
    CP_MIN_TOKENS_ENV,
    cp_min_tokens,
)
from deepinfer_core.testing.observe import counting_context_parallel_forwards  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_distributed.json"
PARTS = ("decode", "cp", "equality", "eplb")
T_START = time.perf_counter()  # --time-budget counts from here

# Defaults: (full run, --smoke).  Arguments left unset take the column of the mode.
MODE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "parts": (["decode", "cp", "equality"], list(PARTS)),
    "device": ("cuda", "cpu"),
    "backend": ("cuda_sm100", "reference"),
    "dtype": ("bfloat16", "float32"),
    "batch_sizes": ([64, 256], [2, 4]),
    "prompt_len": (512, 24),
    "new_tokens": (32, 6),
    "chunk": (8192, 64),
    "eq_prompts": (32, 6),
    "eq_max_len": (480, 60),
    "eq_new_tokens": (16, 4),
    "cp_prompt_len": (32768, 300),
    "cp_chunk": (8192, 128),
    "cp_new_tokens": (4, 3),
    "cp_repeats": (2, 2),
    "cp_min_tokens": (None, 64),
    "eplb_hot_ids": (4, 2),
}
EQ_LOGPROBS = 2  # top-2 (and the sampled token) per generated token in the equality runs
EPLB_HOT_PERCENT = 90  # the eplb part's prompts: this share of the ids from the --eplb-hot-ids ones
EPLB_FILLER_LEN = 8  # prompt ids of the eplb part's filler requests (one per rank)


def die(msg: str) -> SystemExit:
    """A one-line fatal error (raise the result)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return SystemExit(2)


# ---- engines ----------------------------------------------------------------------------------------
def dp_ep(world: int) -> str:
    """The name of the DP ``world`` + EP ``world`` engine's rows: ``dp2ep2``, ``dp8ep8`` ..."""
    return f"dp{world}ep{world}"


def distributed_kinds(world: int) -> dict[str, dict[str, Any]]:
    """The ``world``-GPU engines of the decode and equality parts, by the name their rows carry:
    DP + EP (``dp8ep8``) and DP alone (``dp8``), with their ``LLM`` options."""
    return {
        dp_ep(world): {"data_parallel_size": world, "enable_expert_parallel": True},
        f"dp{world}": {"data_parallel_size": world},
    }


class EngineSpec:
    """One engine configuration: a name (``1gpu``, ``dp2ep2``, ``cp2`` ... plus its part) and the
    ``LLM`` options beyond the common ones."""

    def __init__(self, name: str, world: int, **options: Any):
        self.name, self.world, self.options = name, world, options

    @property
    def distributed(self) -> bool:
        return self.world > 1


def weight_format(args: argparse.Namespace) -> str:
    """The rows' ``fmt``: ``fp8_fp4`` (kept quantised), else the dtype the weights are loaded in
    (``bf16`` in the GPU run)."""
    if args.keep_quantized:
        return "fp8_fp4"
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.dtype]


def lp_value(lp: Any) -> float:
    """A logprob entry's value (a float, or an object with ``.logprob``)."""
    return float(getattr(lp, "logprob", lp))


def compare_outputs(got: list[tuple[list[int], list]], want: list[tuple[list[int], list]]) -> dict[str, Any]:
    """Greedy outputs ``(token ids, logprobs)`` per prompt against the reference's: prompts whose
    tokens are all equal, tokens equal before the first divergence, whether every logprob up to
    and including the first diverging step (same context on both sides) is bitwise equal with
    the same top ids, and the largest absolute logprob difference there."""
    prompts = len(want)
    equal = tokens_equal = tokens_total = 0
    bitwise, max_diff = True, 0.0
    first_div: list[int | None] = []
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        tokens_total += len(wt)
        k = next((i for i, (x, y) in enumerate(zip(gt, wt, strict=False)) if x != y), None)
        if k is None and len(gt) != len(wt):
            k = min(len(gt), len(wt))
        first_div.append(k)
        equal += k is None
        tokens_equal += len(wt) if k is None else k
        upto = len(wt) if k is None else k + 1
        for step in range(min(upto, len(gl or []), len(wl or []))):
            a, b = gl[step], wl[step]
            if set(a) != set(b):
                bitwise = False
            for tok in set(a) & set(b):
                x, y = lp_value(a[tok]), lp_value(b[tok])
                if x != y:
                    bitwise = False
                    max_diff = max(max_diff, abs(x - y))
        if (gl is None) != (wl is None):
            bitwise = False
    return {
        "prompts": prompts,
        "prompts_token_equal": equal,
        "tokens_equal_before_divergence": tokens_equal,
        "tokens_total": tokens_total,
        "logprobs_bitwise": bitwise,
        "max_abs_logprob_diff": max_diff,
        "first_divergence": first_div,
    }


# ---- the benchmark ----------------------------------------------------------------------------------
class Bench:
    """The measurements, one engine alive at a time; rows go to ``report``."""

    def __init__(
        self, args: argparse.Namespace, model_dir: Path, vocab: int, report: e2e.Report, bi_ok: bool
    ):
        self.args, self.model_dir, self.vocab, self.report = args, model_dir, vocab, report
        self.device = torch.device(args.device)
        self.bi_ok = bi_ok  # the equality part runs with batch_invariant=True
        self.world = args.world  # ranks of every distributed engine
        self.kinds = distributed_kinds(args.world)
        self.llm: LLM | None = None
        self.spec: EngineSpec | None = None
        self.failed_engines: dict[str, str] = {}
        self.eq_ref: dict[str, list] = {}  # reference outputs of the shared prompt set, by mode
        self.cp_tokens: dict[str, list[list[int]]] = {}  # greedy tokens of the CP prompts, by engine

    # -- plumbing
    def prompts(self, tag: str, count: int, length: int) -> list[list[int]]:
        return e2e.make_prompts(tag, count, length, self.vocab, self.args.seed)

    def skewed_prompts(self, tag: str, count: int, length: int) -> list[list[int]]:
        """The eplb part's skewed mix: ``EPLB_HOT_PERCENT`` % of the ids drawn from
        ``--eplb-hot-ids`` fixed ids, the rest uniform (V4's hash-routed layers send a token by
        its id, so these few ids load few experts; the learned routers see repetitive input)."""
        hot = self.prompts("eplb-hot", 1, self.args.eplb_hot_ids)[0]
        picks = self.prompts(f"{tag}-pick", count, length)
        return [
            [hot[x % len(hot)] if pick % 100 < EPLB_HOT_PERCENT else x for x, pick in zip(p, q, strict=True)]
            for p, q in zip(self.prompts(tag, count, length), picks, strict=True)
        ]

    def kind_world(self, kind: str) -> int:
        """Ranks of the engine ``kind`` (``1gpu``: 1, the distributed kinds: ``--world``)."""
        return 1 if kind == "1gpu" else self.world

    def eq_prompt_set(self) -> list[list[int]]:
        """The shared prompt set: ``eq_prompts`` prompts, lengths spread over 16 .. ``eq_max_len``."""
        a = self.args
        n, hi = a.eq_prompts, a.eq_max_len
        lo = min(16, hi)
        lengths = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
        pool = self.prompts("equality", n, hi)
        return [p[:length] for p, length in zip(pool, lengths, strict=True)]

    def elapsed(self) -> float:
        return time.perf_counter() - T_START

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def job(self, name: str, spec: EngineSpec, fn: Callable[[LLM], None]) -> None:
        """Run ``fn`` on the engine of ``spec`` (built when not the live one), recording an error
        or a skip (time budget, an engine that failed to build) as the row ``name``."""
        a = self.args
        if spec.name in self.failed_engines:
            why = f"skipped: engine {spec.name} failed to build ({self.failed_engines[spec.name][:300]})"
            log(f"{name}: {why}")
            self.report.error(name, why, "skipped")
            return
        if a.time_budget:
            need = a.build_reserve if self.spec is None or self.spec.name != spec.name else 0.0
            if self.elapsed() + need > a.time_budget:
                why = f"skipped: time budget of {a.time_budget:.0f} s (elapsed {self.elapsed():.0f} s"
                why += f", {need:.0f} s reserved to build an engine)" if need else ")"
                log(f"{name}: {why}")
                self.report.error(name, why, "skipped")
                return
        log(f"{name} ...")
        try:
            llm = self.engine(spec)
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            log(f"engine {spec.name} FAILED to build: {text}")
            traceback.print_exc()
            self.failed_engines[spec.name] = text
            self.report.error(name, f"engine {spec.name} failed to build: {text}")
            self.free_engine()
            return
        try:
            fn(llm)
        except Exception as e:  # recorded, not raised: the other measurements still run
            log(f"{name} FAILED: {type(e).__name__}: {e}")
            traceback.print_exc()
            self.report.error(name, e)
            self.free_engine()  # a distributed run that failed is ended: build afresh next time

    def engine(self, spec: EngineSpec) -> LLM:
        """The engine of ``spec``, built after shutting down and freeing any other one."""
        if self.llm is not None and self.spec is not None and self.spec.name == spec.name:
            return self.llm
        self.free_engine()
        a = self.args
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if a.log_dir is not None:  # the workers' rank<k>.log files of this engine
            os.environ[LOG_DIR_ENV] = str(a.log_dir / spec.name)
        options: dict[str, Any] = {
            "model": str(self.model_dir),
            "backend": a.backend,
            "device": a.device,
            "dtype": a.dtype,
            "seed": a.seed,
            "keep_quantized": a.keep_quantized,
            "kv_cache_dtype": a.kv_cache_dtype,
            "distributed_timeout_s": a.dist_timeout,
            **spec.options,
        }
        log(f"  building engine {spec.name} (world {spec.world}): {spec.options}")
        t0 = time.perf_counter()
        llm = LLM(**options)
        self.sync()
        self.llm, self.spec = llm, spec
        info: dict[str, Any] = {
            "engine": spec.name,
            "world": spec.world,
            "options": spec.options,
            "backend": getattr(getattr(llm.engine, "backend", None), "name", None),
            "build_s": time.perf_counter() - t0,
            "kv_cache_capacity_tokens": llm.kv_cache_capacity_tokens,
            "keep_quantized": llm.config.keep_quantized,
            "rank0_weight_gib": llm.engine.runner.model.weight_bytes() / 2**30,
            "rank0_device": str(llm.engine.runner.device),
            "graph_buckets": sorted(getattr(llm.engine.runner, "graphs", {}) or []),
            "cp_min_tokens": getattr(llm.engine.runner.model, "cp_min_tokens", None),
        }
        if spec.distributed:
            import torch.distributed as dist

            info["dist_backend"] = dist.get_backend() if dist.is_initialized() else None
            info["log_dir"] = getattr(llm.client, "log_dir", None)
            want = "nccl" if self.device.type == "cuda" else "gloo"
            if info["dist_backend"] != want:
                raise RuntimeError(
                    f"the run's default process group is {info['dist_backend']!r}, not {want!r}"
                )
        if self.device.type == "cuda":
            info["rank0_gpu_mem_allocated_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
        log(f"  engine {info}")
        self.report.data["engines"].append(info)
        self.report.save()
        return llm

    def free_engine(self) -> None:
        """Shut the live engine down (its worker ranks exit) and free its memory."""
        if self.llm is not None:
            if self.device.type == "cuda" and self.report.data["engines"]:
                peak = torch.cuda.max_memory_allocated(self.device) / 2**30
                self.report.data["engines"][-1]["rank0_gpu_peak_allocated_gib"] = peak
                self.report.save()
            try:
                self.llm.shutdown()
            except Exception as e:
                log(f"  shutdown of {self.spec.name if self.spec else '?'}: {type(e).__name__}: {e}")
        self.llm = self.spec = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def warmup(self, llm: LLM, tag: str, count: int, length: int, max_tokens: int) -> None:
        if not self.args.no_warmup:
            e2e.run_llm(llm, self.prompts(f"warmup-{tag}", count, length), max_tokens)

    def fmt(self) -> str:
        return weight_format(self.args)

    # -- engine specs
    def decode_spec(self, kind: str) -> EngineSpec:
        a = self.args
        options = {
            "max_num_seqs": max(a.batch_sizes),
            "max_num_batched_tokens": a.chunk,
            "max_model_len": max(a.prompt_len + a.new_tokens, a.eq_max_len + a.eq_new_tokens) + 16,
            "enforce_eager": a.enforce_eager,
        }
        extra: dict[str, Any] = self.kinds.get(kind, {})
        return EngineSpec(f"decode.{kind}", self.kind_world(kind), **extra, **options)

    def cp_spec(self, world: int) -> EngineSpec:
        a = self.args
        options = {
            "max_num_seqs": 2,
            "max_num_batched_tokens": a.cp_chunk,
            "max_model_len": a.cp_prompt_len + a.cp_new_tokens + 128,
            "enforce_eager": a.enforce_eager,
        }
        if world == 1:
            return EngineSpec("cp.1gpu", 1, **options)
        return EngineSpec(f"cp.cp{world}", world, context_parallel_size=world, **options)

    def eq_spec(self, kind: str, bi: bool) -> EngineSpec:
        a = self.args
        options = {
            "max_num_seqs": a.eq_prompts,
            "max_num_batched_tokens": a.chunk,
            "max_model_len": a.eq_max_len + a.eq_new_tokens + 16,
            "enforce_eager": True,  # the exactness of the distribution alone (the CPU tests are eager)
            "batch_invariant": bi,
        }
        mode = "bi" if bi else "eager"
        extra: dict[str, Any] = self.kinds.get(kind, {})
        return EngineSpec(f"equality.{kind}.{mode}", self.kind_world(kind), **extra, **options)

    def eplb_spec(self) -> EngineSpec:
        """DP + EP over ``--world`` ranks with EPLB: window and interval ``eplb_interval`` steps
        (:meth:`eplb_interval`), ``--eplb-redundant`` replicas."""
        a = self.args
        interval = self.eplb_interval()
        options = {
            "max_num_seqs": a.eplb_batch,
            "max_num_batched_tokens": a.chunk,
            "max_model_len": max(a.prompt_len, EPLB_FILLER_LEN) + a.new_tokens + 16,
            "enforce_eager": a.enforce_eager,
            "eplb": {
                "window_steps": interval,
                "rebalance_interval": interval,
                "num_redundant_experts": a.eplb_redundant,
            },
        }
        return EngineSpec(f"eplb.{dp_ep(self.world)}", self.world, **self.kinds[dp_ep(self.world)], **options)

    def eplb_interval(self) -> int:
        """``--eplb-interval``, else twice an upper bound of the steps of one round of the eplb
        part (``B`` requests a rank: prefill of prompt + new tokens in chunks, then the decode
        steps, plus slack), so the warm-up and the "before" round end before the rebalancing."""
        a = self.args
        if a.eplb_interval:
            return a.eplb_interval
        per_rank_tokens = a.eplb_batch * (a.prompt_len + a.new_tokens)
        return 2 * (-(-per_rank_tokens // a.chunk) + a.new_tokens + 4) + 2

    # -- parts
    def run(self) -> None:
        """The parts of ``--parts``, in the order given."""
        for part in self.args.parts:
            {
                "decode": self.run_decode,
                "cp": self.run_cp,
                "equality": self.run_equality,
                "eplb": self.run_eplb,
            }[part]()
            self.free_engine()

    def run_decode(self) -> None:
        a = self.args
        for kind in ("1gpu", *a.decode_modes):
            spec = self.decode_spec(kind)
            for b in a.batch_sizes:
                self.job(f"decode.{kind}.B{b}", spec, lambda llm, b=b, k=kind: self.decode(llm, b, k))
            name = "equality.1gpu.fast.reference" if kind == "1gpu" else f"equality.{kind}.fast"
            self.job(name, spec, lambda llm, k=kind: self.equality(llm, "fast", None if k == "1gpu" else k))

    def run_cp(self) -> None:
        a = self.args
        for world in (1, self.world):
            spec = self.cp_spec(world)
            name = f"prefill.{spec.name.split('.')[1]}.{a.cp_prompt_len}"
            self.job(name, spec, lambda llm, w=world: self.cp_prefill(llm, w))

    def run_equality(self) -> None:
        a = self.args
        bi = self.bi_ok
        mode = "bi" if bi else "eager"  # "eager": the default (not batch-invariant) mode, no graphs
        if not bi:
            log(
                "equality: the default mode (tokens and logprob differences, no bitwise check: rows "
                f"'.eager'); batch invariance declared by {a.backend!r} on {self.device.type}: "
                f"{self.report.data['runs'][-1].get('batch_invariance_declared')}"
            )
        ref = f"{mode}-eq"  # kept apart from the decode engines' reference (other engine shape)
        spec = self.eq_spec("1gpu", bi)
        self.job(f"equality.1gpu.{mode}.reference", spec, lambda llm: self.equality(llm, ref, None))
        for kind in self.kinds:
            spec = self.eq_spec(kind, bi)
            self.job(f"equality.{kind}.{mode}", spec, lambda llm, k=kind: self.equality(llm, ref, k))

    def run_eplb(self) -> None:
        self.job("eplb", self.eplb_spec(), self.eplb)

    def decode(self, llm: LLM, batch: int, mode: str) -> None:
        """B requests per GPU (``world * B`` in all); tok/s per GPU from rank 0's steps."""
        a = self.args
        world = self.kind_world(mode)
        self.warmup(llm, f"decode-w{world}-B{batch}", batch * world, min(a.prompt_len, 128), 4)
        # one GPU: the first B of the prompts
        row = self.measure_decode(llm, self.prompts(f"decode-B{batch}", batch * world, a.prompt_len), batch)
        name = f"decode.{mode}.B{batch}"
        row = {"name": name, **row, "mode": mode}
        if world > 1:
            ref = self.row(f"decode.1gpu.B{batch}")
            if ref and ref.get("value"):
                row["per_gpu_vs_1gpu"] = row["value"] / ref["value"]
            row["per_rank_generated_tokens"] = [m.get("num_generated_tokens") for m in self.per_rank(llm)]
        self.report.add(row)
        log(
            f"  {name}: {row['value']:.1f} tok/s per GPU ({row['decode_method']}), "
            f"{row['aggregate_tok_s']:.1f} in all"
        )

    def measure_decode(self, llm: LLM, prompts: list[list[int]], batch: int) -> dict[str, Any]:
        """Generate ``prompts`` (``batch`` on each of the engine's ranks) greedily, ``--new-tokens``
        each; the row's figures: decode tok/s per GPU from rank 0's steps in which its whole
        batch decodes (the ranks step in lockstep), prefill and end-to-end figures per GPU."""
        a = self.args
        world = len(prompts) // batch
        outs, steps, wall = e2e.run_llm(llm, prompts, a.new_tokens)
        own = outs[::world]  # rank 0's requests: replicas are assigned alternately (fewest outstanding)
        d = e2e.decode_stats(own, steps, batch, a.new_tokens)
        p = e2e.prefill_stats(outs)
        row: dict[str, Any] = {"value": d["decode_tok_s"], "unit": "tok/s/GPU"}
        row.update(
            fmt=self.fmt(),
            world=world,
            batch_per_gpu=batch,
            requests=len(prompts),
            aggregate_tok_s=d["decode_tok_s"] * world,
            wall_s=wall,
            end_to_end_tok_s_per_gpu=len(prompts) * a.new_tokens / wall / world,
            rank0_max_seqs_in_a_step=max((s.num_seqs for _, s in steps), default=0),
            ttft_mean_s=p["ttft_mean_s"],
            prefill_tok_s_per_gpu=p["prefill_tok_s"] / world,
            graphs=bool(getattr(llm.engine.runner, "graphs", None)),
            ep_graph_stats=dict(getattr(llm.engine.runner, "ep_graph_stats", None) or {}),
            **d,
        )
        if row["rank0_max_seqs_in_a_step"] != batch:
            row["note"] = (
                f"rank 0 held up to {row['rank0_max_seqs_in_a_step']} requests in a step, expected {batch}"
            )
        return row

    def row(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.report.data["results"] if r["name"] == name), None)

    def equality(self, llm: LLM, ref_key: str, kind: str | None) -> None:
        """Generate the shared prompt set; store it as the reference (``kind`` None) or compare
        it with the stored reference and add the row ``equality.<kind>.<mode>``."""
        a = self.args
        params = SamplingParams(
            temperature=0, max_tokens=a.eq_new_tokens, logprobs=EQ_LOGPROBS, ignore_eos=True
        )
        batch = [{"prompt_token_ids": p} for p in self.eq_prompt_set()]
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        for o in outs:
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
        got = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        if kind is None:
            self.eq_ref[ref_key] = got
            log(f"  reference outputs of {len(got)} prompts stored ({wall:.2f} s)")
            return
        mode = "fast" if ref_key == "fast" else ref_key.split("-")[0]
        name = f"equality.{kind}.{mode}"
        want = self.eq_ref.get(ref_key)
        if want is None:
            raise RuntimeError(f"no one-GPU reference for {name}: its run failed or was skipped")
        cmp = compare_outputs(got, want)
        row: dict[str, Any] = {"name": name, "value": cmp["prompts_token_equal"], "unit": "prompts"}
        row.update(kind=kind, mode=mode, batch_invariant=mode == "bi", wall_s=wall, **cmp)
        self.report.add(row)
        log(
            f"  {name}: {cmp['prompts_token_equal']}/{cmp['prompts']} prompts token-equal, "
            f"logprobs bitwise {cmp['logprobs_bitwise']}, max |diff| {cmp['max_abs_logprob_diff']:.3g}"
        )

    def cp_prefill(self, llm: LLM, world: int) -> None:
        """One long prompt at a time: TTFT and prompt tok/s, best of ``cp_repeats``."""
        a = self.args
        model = llm.engine.runner.model
        with counting_context_parallel_forwards(model) as split:
            self.warmup(llm, "cp", 1, a.cp_prompt_len, a.cp_new_tokens)
            split[0] = 0
            ttfts, tokens = [], []
            for r in range(a.cp_repeats):
                outs, _, _ = e2e.run_llm(llm, self.prompts(f"cp-{r}", 1, a.cp_prompt_len), a.cp_new_tokens)
                m = outs[0].metrics
                ttfts.append(m.first_token_time - m.arrival_time)
                tokens.append(list(outs[0].outputs[0].token_ids))
        mode = "1gpu" if world == 1 else f"cp{world}"
        name = f"prefill.{mode}.{a.cp_prompt_len}"
        best = min(ttfts)
        tok_s = a.cp_prompt_len / best
        row: dict[str, Any] = {"name": name, "value": tok_s, "unit": "tok/s"}
        row.update(
            mode=mode,
            fmt=self.fmt(),
            world=world,
            prompt_tokens=a.cp_prompt_len,
            max_num_batched_tokens=a.cp_chunk,
            cp_min_tokens=getattr(model, "cp_min_tokens", None),
            ttft_s=best,
            ttft_all_s=ttfts,
            tok_s_per_gpu=tok_s / world,
            rank0_forwards_with_cp_plan=split[0],
        )
        self.cp_tokens[mode] = tokens
        if world > 1:
            ref = self.row(f"prefill.1gpu.{a.cp_prompt_len}")
            if ref and ref.get("value"):
                row["speedup_vs_1gpu"] = tok_s / ref["value"]
                row["ttft_vs_1gpu"] = best / ref["ttft_s"]
            want = self.cp_tokens.get("1gpu")
            if want is not None:
                same = sum(g == w for g, w in zip(tokens, want, strict=True))
                row["greedy_tokens_equal_to_1gpu"] = f"{same}/{len(want)}"
        if world > 1 and split[0] == 0:  # kept with its figures, but the run fails
            row["error"] = (
                f"context parallelism never split a step (rank 0's cp_min_tokens = "
                f"{getattr(model, 'cp_min_tokens', '?')}, chunk {a.cp_chunk}): this row measures no CP"
            )
            log(f"  {name}: {row['error']}")
        self.report.add(row)
        log(f"  {name}: TTFT {best * 1e3:.1f} ms, {tok_s:.0f} tok/s ({tok_s / world:.0f} per GPU)")

    # -- the eplb part
    def eplb(self, llm: LLM) -> None:
        """A skewed round before the rebalancing at step ``R`` (:meth:`eplb_interval`) and one
        after it, filler requests up to ``R`` and ``2R``; rows ``eplb.before`` / ``eplb.after``:
        decode tok/s per GPU and the max/mean GPU expert load of the steps ``1..R`` under the
        first placement and of ``R+1..2R`` under the rebalanced one (the checks at ``R`` and
        ``2R``, both from ``get_metrics()["eplb"]``)."""
        a = self.args
        interval, n = self.eplb_interval(), a.eplb_batch * self.world
        if not a.no_warmup:  # skewed as well: its steps are in the first window
            e2e.run_llm(llm, self.skewed_prompts("eplb-warmup", n, a.prompt_len), a.new_tokens)
        rows: dict[str, dict[str, Any]] = {}
        for phase in ("before", "after"):
            first = self.eplb_state(llm)["steps"]
            row = self.measure_decode(
                llm, self.skewed_prompts(f"eplb-{phase}", n, a.prompt_len), a.eplb_batch
            )
            last = self.eplb_state(llm)["steps"]
            due = interval if phase == "before" else 2 * interval
            if last >= due:
                raise RuntimeError(
                    f"the '{phase}' round ran to engine step {last}, past the rebalancing check at step "
                    f"{due}: give a larger --eplb-interval (now {interval})"
                )
            state = self.eplb_fill(llm, due)
            check = next((c for c in state["checks"] if c["step"] == due), None)
            if check is None:
                raise RuntimeError(f"no rebalancing check at engine step {due}: {state}")
            rows[phase] = {
                "name": f"eplb.{phase}",
                **row,
                "mode": dp_ep(self.world),
                "engine_steps": [first + 1, last],
                "max_over_mean_load": check["imbalance_before"],
                "load_steps": [due - interval + 1, due],
                "check": check,
                "rebalances": state["rebalances"],
                "hot_ids": a.eplb_hot_ids,
                "hot_percent": EPLB_HOT_PERCENT,
                "eplb": self.spec.options["eplb"] if self.spec is not None else None,
            }
            if phase == "before":
                received = [m.get("eplb", {}).get("last_experts_received") for m in self.per_rank(llm)]
                rows[phase].update(
                    placement="initial",
                    rebalanced_at_check=check["rebalanced"],
                    predicted_max_over_mean_load_after=check["imbalance_after"],
                    experts_received_per_rank=received,
                )
        before, after = rows["before"], rows["after"]
        after["placement"] = "rebalanced" if before["rebalanced_at_check"] else "initial (not rebalanced)"
        after["predicted_max_over_mean_load"] = before["predicted_max_over_mean_load_after"]
        after["per_gpu_vs_before"] = after["value"] / before["value"] if before["value"] else None
        after["load_vs_before"] = after["max_over_mean_load"] / before["max_over_mean_load"]
        if not before["rebalanced_at_check"]:
            after["note"] = "the policy found no better placement at the first check: no rebalancing"
        results = self.report.data["results"]
        results[:] = [r for r in results if r["name"] != "eplb"]  # an earlier run's failure (--append)
        for row in (before, after):
            self.report.add(row)
            log(
                f"  {row['name']}: {row['value']:.1f} tok/s per GPU ({row['decode_method']}), max/mean "
                f"expert load {row['max_over_mean_load']:.3f} over steps {row['load_steps']} "
                f"({row['placement']})"
            )

    def eplb_state(self, llm: LLM) -> dict[str, Any]:
        """The engine's EPLB figures, ``get_metrics()["eplb"]`` (fresh after a ``generate``)."""
        state = llm.get_metrics().get("eplb")
        if state is None:
            raise RuntimeError("the engine reports no EPLB figures (get_metrics()['eplb'] is missing)")
        return state

    def per_rank(self, llm: LLM) -> list[dict[str, Any]]:
        """Every rank's own ``get_metrics()`` dict."""
        return llm.get_metrics().get("per_rank", [])

    def eplb_fill(self, llm: LLM, step: int) -> dict[str, Any]:
        """Generate filler requests (one a rank, ``EPLB_FILLER_LEN`` skewed ids, up to
        ``--new-tokens`` each) until the engine has made ``step`` steps; its EPLB figures then."""
        a = self.args
        state = self.eplb_state(llm)
        while state["steps"] < step:
            steps = state["steps"]
            tokens = min(step - steps, a.new_tokens)
            prompts = self.skewed_prompts(f"eplb-fill-{steps}", self.world, EPLB_FILLER_LEN)
            e2e.run_llm(llm, prompts, tokens)
            state = self.eplb_state(llm)
            if state["steps"] <= steps:
                raise RuntimeError(f"the engine's EPLB step count stays at {steps} ({state})")
        return state


# ---- output -----------------------------------------------------------------------------------------
def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'name':34s} {'value':>12s} {'unit':10s} notes")
    for r in rows:
        if r.get("value") is None:
            why = r.get("error") or r.get("skipped") or "no value"
            print(f"{r['name']:34s} {'-':>12s} {'':10s} {why[:100]}")
            continue
        notes = []
        if "per_gpu_vs_1gpu" in r:
            notes.append(f"x{r['per_gpu_vs_1gpu']:.2f} of 1 GPU per GPU")
        if "decode_step_ms_full_batch" in r:
            notes.append(f"step {r['decode_step_ms_full_batch']:.2f} ms")
        if "prompts" in r:
            notes.append(
                f"of {r['prompts']} token-equal, logprobs bitwise {r['logprobs_bitwise']}, "
                f"max |diff| {r['max_abs_logprob_diff']:.3g}"
            )
        if "ttft_s" in r:
            notes.append(f"TTFT {r['ttft_s'] * 1e3:.1f} ms, {r['tok_s_per_gpu']:.0f} tok/s per GPU")
        if "speedup_vs_1gpu" in r:
            notes.append(f"x{r['speedup_vs_1gpu']:.2f} vs 1 GPU")
        if "greedy_tokens_equal_to_1gpu" in r:
            notes.append(f"tokens equal {r['greedy_tokens_equal_to_1gpu']}")
        if "max_over_mean_load" in r:
            notes.append(f"max/mean expert load {r['max_over_mean_load']:.3f} ({r['placement']})")
        if r.get("per_gpu_vs_before") is not None:
            notes.append(f"x{r['per_gpu_vs_before']:.2f} of before")
        value = f"{r['value']:12.1f}" if isinstance(r["value"], float) else f"{r['value']:>12}"
        print(f"{r['name']:34s} {value} {r['unit']:10s} {'; '.join(notes)}")


# ---- main -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, reference backend, built-in tiny model")
    ap.add_argument(
        "--world",
        type=int,
        default=2,
        help="ranks (GPUs) of every distributed engine: DP N + EP N, DP N, CP N",
    )
    ap.add_argument(
        "--parts",
        type=choice_list(PARTS),
        help=f"comma-separated subset of {','.join(PARTS)} (default decode,cp,equality; --smoke: all)",
    )
    ap.add_argument(
        "--decode-modes",
        help="comma-separated N-GPU engines of the decode part, each against one GPU: dpNepN "
        "(DP N + EP N, the default), dpN (N full replicas, no expert parallelism: the EP exchange's "
        "cost apart); N = --world, e.g. dp8ep8,dp8",
    )
    ap.add_argument("--backend", help="DeepInfer backend (default cuda_sm100; --smoke: reference)")
    ap.add_argument("--device", help="device type of every rank (default cuda; --smoke: cpu)")
    ap.add_argument("--dtype", choices=sorted(e2e.DTYPES), help="default bfloat16 (--smoke: float32)")
    ap.add_argument(
        "--keep-quantized",
        choices=("on", "off"),
        default="off",
        help="off: weights dequantised to bf16 at load (rows 'bf16'); on: FP8/FP4 kept (rows 'fp8_fp4')",
    )
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument(
        "--enforce-eager", action="store_true", help="no decode graphs on the one-GPU engines either"
    )
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the e2e model")
    ap.add_argument(
        "--experts", type=int, default=64, help="routed experts of the e2e model (a multiple of --world)"
    )
    ap.add_argument(
        "--tiny-widths",
        action="store_true",
        help="the e2e model's structure at test widths (gpu_e2e's smoke model): a CPU check of the "
        "checkpoint path without --smoke",
    )
    ap.add_argument("--batch-sizes", type=positive_ints, help="decode batch sizes per GPU (default 64,256)")
    ap.add_argument("--prompt-len", type=int, help="decode prompts (default 512)")
    ap.add_argument("--new-tokens", type=int, help="tokens per decode request (default 32)")
    ap.add_argument(
        "--chunk", type=int, help="max_num_batched_tokens of the decode / equality engines (8192)"
    )
    ap.add_argument("--eq-prompts", type=int, help="prompts of the shared equality set (default 32)")
    ap.add_argument("--eq-max-len", type=int, help="longest equality prompt (default 480)")
    ap.add_argument("--eq-new-tokens", type=int, help="tokens per equality prompt (default 16)")
    ap.add_argument("--cp-prompt-len", type=int, help="the CP prefill prompt (default 32768)")
    ap.add_argument("--cp-chunk", type=int, help="max_num_batched_tokens of the CP engines (default 8192)")
    ap.add_argument("--cp-new-tokens", type=int, help="tokens generated after the CP prefill (default 4)")
    ap.add_argument("--cp-repeats", type=int, help="measured CP prompts, best TTFT kept (default 2)")
    ap.add_argument(
        "--cp-min-tokens",
        type=int,
        help=f"sets {CP_MIN_TOKENS_ENV} (default: the engine's, 1024; --smoke 64)",
    )
    ap.add_argument(
        "--eplb-batch", type=int, help="eplb part: requests per GPU (default the first of --batch-sizes)"
    )
    ap.add_argument(
        "--eplb-redundant",
        type=int,
        help="eplb part: num_redundant_experts (default --world; experts + these divide by --world)",
    )
    ap.add_argument(
        "--eplb-interval",
        type=int,
        help="eplb part: window_steps = rebalance_interval (default: twice a bound of one round's steps)",
    )
    ap.add_argument(
        "--eplb-hot-ids",
        type=int,
        help=f"eplb part: {EPLB_HOT_PERCENT} %% of the prompt ids come from this many ids "
        "(default 4; --smoke 2)",
    )
    ap.add_argument(
        "--model-dir", type=Path, help="e2e checkpoint folder: reused when it holds it, else written"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-warmup", action="store_true", help="skip the warm-up generate before each measurement"
    )
    ap.add_argument("--dist-timeout", type=float, default=180.0, help="distributed_timeout_s of the runs")
    ap.add_argument(
        "--equality-mode",
        choices=("auto", "bi", "eager"),
        default="auto",
        help="the equality part: batch_invariant=True (bi), the default mode (eager), or bi where the "
        "backend declares batch invariance on the device (auto)",
    )
    ap.add_argument(
        "--log-dir", type=Path, help=f"worker logs: <dir>/<engine>/rank<k>.log (sets {LOG_DIR_ENV})"
    )
    ap.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument(
        "--append", action="store_true", help="merge into an existing --out (rows replaced by name)"
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds from the start; later measurements are skipped (0 = none)",
    )
    ap.add_argument(
        "--build-reserve",
        type=float,
        default=75.0,
        help="seconds that must remain of the budget to build an engine",
    )
    args = ap.parse_args(argv)
    mode = 1 if args.smoke else 0
    for key, values in MODE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, values[mode])
    args.keep_quantized = args.keep_quantized == "on"
    if args.world < 2:
        ap.error("--world must be >= 2 (the distributed engines' ranks; one GPU is the reference)")
    kinds = tuple(distributed_kinds(args.world))
    try:
        args.decode_modes = choice_list(kinds)(args.decode_modes or dp_ep(args.world))
    except argparse.ArgumentTypeError as e:
        ap.error(f"--decode-modes: {e}")
    if args.eplb_batch is None:
        args.eplb_batch = args.batch_sizes[0]
    if args.eplb_redundant is None:
        args.eplb_redundant = args.world
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "gpu_distributed_smoke.json" if args.smoke else DEFAULT_OUT
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode needs a token after the first)")
    for key in (
        "prompt_len",
        "chunk",
        "eq_prompts",
        "eq_max_len",
        "eq_new_tokens",
        "cp_prompt_len",
        "cp_chunk",
    ):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.cp_repeats < 1 or args.cp_new_tokens < 1:
        ap.error("--cp-repeats and --cp-new-tokens must be >= 1")
    if (
        args.eplb_batch < 1
        or args.eplb_redundant < 0
        or args.eplb_hot_ids < 1
        or (args.eplb_interval or 1) < 1
    ):
        ap.error("--eplb-batch, --eplb-hot-ids and --eplb-interval must be >= 1, --eplb-redundant >= 0")
    return args


def check_experts(args: argparse.Namespace) -> None:
    """``--experts`` (the model's routed experts) must divide over the ``--world`` EP ranks, and
    with the eplb part the experts and ``--eplb-redundant`` replicas too; a one-line
    :class:`SystemExit` otherwise."""
    if args.experts % args.world:
        raise die(
            f"{args.experts} routed experts do not divide over --world {args.world} ranks "
            f"(expert parallelism): give --experts a multiple of {args.world}"
        )
    if "eplb" in args.parts and (args.experts + args.eplb_redundant) % args.world:
        raise die(
            f"eplb: {args.experts} experts + --eplb-redundant {args.eplb_redundant} do not divide over "
            f"--world {args.world} ranks"
        )


def preflight(args: argparse.Namespace) -> bool:
    """Check what the run needs before anything is built; returns whether the backend declares
    batch invariance on the device.  Raises a one-line :class:`SystemExit` otherwise."""
    import torch.distributed as dist

    from deepinfer_core.plugins import get_plugins

    device = torch.device(args.device)
    if not dist.is_available():
        raise die("this torch has no torch.distributed")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise die("--device cuda but torch sees no CUDA device (use --smoke for the CPU)")
        n, w = torch.cuda.device_count(), args.world
        if n < w:
            raise die(
                f"needs {w} GPUs (--world {w}: data_parallel_size={w}, context_parallel_size={w}), "
                f"torch sees {n}"
            )
        if not dist.is_nccl_available():
            raise die("NCCL is not available in this torch build")
        missing = {k: os.environ.get(k) for k, v in NCCL_SAFE_ENV.items() if os.environ.get(k) != v}
        if missing:
            raise die(f"NVLink multicast must stay off, but {missing} (expected {NCCL_SAFE_ENV})")
    try:
        plugins = get_plugins()
        if args.backend == "auto":
            from deepinfer_core.backends.resolve import pick_auto

            spec = pick_auto(list(plugins.backends.values()))
        else:
            spec = plugins.get_backend(args.backend)
    except Exception as e:
        hint = (
            " (install the plugin: pip install --no-deps --no-build-isolation -e plugins/cuda_sm100)"
            if args.backend == "cuda_sm100"
            else ""
        )
        raise die(f"{e}{hint}") from None
    ok, reason = spec.availability()
    if not ok:
        raise die(f"backend {args.backend!r} is not available here: {reason}")
    if spec.device_type != device.type and args.backend != "reference":
        raise die(f"backend {args.backend!r} runs on {spec.device_type}, not on --device {args.device}")
    return device.type in spec.batch_invariant_devices


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bi_ok = preflight(args)
    device = torch.device(args.device)
    if args.smoke:  # tiny matmuls: one thread avoids OpenMP stalls on a small, shared CPU
        torch.set_num_threads(1)
    if args.cp_min_tokens is not None:  # read when a model is built; the workers inherit it
        os.environ[CP_MIN_TOKENS_ENV] = str(args.cp_min_tokens)
    if args.cp_chunk < cp_min_tokens():
        log(f"warning: --cp-chunk {args.cp_chunk} < cp_min_tokens {cp_min_tokens()}: CP will not split")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    temp_dir = None
    if args.smoke:
        from deepinfer_core.models.deepseek_v4.tiny import builtin_tiny_model_dir

        model_dir = builtin_tiny_model_dir()
        cfg_dict = json.loads((model_dir / "config.json").read_text())
        args.layers, args.experts = cfg_dict["num_hidden_layers"], cfg_dict["n_routed_experts"]
    else:
        cfg_dict = gm.flash_config(args.layers, args.experts, smoke=args.tiny_widths)
        model_dir = args.model_dir
    check_experts(args)  # before a temporary checkpoint folder exists
    if model_dir is None:
        temp_dir = model_dir = Path(tempfile.mkdtemp(prefix="gpu_distributed_model_"))
    header = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [sys.executable, *sys.argv] if argv is None else ["gpu_distributed.py", *argv],
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": e2e.machine_info(device),
        "model": {"config": cfg_dict, "dir": str(model_dir)},
        "nccl_env": {k: os.environ.get(k) for k in NCCL_SAFE_ENV},
        "batch_invariance_declared": bi_ok,
    }
    report = e2e.Report(args.out, header, args.append)
    report.data.pop("pareto", None)
    rc = 0
    bench: Bench | None = None
    try:
        if not args.smoke:
            if gm.model_ready(model_dir, cfg_dict, args.seed):
                log(f"reusing the checkpoint in {model_dir}")
            else:
                if (
                    model_dir.is_dir()
                    and any(model_dir.iterdir())
                    and not (model_dir / "config.json").is_file()
                ):
                    raise die(f"--model-dir {model_dir} holds other files; give an empty or new folder")
                log(f"writing the checkpoint to {model_dir} (weights drawn on {args.device})")
                info = gm.write_checkpoint(
                    model_dir, cfg_dict, args.seed, torch.device(args.device), e2e.DTYPES[args.dtype], log=log
                )
                info.pop("config")
                report.data["checkpoint"] = info
                log(f"checkpoint: {info['bytes_on_disk'] / 2**30:.2f} GiB in {info['write_s']:.1f} s")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        report.save()
        use_bi = {"auto": bi_ok, "bi": True, "eager": False}[args.equality_mode]
        bench = Bench(args, model_dir, cfg_dict["vocab_size"], report, use_bi)
        bench.run()
    finally:
        if bench is not None:
            bench.free_engine()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
    report.data["total_s"] = time.perf_counter() - T_START
    report.save()
    print_table(report.data["results"])
    print(f"\nwrote {args.out}")
    errors = [r["name"] for r in report.data["results"] if "error" in r]
    skipped = [r["name"] for r in report.data["results"] if "skipped" in r]
    if skipped:
        log(f"skipped: {skipped}")
    if errors:
        log(f"FAILED measurements: {errors}")
        rc = 1
    if rc == 0:
        log("all measurements done" + (" (some skipped)" if skipped else ""))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
