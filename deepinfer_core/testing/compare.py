"""How the conformance suite (:mod:`.conformance`) and the kernel tests compare an op's
outputs with the reference's: nested tensors, sequences, dicts and dataclasses, floating point
within tolerances, everything else exactly (:func:`compare`); and the deep copy of an op's
inputs onto a device (:func:`to_device`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def compare(
    actual: Any, expected: Any, atol: float, rtol: float, path: str, problems: list[str]
) -> float | None:
    """Compare nested outputs, appending one message per mismatch to ``problems``.

    Returns the largest absolute error over the floating-point tensors (``None`` if none).
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            problems.append(f"{path}: expected a tensor, got {type(actual).__name__}")
            return None
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            problems.append(
                f"{path}: expected {tuple(expected.shape)} {expected.dtype}, "
                f"got {tuple(actual.shape)} {actual.dtype}"
            )
            return None
        a, e = actual.detach().cpu(), expected.detach().cpu()
        if not (e.is_floating_point() or e.is_complex()):
            if not torch.equal(a, e):
                problems.append(f"{path}: {int((a != e).sum())} of {e.numel()} integer elements differ")
            return None
        if e.numel() == 0:
            return 0.0
        a64, e64 = a.to(torch.float64), e.to(torch.float64)
        close = torch.isclose(a64, e64, atol=atol, rtol=rtol, equal_nan=True)
        diff = (a64 - e64).abs().nan_to_num(nan=float("inf"))
        diff = torch.where(torch.isnan(a64) & torch.isnan(e64), torch.zeros_like(diff), diff)
        max_err = float(diff.max())
        if not bool(close.all()):
            problems.append(
                f"{path}: {int((~close).sum())} of {e.numel()} elements outside atol={atol} rtol={rtol} "
                f"(max abs err {max_err:.3g})"
            )
        return max_err
    if isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            problems.append(f"{path}: expected a sequence of {len(expected)}, got {_describe(actual)}")
            return None
        errs = [
            compare(a, e, atol, rtol, f"{path}[{i}]", problems)
            for i, (a, e) in enumerate(zip(actual, expected, strict=True))
        ]
        return _max(errs)
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            problems.append(f"{path}: expected a dict with keys {sorted(expected)}, got {_describe(actual)}")
            return None
        return _max(
            [compare(actual[k], expected[k], atol, rtol, f"{path}[{k!r}]", problems) for k in expected]
        )
    if dataclasses.is_dataclass(expected) and not isinstance(expected, type):  # e.g. an Fp8KVPool
        if type(actual) is not type(expected):
            problems.append(f"{path}: expected a {type(expected).__name__}, got {_describe(actual)}")
            return None
        return _max(
            [
                compare(
                    getattr(actual, f.name),
                    getattr(expected, f.name),
                    atol,
                    rtol,
                    f"{path}.{f.name}",
                    problems,
                )
                for f in dataclasses.fields(expected)
            ]
        )
    if actual != expected:
        problems.append(f"{path}: expected {expected!r}, got {actual!r}")
    return None


def to_device(obj: Any, device: torch.device) -> Any:
    """A deep copy of ``obj`` with every tensor on ``device`` (each call gets fresh tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if isinstance(obj, tuple):
        return tuple(to_device(x, device) for x in obj)
    if isinstance(obj, list):
        return [to_device(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # e.g. a PagedIndex
        fields = {f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    return obj


def _describe(obj: Any) -> str:
    return (
        f"{type(obj).__name__} of {len(obj)}" if isinstance(obj, (tuple, list, dict)) else type(obj).__name__
    )


def _max(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
