"""Version ranges of the plugin API: ``DEEPINFER_API = ">=1.0,<2"`` in a plugin module."""

from __future__ import annotations

import re

from deepinfer_core.errors import PluginError

PLUGIN_API_VERSION = "1.0"
"""Version of the plugin API (hooks, BackendSpec, OpImpl) this core implements."""

_CLAUSE_RE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)\s*$")


def parse_version(text: str) -> tuple[int, ...]:
    """``"1.10"`` -> ``(1, 10)``; raises :class:`PluginError` on anything else."""
    if not re.fullmatch(r"\d+(\.\d+)*", text.strip()):
        raise PluginError(f"invalid version {text!r}: expected numbers separated by dots, e.g. '1.0'")
    return tuple(int(part) for part in text.strip().split("."))


def version_in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec``, comma-separated clauses like ``">=1.0,<2"``.

    Operators: ``>= <= > < == !=``; versions compare numerically, missing parts count as 0
    (``"2" == "2.0"``).  Raises :class:`PluginError` when ``spec`` is malformed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(f"invalid API range {spec!r}: expected clauses like '>=1.0,<2'")
    have = parse_version(version)
    for clause in spec.split(","):
        match = _CLAUSE_RE.match(clause)
        if not match:
            raise PluginError(
                f"invalid API range {spec!r}: clause {clause.strip()!r} is not '<op><version>' "
                "with op one of >= <= > < == !="
            )
        op, bound_text = match.groups()
        bound = parse_version(bound_text)
        width = max(len(have), len(bound))
        a, b = have + (0,) * (width - len(have)), bound + (0,) * (width - len(bound))
        ok = {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "==": a == b, "!=": a != b}[op]
        if not ok:
            return False
    return True
