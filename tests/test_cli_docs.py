"""docs/configuration.md's CLI synopsis is the parser's: every option of every ``deepinfer``
subcommand appears in it, and it is exactly what ``scripts/cli_synopsis.py`` renders from
``build_parser()`` (a new flag fails here until ``python scripts/cli_synopsis.py --write``)."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

from deepinfer_core.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cli_synopsis", ROOT / "scripts" / "cli_synopsis.py")
cli_synopsis = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli_synopsis)


def every_option(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """``{command: its option strings}`` of ``parser`` and each subcommand (``-h`` aside)."""
    out = {parser.prog: [o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")]}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(every_option(sub))
    return out


def test_every_option_of_the_parser_is_in_the_docs_synopsis():
    block = cli_synopsis.doc_block(cli_synopsis.DOC.read_text())
    options = every_option(build_parser())
    assert {"deepinfer generate", "deepinfer bench", "deepinfer plugins", "deepinfer make-tiny"} <= set(
        options
    )
    missing = {cmd: [o for o in opts if not _names(o, block)] for cmd, opts in options.items()}
    assert not any(missing.values()), f"not in docs/configuration.md's CLI synopsis: {missing}"
    assert all(_names(command, block) for command in options), list(options)


def _names(word: str, text: str) -> bool:
    """Whether ``text`` has ``word`` as a whole word (``--seed`` is not in ``--engine-seed``)."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_the_docs_synopsis_is_the_rendered_one():
    block = cli_synopsis.doc_block(cli_synopsis.DOC.read_text())
    assert block == cli_synopsis.synopsis(), (
        "docs/configuration.md's CLI synopsis differs from the parser: python scripts/cli_synopsis.py --write"
    )


def test_the_synopsis_renders_each_kind_of_option():
    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers().add_parser("run")
    sub.add_argument("path")
    sub.add_argument("--flag", action="store_true")
    sub.add_argument("--count", type=int, required=True)
    sub.add_argument("--tag", action="append")
    sub.add_argument("--mode", choices=("a", "b"))
    sub.add_argument("--on", action=argparse.BooleanOptionalAction)
    text = cli_synopsis.synopsis(parser)
    assert (
        text.splitlines()[0]
        == "tool run PATH [--flag] --count N [--tag TAG ...] [--mode {a,b}] [--on | --no-on]"
    )
