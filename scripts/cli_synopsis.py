"""The ``deepinfer`` command-line synopsis of docs/configuration.md, rendered from the parser.

    python scripts/cli_synopsis.py           # print the synopsis
    python scripts/cli_synopsis.py --write   # put it between the markers in docs/configuration.md

Every option of every subcommand appears, as ``build_parser()`` defines it (metavars as
``--help`` shows them); the engine options ``generate`` and ``bench`` share are listed once, as
ENGINE FLAGS.  ``tests/test_cli_docs.py`` checks that the doc holds exactly this text, so a
flag added to the parser fails that test until the synopsis is written again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deepinfer_core.cli import build_parser
from deepinfer_core.cli_engine_args import add_engine_args

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = "<!-- the CLI synopsis: written by `python scripts/cli_synopsis.py --write`, do not edit -->"
END = "<!-- end of the CLI synopsis -->"
WIDTH = 100


def _metavar(action: argparse.Action) -> str:
    """The option's metavar, else its choices, else ``N`` (int), ``X`` (float) or its dest."""
    if action.metavar is not None:
        return str(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return {int: "N", float: "X"}.get(action.type, action.dest.upper())


def _item(action: argparse.Action) -> str:
    """One option (or positional) as a usage item: ``[--flag]``, ``--opt X``, ``[--opt X ...]``."""
    if not action.option_strings:
        return _metavar(action)
    if action.nargs == 0:  # flags: store_true / store_false / BooleanOptionalAction / version
        return "[" + " | ".join(action.option_strings) + "]"
    body = f"{'/'.join(action.option_strings)} {_metavar(action)}"  # -i/--input FILE
    repeat = isinstance(action, argparse._AppendAction)
    if action.required:
        return f"{body} [{body} ...]" if repeat else body
    return f"[{body} ...]" if repeat else f"[{body}]"


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a for a in parser._actions if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
    ]


def _wrap(head: str, items: list[str]) -> list[str]:
    """``head`` then the items, wrapped at :data:`WIDTH` between items, under the first one."""
    lines, line, empty = [], head, True
    for item in items:
        if not empty and len(line) + 1 + len(item) > WIDTH:
            lines.append(line)
            line = " " * len(head)
        line, empty = f"{line} {item}", False
    return [*lines, line]


def synopsis(parser: argparse.ArgumentParser | None = None) -> str:
    """The synopsis of ``parser`` (default: ``deepinfer``'s), one usage per subcommand."""
    parser = parser or build_parser()
    engine_parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine_parser)
    engine = [a for a in engine_parser._actions]
    engine_options = {o for a in engine for o in a.option_strings}
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines: list[str] = []
    for name, sub in subparsers.choices.items():
        actions = _visible(sub)
        shares = bool(actions) and engine_options <= {o for a in actions for o in a.option_strings}
        items = ["[ENGINE FLAGS]"] if shares else []
        items += [_item(a) for a in actions if not (shares and set(a.option_strings) & engine_options)]
        lines += _wrap(f"{parser.prog} {name}", items)
    for action in _visible(parser):
        lines += _wrap(parser.prog, [action.option_strings[0]])
    lines += ["", *_wrap("ENGINE FLAGS:", [_item(a) for a in engine])]
    return "\n".join(lines) + "\n"


def doc_block(text: str) -> str:
    """The synopsis held between the markers of ``text`` (the code fence's contents)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC}: the markers of the CLI synopsis are missing ({BEGIN!r}, {END!r})")
    inner = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return inner.strip("\n").removeprefix("```").removesuffix("```").strip("\n") + "\n"


def write(path: Path = DOC) -> None:
    """Put the synopsis between the markers of ``path``."""
    text = path.read_text()
    doc_block(text)  # the markers are there
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n```\n{synopsis()}```\n{END}{tail}")


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        write()
        return 0
    if argv:
        print("usage: python scripts/cli_synopsis.py [--write]", file=sys.stderr)
        return 2
    sys.stdout.write(synopsis())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
