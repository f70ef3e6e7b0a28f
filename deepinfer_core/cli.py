"""The ``deepinfer`` command line.

Subcommands: ``generate`` (complete prompts), ``plugins`` (JSON report of the loaded plugins),
``make-tiny`` (write a tiny random DeepSeek-V4 checkpoint).  Every
:class:`~deepinfer_core.errors.DeepInferError` is printed as ``error: <message>`` on stderr with
exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from deepinfer_core.errors import DeepInferError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``deepinfer``."""
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4 inference engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete prompts", description="Complete one or more prompts.")
    gen.add_argument("--model", help="model directory (default: the built-in tiny model)")
    gen.add_argument("--config", help="engine config file (.toml / .yaml)")
    gen.add_argument("--backend", help="'auto', 'reference' or a registered backend name")
    gen.add_argument("--dtype", help="auto, float32, bfloat16 or float16")
    gen.add_argument("--device", help="torch device (default: the backend's)")
    gen.add_argument("--strict-ops", action="store_true", default=None, help="no fallback to reference ops")
    gen.add_argument("--max-num-seqs", type=int)
    gen.add_argument("--max-num-batched-tokens", type=int)
    gen.add_argument("--max-model-len", type=int)
    gen.add_argument("--engine-seed", type=int, dest="engine_seed", help="engine seed (EngineConfig.seed)")
    gen.add_argument("--log-level", help="debug, info, warning or error")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, help="sampling seed of every prompt (SamplingParams.seed)")
    gen.add_argument("--logprobs", type=int, help="top-K logprobs per generated token")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=_cmd_generate)

    plug = sub.add_parser("plugins", help="print the loaded plugins as JSON")
    plug.set_defaults(func=_cmd_plugins)

    tiny = sub.add_parser("make-tiny", help="write a tiny random DeepSeek-V4 checkpoint")
    tiny.add_argument("outdir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_make_tiny)
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(
        model=args.model,
        config=args.config,
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        strict_ops=args.strict_ops,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.engine_seed,
        log_level=args.log_level,
    )
    outputs = llm.generate(args.prompt, params)
    status = 0
    for out in outputs:
        comp = out.outputs[0]
        if out.error:
            status = 1
        if args.json:
            record = {
                "prompt": out.prompt,
                "prompt_token_ids": out.prompt_token_ids,
                "text": comp.text,
                "token_ids": comp.token_ids,
                "finish_reason": comp.finish_reason,
                "error": out.error,
            }
            if comp.logprobs is not None:
                record["logprobs"] = [{str(k): v for k, v in lp.items()} for lp in comp.logprobs]
            print(json.dumps(record))
        elif out.error:
            print(f"error: {out.error}", file=sys.stderr)
        else:
            print(comp.text)
    return status


def _cmd_plugins(args: argparse.Namespace) -> int:
    from deepinfer_core.plugins import cmd_plugins

    return cmd_plugins(args)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from deepinfer_core.models.deepseek_v4.tiny import make_tiny

    path = make_tiny(args.outdir, seed=args.seed)
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``deepinfer`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return int(args.func(args))
    except DeepInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
