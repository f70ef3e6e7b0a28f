"""The engine options of the ``deepinfer`` commands: their flags and the ``LLM`` keyword
arguments they give."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by ``generate``, ``bench`` and ``run-batch`` (``None`` = not given)."""
    parser.add_argument(
        "--model",
        help="model directory or Hugging Face Hub repo id org/name[@revision] "
        "(default: the built-in tiny model, no download)",
    )
    parser.add_argument("--revision", help="Hub revision (branch, tag or commit) of a --model repo id")
    parser.add_argument("--download-dir", help="Hugging Face cache directory for Hub repos")
    parser.add_argument("--config", help="engine config file (.toml / .yaml)")
    parser.add_argument("--backend", help="'auto', 'reference' or a registered backend name")
    parser.add_argument("--dtype", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", help="torch device (default: the backend's)")
    parser.add_argument(
        "--strict-ops", action="store_true", default=None, help="no fallback to reference ops"
    )
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--num-cache-pages", type=int, help="pages in the paged KV cache")
    parser.add_argument(
        "--kv-cache-dtype",
        help="auto (the model dtype) or fp8 (packed FP8 window ring and compressed entries)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="enable_prefix_caching=False",
    )
    parser.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        default=None,
        help="async_scheduling=False",
    )
    parser.add_argument("--replay-tail", type=int, help="tokens replayed before a prefix-cache hit")
    parser.add_argument("--batch-invariant", action="store_true", default=None, help="batch_invariant=True")
    parser.add_argument(
        "--enforce-eager", action="store_true", default=None, help="enforce_eager=True: no device graphs"
    )
    parser.add_argument(
        "--mixed-graph-max-tokens",
        type=int,
        help="graphs of steps mixing prefills and decodes up to this many tokens (default 512; 0: off)",
    )
    parser.add_argument("--scheduler", help="request scheduler by registered name (default fcfs)")
    parser.add_argument(
        "--keep-quantized",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep_quantized: hold FP8/FP4 checkpoint weights quantised (default: if the backend "
        "declares quantised kernels)",
    )
    spec = parser.add_argument_group("speculative decoding (any of these turns it on)")
    spec.add_argument(
        "--speculative-method",
        help="verify-length policy by registered name: dspark (default), fixed, or a plugin's",
    )
    spec.add_argument("--drafter", help="drafter by registered name: ngram (default), mtp, ...")
    spec.add_argument(
        "--max-draft-tokens", type=int, help="most drafts verified per request and step (default 5)"
    )
    spec.add_argument(
        "--spec-acceptance", choices=("match", "rejection"), help="draft acceptance rule (default match)"
    )
    spec.add_argument(
        "--spec-varlen",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dspark: a verify length per request (default) or, --no-spec-varlen, one per step",
    )
    dist = parser.add_argument_group("distributed (docs/distributed.md)")
    dist.add_argument(
        "--data-parallel-size",
        type=int,
        help="attention data-parallel replicas (LLM starts one worker process per extra rank; "
        "or launch with torchrun -m deepinfer_core.launch)",
    )
    dist.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=None,
        help="shard the routed experts over every rank (enable_expert_parallel=True)",
    )
    dist.add_argument(
        "--context-parallel-size", type=int, help="ranks per replica that share its long prefills"
    )
    dist.add_argument(
        "--distributed-backend", help="auto (nccl on CUDA, hccl on Ascend, gloo on CPU), gloo, nccl or hccl"
    )
    dist.add_argument(
        "--distributed-timeout-s",
        type=float,
        help="seconds a collective may wait before the run ends with an error naming the rank",
    )
    dist.add_argument(
        "--eplb", metavar="JSON", help="expert-parallel load balancing: a JSON object of its fields"
    )
    parser.add_argument(
        "--device-timeout-s",
        type=float,
        help="seconds to wait for a step's results from the device before the run ends with an error "
        "(0 = no limit; default 600)",
    )
    parser.add_argument("--log-level", help="debug, info, warning or error")


SPEC_FLAGS = {
    "speculative_method": "method",
    "drafter": "drafter",
    "max_draft_tokens": "max_draft_tokens",
    "spec_acceptance": "acceptance",
    "spec_varlen": "varlen",
}


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine options given on the command line, as ``LLM`` keyword arguments."""
    names = (
        "model", "revision", "download_dir", "config", "backend", "dtype", "device", "strict_ops",
        "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_cache_pages", "kv_cache_dtype",
        "enable_prefix_caching", "async_scheduling", "replay_tail", "batch_invariant", "enforce_eager",
        "mixed_graph_max_tokens", "scheduler", "keep_quantized", "log_level", "data_parallel_size",
        "enable_expert_parallel", "context_parallel_size", "distributed_backend", "distributed_timeout_s",
        "eplb", "device_timeout_s",
    )  # fmt: skip
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    spec = {
        field: getattr(args, flag)
        for flag, field in SPEC_FLAGS.items()
        if getattr(args, flag, None) is not None
    }
    if spec:
        kwargs["speculative"] = spec
    return kwargs
