"""The ``deepinfer`` command line.

Subcommands: ``generate`` (complete prompts), ``bench`` (offline throughput and latency),
``run-batch`` (an OpenAI Batch file, resumable: :mod:`deepinfer_core.batch`), ``serve`` (an
OpenAI-compatible HTTP server: :mod:`deepinfer_core.serve`),
``plugins`` (JSON report of the loaded plugins), ``make-tiny`` (write a tiny random
DeepSeek-V4 checkpoint; with ``--arch deepseek_v41`` a DeepSeek-V4.1 one with its DSpark
drafter's layers, ``--no-dspark`` without).  No command prints a traceback: a
:class:`~deepinfer_core.errors.DeepInferError` or an unusable path is printed as one
``error: <message>`` line on stderr with exit status 2; a failed prompt of ``generate`` is shown
in its place among the results and the status is 1; anything else is a bug, reported as one
``error: internal error ...`` line with status 3 (``DEEPINFER_TRACEBACK=1`` re-raises it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from deepinfer_core.benchmarking.scripts import names_help, run_script
from deepinfer_core.cli_engine_args import add_engine_args, engine_kwargs
from deepinfer_core.cli_generate import cmd_generate
from deepinfer_core.cli_status import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_REQUEST_FAILED,
    EXIT_USAGE,
    TRACEBACK_ENV,
)
from deepinfer_core.errors import ConfigError, DeepInferError, user_error_line


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as one ``error:`` line (no usage dump), status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``deepinfer``."""
    from deepinfer_core import __version__

    parser = _Parser(prog="deepinfer", description="DeepSeek-V4 inference engine")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete prompts", description="Complete one or more prompts.")
    add_engine_args(gen)
    gen.add_argument("--engine-seed", type=int, dest="engine_seed", help="engine seed (EngineConfig.seed)")
    gen.add_argument(
        "--verbose", action="store_true", help="print the KV cache capacity and a progress bar to stderr"
    )
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, help="sampling seed of every prompt (SamplingParams.seed)")
    gen.add_argument("--logprobs", type=int, help="top-K logprobs per generated token")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--min-tokens", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--choice", action="append", help="structured outputs: the text is one of these (repeatable)"
    )
    gen.add_argument("--regex", help="structured outputs: the text matches this regular expression")
    gen.add_argument(
        "--json-schema", metavar="FILE", help="structured outputs: the text is JSON matching this schema file"
    )
    gen.add_argument(
        "--grammar",
        metavar="FILE",
        help="structured outputs: the text matches this Lark or GBNF grammar file",
    )
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt (text, ids, logprobs, error)"
    )
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser(
        "bench",
        help="measure offline throughput and latency, or run a benchmark by name",
        usage="deepinfer bench [throughput] [options] | deepinfer bench NAME [ARGS ...]",
        description="Run synthetic or file prompts through one generate call; print throughput and "
        "TTFT / latency percentiles (`deepinfer bench throughput` is the same command).  With a "
        "benchmark NAME first, run that script of benchmarks/ with the remaining arguments.",
        epilog=names_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(bench)
    bench.add_argument("--num-prompts", type=int, help="requests (default: 16, or every prompt of the file)")
    bench.add_argument("--input-len", type=int, default=32, help="tokens per synthetic prompt")
    bench.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    bench.add_argument("--prompts-file", help='one prompt per line, or .jsonl with a "prompt" key')
    bench.add_argument(
        "--shared-prefix-len", type=int, default=0, help="leading tokens shared by every synthetic prompt"
    )
    bench.add_argument("--temperature", type=float, default=1.0)
    bench.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts and the engine")
    bench.add_argument("--json", dest="json_out", metavar="OUT", help="also write the results as JSON to OUT")
    bench.set_defaults(func=_cmd_bench)

    batch = sub.add_parser(
        "run-batch",
        help="answer an OpenAI Batch file (resumable)",
        description="Answer every request of an OpenAI Batch input file (JSONL: custom_id, method, url, "
        "body) into a results file, as the requests finish; rerun the same command to resume "
        "(docs/run-batch.md).",
    )
    batch.add_argument("-i", "--input", required=True, metavar="FILE", help="the batch input file (.jsonl)")
    batch.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="the results file (appended to; custom ids in it are skipped)",
    )
    add_engine_args(batch)
    batch.add_argument("--engine-seed", type=int, dest="engine_seed", help="engine seed (EngineConfig.seed)")
    batch.add_argument(
        "--max-in-flight", type=int, help="most engine requests outstanding (default 4 x max_num_seqs)"
    )
    batch.add_argument(
        "--ordered", action="store_true", help="write results in input order (default: as they finish)"
    )
    batch.add_argument("--fsync", action="store_true", help="fsync the results file after every line")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    batch.set_defaults(func=_cmd_run_batch)

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible HTTP API: /v1/models, /v1/completions, "
        "/v1/chat/completions (streaming too), /health, /metrics (docs/serve.md). Needs the [serve] extra.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument(
        "--api-key", help="key clients must send as 'Authorization: Bearer KEY' (default $DEEPINFER_API_KEY)"
    )
    serve.add_argument("--served-model-name", help="the model name of the API (default the model path)")
    add_engine_args(serve)
    serve.add_argument("--engine-seed", type=int, dest="engine_seed", help="engine seed (EngineConfig.seed)")
    serve.set_defaults(func=_cmd_serve)

    plug = sub.add_parser("plugins", help="print the loaded plugins as JSON")
    plug.set_defaults(func=_cmd_plugins)

    tiny = sub.add_parser("make-tiny", help="write a tiny random DeepSeek-V4 (or V4.1) checkpoint")
    tiny.add_argument("outdir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--arch", choices=("deepseek_v4", "deepseek_v41"), default="deepseek_v4", help="the architecture"
    )
    tiny.add_argument(
        "--quantized",
        action="store_true",
        help="deepseek_v41 only: MXFP8 (32x32 ue8m0) dense linears and Engram rows, MXFP4 experts",
    )
    tiny.add_argument(
        "--dspark",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deepseek_v41 only: with (the default) or without the DSpark block drafter's layers "
        "(mtp.*, drafter 'dspark')",
    )
    tiny.add_argument(
        "--force",
        action="store_true",
        help="write into OUTDIR even when it is not empty (its files of the same names are replaced)",
    )
    tiny.set_defaults(func=_cmd_make_tiny)
    return parser


def _cmd_bench(args: argparse.Namespace) -> int:
    from deepinfer_core.bench import BenchArgs, format_table, run_bench
    from deepinfer_core.user_files import check_writable

    if args.json_out:
        check_writable(args.json_out, "--json")  # before the benchmark runs, not after
    result = run_bench(
        BenchArgs(
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            prompts_file=args.prompts_file,
            shared_prefix_len=args.shared_prefix_len,
            seed=args.seed,
            temperature=args.temperature,
            engine=engine_kwargs(args),
        )
    )
    print(format_table(result))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    failed = result["num_failed_requests"]
    if failed:
        total, first = result["num_requests"], result["first_error"]
        print(f"error: {failed} of {total} request(s) failed; the first: {first}", file=sys.stderr)
        return EXIT_REQUEST_FAILED
    return 0


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from deepinfer_core.batch import run_batch

    summary = run_batch(
        args.input,
        args.output,
        max_in_flight=args.max_in_flight,
        ordered=args.ordered,
        fsync=args.fsync,
        progress=not args.no_progress,
        seed=args.engine_seed,
        **engine_kwargs(args),
    )
    print(summary.line(), file=sys.stderr)
    if summary.first_error is not None:
        print(f"error: {summary.failed} line(s) failed; the first: {summary.first_error}", file=sys.stderr)
    elif summary.skipped_failed:
        print(f"error: {summary.skipped_failed} line(s) of {args.output} are errors", file=sys.stderr)
    return EXIT_REQUEST_FAILED if summary.exit_status else 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from deepinfer_core.serve.server import check_address, check_installed, run_server

    check_installed()
    check_address(args.host, args.port)
    from deepinfer_core.llm import LLM

    llm = LLM(seed=args.engine_seed, **engine_kwargs(args))
    run_server(llm, args.host, args.port, api_key=args.api_key, model=args.served_model_name)
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from deepinfer_core.plugins import cmd_plugins

    return cmd_plugins(args)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    if args.arch == "deepseek_v41":
        from deepinfer_core.models.deepseek_v41.tiny import make_tiny

        dspark = args.dspark is not False  # the drafter's layers unless --no-dspark
        options = {"fp8_linear": args.quantized, "fp4_experts": args.quantized, "dspark": dspark}
    else:
        from deepinfer_core.models.deepseek_v4.tiny import make_tiny

        options = {}
        for flag in ("quantized", "dspark"):
            if getattr(args, flag):  # (--no-dspark asks for nothing)
                raise ConfigError(f"make-tiny --{flag}: only with --arch deepseek_v41")
    if not args.outdir.strip():
        raise ConfigError("make-tiny: the output directory is an empty string; give a directory path")
    out = Path(args.outdir)
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"make-tiny --seed={args.seed}: must be in [0, 2**63)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"make-tiny {out}: a file of that name exists; give a directory path")
    if out.is_dir() and not args.force:
        held = sorted(p.name for p in out.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise ConfigError(
                f"make-tiny {out}: the directory is not empty (it holds {shown}); give a new or empty "
                "directory, or --force to write the checkpoint into it"
            )
    try:
        path = make_tiny(out, seed=args.seed, **options)
    except OSError as e:
        raise ConfigError(f"make-tiny {out}: cannot write the checkpoint there ({e.strerror or e})") from None
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``deepinfer`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] == ["throughput"]:
        argv = ["bench", *argv[2:]]  # the offline throughput / latency command by its name
    elif argv[:1] == ["bench"] and len(argv) > 1 and not argv[1].startswith("-"):  # a benchmark's name
        return _guarded(lambda: run_script(argv[1], argv[2:]))
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    return _guarded(lambda: int(args.func(args)))


def _guarded(command: Callable[[], int]) -> int:
    """``command()``'s exit status; a failure as one ``error:`` line (see the module docstring)."""
    try:
        return int(command())
    except (DeepInferError, OSError) as e:
        print(user_error_line(e), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug: still one line, with how to get the traceback
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(
            f"error: internal error ({type(e).__name__}: {e}); please report it, with the traceback that "
            f"{TRACEBACK_ENV}=1 prints",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
