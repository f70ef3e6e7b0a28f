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
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from deepinfer_core.benchmarking.scripts import names_help, run_script
from deepinfer_core.errors import ConfigError, DeepInferError, user_error_line

EXIT_REQUEST_FAILED = 1  # the engine ran, and some prompt / request failed (one error line says so)
EXIT_USAGE = 2  # bad flag, option, path, config file or environment variable
EXIT_INTERNAL = 3  # a bug in DeepInfer or a plugin; DEEPINFER_TRACEBACK=1 shows the traceback
EXIT_INTERRUPTED = 130
TRACEBACK_ENV = "DEEPINFER_TRACEBACK"


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
    _add_engine_args(gen)
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
    gen.set_defaults(func=_cmd_generate)

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
    _add_engine_args(bench)
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
    _add_engine_args(batch)
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
    _add_engine_args(serve)
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


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--log-level", help="debug, info, warning or error")


_SPEC_FLAGS = {
    "speculative_method": "method",
    "drafter": "drafter",
    "max_draft_tokens": "max_draft_tokens",
    "spec_acceptance": "acceptance",
    "spec_varlen": "varlen",
}


def _engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine options given on the command line, as ``LLM`` keyword arguments."""
    names = (
        "model", "revision", "download_dir", "config", "backend", "dtype", "device", "strict_ops",
        "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_cache_pages", "kv_cache_dtype",
        "enable_prefix_caching", "async_scheduling", "replay_tail", "batch_invariant", "enforce_eager",
        "mixed_graph_max_tokens", "scheduler", "keep_quantized", "log_level", "data_parallel_size",
        "enable_expert_parallel", "context_parallel_size", "distributed_backend", "distributed_timeout_s",
        "eplb",
    )  # fmt: skip
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    spec = {
        field: getattr(args, flag)
        for flag, field in _SPEC_FLAGS.items()
        if getattr(args, flag, None) is not None
    }
    if spec:
        kwargs["speculative"] = spec
    return kwargs


def _cmd_generate(args: argparse.Namespace) -> int:
    from deepinfer_core.llm import LLM
    from deepinfer_core.sampling.params import SamplingParams

    structured = _structured_outputs(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        structured_outputs=structured,
    )
    llm = LLM(seed=args.engine_seed, **_engine_kwargs(args))
    if args.verbose:
        print(f"KV cache capacity: {llm.kv_cache_capacity_tokens} tokens", file=sys.stderr)
    outputs = llm.generate(args.prompt, params, use_tqdm=args.verbose)
    tokenizer = llm.get_tokenizer()
    for i, out in enumerate(outputs):
        if args.json:
            print(json.dumps(_output_record(out)))
        else:
            print(_format_output(out, i if len(outputs) > 1 else None, tokenizer))
    failed = sum(out.error is not None for out in outputs)
    if failed:
        print(
            f"error: {failed} of {len(outputs)} prompt(s) failed (errors shown in order above)",
            file=sys.stderr,
        )
        return EXIT_REQUEST_FAILED
    return 0


def _structured_outputs(args: argparse.Namespace) -> Any:
    """The ``StructuredOutputsParams`` of ``generate``'s --choice / --regex / --json-schema /
    --grammar (``None`` without them), checked by its grammar backend before the engine starts:
    a bad spec is a :class:`ConfigError` naming the flag."""
    from deepinfer_core.sampling.params import StructuredOutputsParams
    from deepinfer_core.user_files import read_text_file

    structured = None
    given = [
        flag
        for flag, value in (
            ("--choice", args.choice),
            ("--regex", args.regex),
            ("--json-schema", args.json_schema),
            ("--grammar", args.grammar),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(f"generate: {' and '.join(given)} are mutually exclusive; give one")
    if given:
        schema = grammar = None
        if args.json_schema is not None:
            schema = read_text_file("--json-schema", args.json_schema)
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ConfigError(f"--json-schema {args.json_schema}: not valid JSON ({e})") from None
            if not isinstance(schema, dict):
                raise ConfigError(f"--json-schema {args.json_schema}: must hold a JSON object")
        if args.grammar is not None:
            grammar = read_text_file("--grammar", args.grammar)
            if not grammar.strip():
                raise ConfigError(f"--grammar {args.grammar}: the file is empty")
        structured = StructuredOutputsParams(
            choice=args.choice, regex=args.regex, json=schema, grammar=grammar
        )
        _check_spec(structured, given[0], args.json_schema or args.grammar)
    return structured


def _check_spec(spec: Any, flag: str, path: str | None) -> None:
    """Compile ``spec`` with its backend, reached through the plugins (no model, no tokenizer);
    a :class:`ConfigError` ``"<flag> [<file>]: <reason>"`` when it is invalid."""
    from deepinfer_core.engine.structured import check_spec
    from deepinfer_core.plugins import get_plugins

    try:
        check_spec(get_plugins(), spec)
    except ValueError as e:
        where = f"{flag} {path}" if path is not None else flag
        raise ConfigError(f"{where}: {e}") from None


def _output_record(out: Any) -> dict[str, Any]:
    """One prompt's result as the JSON object ``generate --json`` prints."""
    comp = out.outputs[0]
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
    return record


def _format_output(out: Any, index: int | None, tokenizer: Any) -> str:
    """One prompt's result as text: the completion (or ``error: ...``), then, when logprobs were
    asked for, one line per generated token with its logprob and the top alternatives.  With
    several prompts every result starts with ``[i]`` (the prompt's index) and its further lines
    are indented, so results stay matched to prompts even when one fails or spans lines."""
    comp = out.outputs[0]
    lines = [f"error: {out.error}"] if out.error else escape_control(comp.text).split("\n")
    if out.error is None and comp.logprobs is not None:
        for pos, (token, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=False)):
            top = ", ".join(f"{_token_str(t, tokenizer)} {v:.4f}" for t, v in lp.items())
            chosen = lp.get(token, float("nan"))
            lines.append(f"  logprobs[{pos}]: {_token_str(token, tokenizer)} {chosen:.4f} | top: {top}")
    if index is None:
        return "\n".join(lines)
    prefix = f"[{index}] "
    return "\n".join(
        prefix + lines[0] if k == 0 else " " * len(prefix) + line for k, line in enumerate(lines)
    )


_KEPT_CONTROLS = "\n\t"


def escape_control(text: str) -> str:
    """``text`` with its control characters (Unicode category ``Cc``: NUL, ESC, CR, DEL, ...;
    ``Cs``: lone surrogates) except newline and tab written as Python writes them in a string
    literal (``\\x00``, ``\\x1b``, ``\\r``, ``\\ud800``), so plain output stays text that a
    terminal shows and ``grep`` reads as it is; ``--json`` keeps the exact text."""
    if text.isprintable():  # the common case: nothing to escape
        return text
    return "".join(
        ch.encode("unicode_escape").decode("ascii")
        if ch not in _KEPT_CONTROLS and unicodedata.category(ch) in ("Cc", "Cs")
        else ch
        for ch in text
    )


def _token_str(token_id: int, tokenizer: Any) -> str:
    """A token shown as ``id:'text'`` (just the id without a tokenizer)."""
    if tokenizer is None:
        return str(token_id)
    return f"{token_id}:{tokenizer.decode([token_id], skip_special_tokens=False)!r}"


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
            engine=_engine_kwargs(args),
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
        **_engine_kwargs(args),
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

    llm = LLM(seed=args.engine_seed, **_engine_kwargs(args))
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
