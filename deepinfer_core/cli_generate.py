"""``deepinfer generate``: complete prompts and print the results (text, token ids or JSON
records; structured outputs from ``--json-schema`` / ``--regex`` / ``--grammar`` style flags)."""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from typing import Any

from deepinfer_core.cli_engine_args import engine_kwargs
from deepinfer_core.cli_status import EXIT_REQUEST_FAILED
from deepinfer_core.errors import ConfigError


def cmd_generate(args: argparse.Namespace) -> int:
    """``deepinfer generate``: complete ``args.prompt`` and print each result in its format;
    returns the exit status (``EXIT_REQUEST_FAILED`` when a prompt failed, its error shown in
    its place)."""
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
    llm = LLM(seed=args.engine_seed, **engine_kwargs(args))
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
