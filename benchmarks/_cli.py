"""Small helpers shared by the benchmark scripts' command lines."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence


def log(msg: str) -> None:
    """Print ``msg`` with the wall-clock time, flushed (progress lines of a long run)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def positive_ints(text: str) -> list[int]:
    """``argparse`` type: comma-separated positive integers (``"1,16,64"``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """``argparse`` type: a non-empty comma-separated list of ``choices`` (``"decode,cp"``)."""

    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in values if x not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(choices)}")
        return values

    return parse


KEEP_QUANTIZED = {"auto": None, "on": True, "off": False}
"""``--keep-quantized`` choices and the ``LLM(keep_quantized=...)`` each gives."""


def add_keep_quantized(parser: argparse.ArgumentParser, help: str) -> None:
    """``--keep-quantized auto|on|off`` (default ``auto``; :data:`KEEP_QUANTIZED` maps it)."""
    parser.add_argument("--keep-quantized", choices=tuple(KEEP_QUANTIZED), default="auto", help=help)
