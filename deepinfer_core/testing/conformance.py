"""Conformance suite: compare a backend's ops against the reference implementations.

Every op of the contract (:mod:`deepinfer_core.ops`) may provide ``sample_cases``: small
seeded inputs.  For each op a backend provides, the suite builds those inputs, moves them to
the backend's device, calls the backend implementation and the reference on separate copies
and compares the outputs (tensors or nested tuples / lists / dicts of them) with the op's
tolerances for the input dtype; integer and bool outputs must match exactly.  A case the
backend's ``supports`` predicate rejects is skipped (the engine would use the reference).

Usage, from a script::

    from deepinfer_core.testing import check_backend

    report = check_backend("my_backend", dtypes=(torch.float32, torch.bfloat16))
    print(report.summary())
    assert report.passed, report.summary()

Usage, from pytest (one test per op, dtype and case; an unavailable backend gives one
skipped test with the probe's reason)::

    import pytest
    from deepinfer_core.testing import conformance_cases

    @pytest.mark.parametrize("case", conformance_cases("my_backend"), ids=str)
    def test_conformance(case):
        case.check()
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer_core.backends.base import BackendSpec
from deepinfer_core.errors import BackendError
from deepinfer_core.ops.registry import DEFAULT_TOLERANCES, OpSpec, all_ops

SEED = 0


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one case: ``status`` is ``"passed"``, ``"failed"`` or ``"skipped"``."""

    op: str
    dtype: str
    index: int
    status: str
    message: str = ""
    max_abs_err: float | None = None


@dataclass
class ConformanceReport:
    """Every case of one backend, plus the ops it provides that have no sample cases."""

    backend: str
    device: str
    results: list[CaseResult] = field(default_factory=list)
    untested_ops: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[CaseResult]:
        """The failed cases."""
        return [r for r in self.results if r.status == "failed"]

    @property
    def passed(self) -> bool:
        """No case failed (skipped cases and untested ops do not count as failures)."""
        return not self.failures

    def summary(self) -> str:
        """A human-readable summary, one line per failure."""
        counts = {s: sum(r.status == s for r in self.results) for s in ("passed", "failed", "skipped")}
        lines = [
            f"backend {self.backend!r} on {self.device}: {counts['passed']} passed, "
            f"{counts['failed']} failed, {counts['skipped']} skipped; "
            f"ops without sample cases: {self.untested_ops or 'none'}"
        ]
        lines += [f"  FAILED {r.op}[{r.dtype}#{r.index}]: {r.message}" for r in self.failures]
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class ConformanceCase:
    """One (op, dtype, sample index) of one backend; ``str(case)`` is a readable test id."""

    spec: BackendSpec
    op: str
    dtype: torch.dtype | None
    index: int
    device: str
    skip_reason: str | None = None

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "none"
        return f"{self.spec.name}-{self.op}-{dtype}-{self.index}"

    def run(self) -> CaseResult:
        """Run the case and return its result (never raises for a backend failure)."""
        dtype_name = str(self.dtype).removeprefix("torch.")
        if self.skip_reason is not None:
            return CaseResult(self.op, dtype_name, self.index, "skipped", self.skip_reason)
        op_spec = all_ops()[self.op]
        impl = self.spec.load_ops()[self.op]
        args, kwargs = _sample(op_spec, self.dtype, self.index)
        device = torch.device(self.device)
        b_args, b_kwargs = _to_device(args, device), _to_device(kwargs, device)
        if impl.supports is not None:
            verdict = impl.supports(*b_args, **b_kwargs)
            if verdict is not True:
                reason = verdict if isinstance(verdict, str) else "case not supported"
                return CaseResult(self.op, dtype_name, self.index, "skipped", f"supports() rejects: {reason}")
        try:
            actual = impl.fn(*b_args, **b_kwargs)
        except Exception as exc:
            return CaseResult(
                self.op, dtype_name, self.index, "failed", f"backend raised {type(exc).__name__}: {exc}"
            )
        expected = op_spec.reference(*_to_device(args, device), **_to_device(kwargs, device))
        atol, rtol = op_spec.tolerances.get(self.dtype, DEFAULT_TOLERANCES[torch.float32])
        problems: list[str] = []
        max_err = compare(actual, expected, atol, rtol, "output", problems)
        status = "failed" if problems else "passed"
        return CaseResult(self.op, dtype_name, self.index, status, "; ".join(problems), max_err)

    def check(self) -> None:
        """pytest entry: skip (with the reason) or raise ``AssertionError`` describing the mismatch."""
        result = self.run()
        if result.status == "skipped":
            import pytest

            pytest.skip(result.message)
        assert result.status == "passed", f"{self}: {result.message}"


def conformance_cases(
    backend: str | BackendSpec,
    dtypes: Iterable[torch.dtype] = (torch.float32,),
    device: str | torch.device | None = None,
    ops: Iterable[str] | None = None,
) -> list[ConformanceCase]:
    """The cases of ``backend`` (a registered name or a :class:`BackendSpec`), for parametrizing.

    An unavailable backend gives a single case that skips with the probe's reason.

    Raises:
        BackendError: unknown backend name, or its ops fail to load or are not in the contract.
    """
    spec = _backend_spec(backend)
    dev = str(device) if device is not None else spec.device_type
    available, reason = spec.availability()
    if not available:
        return [ConformanceCase(spec, "*", None, 0, dev, skip_reason=f"backend {spec.name!r}: {reason}")]
    contract = all_ops()
    provided = spec.load_ops()
    unknown = sorted(set(provided) - set(contract))
    if unknown:
        raise BackendError(f"backend {spec.name!r} provides ops that are not in the op contract: {unknown}")
    selected = sorted(provided) if ops is None else [name for name in ops if name in provided]
    cases = []
    for name in selected:
        op_spec = contract[name]
        if op_spec.sample_cases is None:
            continue
        for dtype in dtypes:
            count = len(op_spec.sample_cases(_generator(), dtype))
            cases += [ConformanceCase(spec, name, dtype, i, dev) for i in range(count)]
    return cases


def check_backend(
    backend_name_or_spec: str | BackendSpec,
    dtypes: Iterable[torch.dtype] = (torch.float32,),
    device: str | torch.device | None = None,
    ops: Iterable[str] | None = None,
) -> ConformanceReport:
    """Run every case of a backend against the reference; see the module docstring.

    Raises:
        BackendError: the backend is unknown or unavailable (with the probe's reason).
    """
    spec = _backend_spec(backend_name_or_spec)
    available, reason = spec.availability()
    if not available:
        raise BackendError(f"cannot check backend {spec.name!r}: it is not available here: {reason}")
    dtypes = tuple(dtypes)
    cases = conformance_cases(spec, dtypes, device, ops)
    provided = spec.load_ops() if ops is None else {n: i for n, i in spec.load_ops().items() if n in set(ops)}
    untested = sorted(name for name in provided if all_ops()[name].sample_cases is None)
    report = ConformanceReport(
        spec.name, str(device) if device is not None else spec.device_type, untested_ops=untested
    )
    report.results = [case.run() for case in cases]
    return report


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
    if actual != expected:
        problems.append(f"{path}: expected {expected!r}, got {actual!r}")
    return None


def _backend_spec(backend: str | BackendSpec) -> BackendSpec:
    if isinstance(backend, BackendSpec):
        return backend
    from deepinfer_core.plugins import get_plugins

    return get_plugins().get_backend(backend)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def _sample(op_spec: OpSpec, dtype: torch.dtype | None, index: int) -> tuple[tuple, dict]:
    assert op_spec.sample_cases is not None
    args, kwargs = op_spec.sample_cases(_generator(), dtype)[index]
    return tuple(args), dict(kwargs)


def _to_device(obj: Any, device: torch.device) -> Any:
    """A deep copy of ``obj`` with every tensor on ``device`` (each call gets fresh tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)
    if isinstance(obj, tuple):
        return tuple(_to_device(x, device) for x in obj)
    if isinstance(obj, list):
        return [_to_device(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _describe(obj: Any) -> str:
    return (
        f"{type(obj).__name__} of {len(obj)}" if isinstance(obj, (tuple, list, dict)) else type(obj).__name__
    )


def _max(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


__all__ = [
    "CaseResult",
    "ConformanceCase",
    "ConformanceReport",
    "check_backend",
    "compare",
    "conformance_cases",
]
