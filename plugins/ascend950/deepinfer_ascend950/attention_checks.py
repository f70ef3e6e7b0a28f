"""Shared pieces of the attention-side ``supports`` predicates: verdicts and dtype sets.

A predicate returns ``True`` when the operator takes the call, else the reason (a string) the
op table logs before running the reference.  Predicates look at shapes, dtypes and Python
values only, never at tensor values (no device synchronisation).
"""

from __future__ import annotations

import math

import torch

from deepinfer_core.ops.modes import batch_invariant_enabled

Verdict = bool | str

HALF_DTYPES = (torch.bfloat16, torch.float16)
"""The 16-bit activation dtypes the attention operators take."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The activation dtypes the row-wise operators take."""

BATCH_INVARIANT_REFUSAL = (
    "batch-invariant mode: the operator documents no fixed reduction order across batch sizes"
)
"""The reason an op with cross-element reductions gives in batch-invariant mode."""


def first_problem(*checks: tuple[bool, str]) -> Verdict:
    """``True`` if every ``(ok, reason)`` holds, else the first failing reason."""
    for ok, reason in checks:
        if not ok:
            return reason
    return True


def not_batch_invariant() -> tuple[bool, str]:
    """The check an op makes when the operator does not promise batch invariance."""
    return not batch_invariant_enabled(), BATCH_INVARIANT_REFUSAL


def is_tensor(name: str, value: object) -> tuple[bool, str]:
    return isinstance(value, torch.Tensor), f"{name} is a {type(value).__name__}, not a plain tensor"


def dtype_in(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> tuple[bool, str]:
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return t.dtype in dtypes, f"{name} dtype {t.dtype} is not one of {names}"


def shape_is(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> tuple[bool, str]:
    return tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape}"


def finite_number(name: str, value: object) -> tuple[bool, str]:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return ok, f"{name} must be a finite number, got {value!r}"


def plain_int(name: str, value: object, lo: int, hi: int) -> tuple[bool, str]:
    ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    return ok, f"{name} must be an int in [{lo}, {hi}], got {value!r}"
