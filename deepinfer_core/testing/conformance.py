"""Conformance suite: compare a backend's ops against the reference implementations.

Every op of the contract (:mod:`deepinfer_core.ops`) may provide ``sample_cases``: small
seeded inputs.  For each op a backend provides, the suite builds those inputs, moves them to
the backend's device, calls the backend implementation and the reference on separate copies
and compares the outputs (tensors or nested tuples / lists / dicts of them) with the op's
tolerances for the input dtype; integer and bool outputs must match exactly.  A fused op with
a decomposition that the backend does not provide is checked too, as the engine runs it: its
decomposition over the backend's op table (the backend's kernels for the parts).

A backend adds its own cases for the shapes its kernels target where it registers the op,
``OpImpl(fn, supports=..., sample_cases=...)`` (found whenever the backend is checked), or per
call with ``cases=``: a mapping from op name to such a function.  Either is a function
``(generator, dtype) -> [(args, kwargs), ...]`` (the signature of ``OpSpec.sample_cases``).
They run in addition to the op's own cases, with the op's tolerances; their ids end in
``-own0``, ``-own1``...  The engine never uses them.

The suite cannot pass vacuously:

- a case the backend's ``supports`` predicate rejects is skipped (the engine would use the
  reference), with what ``supports`` returned; but an op whose *every* case is rejected is a
  failure: its kernel never ran;
- an op with no case at all for the requested dtypes (none of its own, none supplied with
  ``cases=``) is reported as untested and is a failure too: supply cases for it.

Usage, from a script::

    from deepinfer_core.testing import check_backend

    report = check_backend("my_backend", dtypes=(torch.float32, torch.bfloat16))
    print(report.summary())
    assert report.passed, report.summary()

Usage, from pytest (one test per op, dtype and case, plus one failing ``<backend>-<op>-coverage``
test for each op that is untested or whose every case ``supports`` rejects; an unavailable
backend gives one skipped test with the probe's reason)::

    import pytest
    from deepinfer_core.testing import conformance_cases

    @pytest.mark.parametrize("case", conformance_cases("my_backend"), ids=str)
    def test_conformance(case):
        case.check()
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from deepinfer_core.backends.base import BackendSpec
from deepinfer_core.errors import BackendError
from deepinfer_core.ops.registry import DEFAULT_TOLERANCES, OpImpl, SampleCases, all_ops, unaccepted_params
from deepinfer_core.ops.table import OpTable
from deepinfer_core.plugins import get_plugins
from deepinfer_core.testing.compare import compare, to_device

SEED = 0

SuppliedCases = Mapping[str, SampleCases]
"""Backend-supplied cases: op name -> ``(generator, dtype) -> [(args, kwargs), ...]``."""

_UNTESTED = "no sample case for these dtypes, so its kernel is never checked; supply some with cases="


def _never_ran_message(reasons: list[str]) -> str:
    return f"supports() rejected every case, so the kernel never ran: {'; '.join(reasons)}"


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one case: ``status`` is ``"passed"``, ``"failed"`` or ``"skipped"``.

    ``own`` marks a case the backend supplied (``cases=``) rather than one of the op's own.
    """

    op: str
    dtype: str
    index: int
    status: str
    message: str = ""
    max_abs_err: float | None = None
    own: bool = False

    @property
    def label(self) -> str:
        """``dtype#index``, e.g. ``float32#0`` (``float32#own0`` for a backend-supplied case)."""
        return f"{self.dtype}#{'own' if self.own else ''}{self.index}"


@dataclass
class ConformanceReport:
    """Every case of one backend, and the ops whose kernel no case exercised.

    Attributes:
        untested_ops: ops the backend provides with no case at all for the requested dtypes.
        never_ran: ops whose every case ``supports`` rejected, with the distinct reasons.
    """

    backend: str
    device: str
    results: list[CaseResult] = field(default_factory=list)
    untested_ops: list[str] = field(default_factory=list)
    never_ran: dict[str, list[str]] = field(default_factory=dict)

    @property
    def failures(self) -> list[CaseResult]:
        """The failed cases."""
        return [r for r in self.results if r.status == "failed"]

    @property
    def passed(self) -> bool:
        """No case failed, and every op ran on at least one case (skipped cases alone do not fail)."""
        return not (self.failures or self.untested_ops or self.never_ran)

    def summary(self) -> str:
        """A human-readable summary, one line per failure, untested op and op that never ran."""
        counts = {s: sum(r.status == s for r in self.results) for s in ("passed", "failed", "skipped")}
        lines = [
            f"backend {self.backend!r} on {self.device}: {counts['passed']} passed, "
            f"{counts['failed']} failed, {counts['skipped']} skipped"
        ]
        lines += [f"  FAILED {r.op}[{r.label}]: {r.message}" for r in self.failures]
        lines += [f"  FAILED {op}: {_never_ran_message(reasons)}" for op, reasons in self.never_ran.items()]
        lines += [f"  UNTESTED {op}: {_UNTESTED}" for op in self.untested_ops]
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class ConformanceCase:
    """One (op, dtype, sample index) of one backend; ``str(case)`` is a readable test id.

    Attributes:
        sample_cases: the backend-supplied cases this one comes from (``None``: the op's own).
        failure: set on an op-level ``<backend>-<op>-coverage`` item, which fails with this
            message: the op is untested or ``supports`` rejects every case.
    """

    spec: BackendSpec
    op: str
    dtype: torch.dtype | None
    index: int
    device: str
    skip_reason: str | None = None
    sample_cases: SampleCases | None = None
    failure: str | None = None

    def __str__(self) -> str:
        if self.failure is not None:
            return f"{self.spec.name}-{self.op}-coverage"
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "none"
        own = "own" if self.sample_cases is not None else ""
        return f"{self.spec.name}-{self.op}-{dtype}-{own}{self.index}"

    def run(self) -> CaseResult:
        """Run the case and return its result (never raises for a backend failure)."""
        dtype_name = str(self.dtype).removeprefix("torch.")

        def result(status: str, message: str = "", max_err: float | None = None) -> CaseResult:
            own = self.sample_cases is not None
            return CaseResult(self.op, dtype_name, self.index, status, message, max_err, own)

        if self.skip_reason is not None:
            return result("skipped", self.skip_reason)
        if self.failure is not None:
            return result("failed", self.failure)
        op_spec = all_ops()[self.op]
        impl = self.spec.load_ops().get(self.op)
        if impl is None:  # a fused op the backend leaves to its decomposition
            impl = OpImpl(fn=_table(self.spec)[self.op])
        sample = self._sample()
        args, kwargs = self._on_device(sample)
        older = sorted(
            k
            for k in unaccepted_params(impl.fn, op_spec.reference)
            | unaccepted_params(impl.supports, op_spec.reference)
            if kwargs.get(k) is not None
        )
        if older:  # the engine runs these calls on the reference (OpTable)
            return result("skipped", f"the backend's {self.op} takes no {older} (newer optional arguments)")
        try:
            rejection = self._rejection(args, kwargs)
        except Exception as exc:
            return result("failed", f"supports() raised {type(exc).__name__}: {exc}")
        if rejection is not None:
            return result("skipped", rejection)
        try:
            actual = impl.fn(*args, **kwargs)
        except Exception as exc:
            return result("failed", f"backend raised {type(exc).__name__}: {exc}")
        ref_args, ref_kwargs = self._on_device(sample)
        expected = op_spec.reference(*ref_args, **ref_kwargs)
        atol, rtol = op_spec.tolerances.get(self.dtype, DEFAULT_TOLERANCES[torch.float32])
        problems: list[str] = []
        max_err = compare(actual, expected, atol, rtol, "output", problems)
        return result("failed" if problems else "passed", "; ".join(problems), max_err)

    def _rejection(self, args: tuple | None = None, kwargs: dict | None = None) -> str | None:
        """``None`` if the backend takes this case, else what its ``supports`` said.

        ``args`` / ``kwargs`` default to the case's inputs on the device.  An exception
        raised by ``supports`` propagates.
        """
        impl = self.spec.load_ops().get(self.op)
        supports = impl.supports if impl is not None else None  # a decomposition takes every case
        if supports is None:
            return None
        if args is None or kwargs is None:
            args, kwargs = self._on_device(self._sample())
        verdict = supports(*args, **kwargs)
        if verdict is True:
            return None
        return (
            f"supports() rejects: {verdict}"
            if isinstance(verdict, str)
            else f"supports() returned {verdict!r}"
        )

    def check(self) -> None:
        """pytest entry: skip (with the reason) or raise ``AssertionError`` describing the mismatch."""
        result = self.run()
        if result.status == "skipped":
            import pytest

            pytest.skip(result.message)
        assert result.status == "passed", f"{self}: {result.message}"

    def _sample(self) -> tuple[tuple, dict]:
        """The case's inputs, as built by its sample-case function."""
        make = self.sample_cases or all_ops()[self.op].sample_cases
        assert make is not None and self.dtype is not None
        args, kwargs = make(_generator(), self.dtype)[self.index]
        return tuple(args), dict(kwargs)

    def _on_device(self, sample: tuple[tuple, dict]) -> tuple[tuple, dict]:
        """Fresh copies of ``sample`` on the case's device."""
        device = torch.device(self.device)
        return to_device(sample[0], device), to_device(sample[1], device)


def conformance_cases(
    backend: str | BackendSpec,
    dtypes: Iterable[torch.dtype] = (torch.float32,),
    device: str | torch.device | None = None,
    ops: Iterable[str] | None = None,
    cases: SuppliedCases | None = None,
) -> list[ConformanceCase]:
    """The cases of ``backend`` (a registered name or a :class:`BackendSpec`), for parametrizing.

    ``cases`` adds backend-supplied cases (see the module docstring) to the ops' own.  Each
    op that is untested, or whose every case ``supports`` rejects (checked here, at
    collection), adds a ``<backend>-<op>-coverage`` case that fails saying so.  An
    unavailable backend gives a single case that skips with the probe's reason.

    Raises:
        BackendError: unknown backend name, its ops fail to load or are not in the contract,
            or ``cases`` names an op the backend does not provide.
    """
    spec = _backend_spec(backend)
    dev = str(device) if device is not None else spec.device_type
    available, reason = spec.availability()
    if not available:
        return [ConformanceCase(spec, "*", None, 0, dev, skip_reason=f"backend {spec.name!r}: {reason}")]
    result: list[ConformanceCase] = []
    for name, op_cases in _plan(spec, tuple(dtypes), dev, ops, cases).items():
        result += op_cases
        if not op_cases:
            result.append(ConformanceCase(spec, name, None, 0, dev, failure=f"op {name!r}: {_UNTESTED}"))
            continue
        reasons = _rejections(op_cases)
        if reasons is not None:
            failure = f"op {name!r}: {_never_ran_message(reasons)}"
            result.append(ConformanceCase(spec, name, None, 0, dev, failure=failure))
    return result


def check_backend(
    backend_name_or_spec: str | BackendSpec,
    dtypes: Iterable[torch.dtype] = (torch.float32,),
    device: str | torch.device | None = None,
    ops: Iterable[str] | None = None,
    cases: SuppliedCases | None = None,
) -> ConformanceReport:
    """Run every case of a backend against the reference; see the module docstring.

    ``cases`` adds backend-supplied cases to the ops' own.  The report fails if a case
    fails, an op has no case, or ``supports`` rejects every case of an op.

    Raises:
        BackendError: the backend is unknown or unavailable (with the probe's reason), or
            ``cases`` names an op the backend does not provide.
    """
    spec = _backend_spec(backend_name_or_spec)
    available, reason = spec.availability()
    if not available:
        raise BackendError(f"cannot check backend {spec.name!r}: it is not available here: {reason}")
    dev = str(device) if device is not None else spec.device_type
    report = ConformanceReport(spec.name, dev)
    for name, op_cases in _plan(spec, tuple(dtypes), dev, ops, cases).items():
        results = [case.run() for case in op_cases]
        report.results += results
        if not results:
            report.untested_ops.append(name)
        elif all(r.status == "skipped" for r in results):
            report.never_ran[name] = list(dict.fromkeys(r.message for r in results))
    return report


def _plan(
    spec: BackendSpec,
    dtypes: tuple[torch.dtype, ...],
    device: str,
    ops: Iterable[str] | None,
    cases: SuppliedCases | None,
) -> dict[str, list[ConformanceCase]]:
    """The cases of each selected op the backend provides: the op's own, then the supplied ones."""
    provided = spec.load_ops()  # first: loading may define ops (a family module it imports)
    contract = all_ops()
    unknown = sorted(set(provided) - set(contract))
    if unknown:
        raise BackendError(f"backend {spec.name!r} provides ops that are not in the op contract: {unknown}")
    # the fused ops it leaves to their decomposition run on its kernels for the parts: checked too
    checked = set(provided) | {n for n, op in contract.items() if op.decomposition is not None}
    cases = dict(cases or {})
    stray = sorted(set(cases) - checked)
    if stray:
        raise BackendError(f"cases= names ops that backend {spec.name!r} does not provide: {stray}")
    selected = sorted(checked) if ops is None else [name for name in ops if name in checked]
    plan: dict[str, list[ConformanceCase]] = {}
    for name in selected:
        plan[name] = []
        sources = [(contract[name].sample_cases, None)]
        impl = provided.get(name)
        backend_cases = (impl.sample_cases if impl is not None else None, cases.get(name))
        sources += [(own, own) for own in backend_cases if own is not None]
        for make, own in sources:
            for dtype in dtypes if make is not None else ():
                count = len(make(_generator(), dtype))
                plan[name] += [
                    ConformanceCase(spec, name, dtype, i, device, sample_cases=own) for i in range(count)
                ]
    return plan


def _rejections(cases: list[ConformanceCase]) -> list[str] | None:
    """The distinct reasons if ``supports`` rejects every case, else ``None``.

    A ``supports`` that raises counts as taking the case: running it reports the error.
    """
    reasons: list[str] = []
    for case in cases:
        try:
            reason = case._rejection()
        except Exception:
            return None
        if reason is None:
            return None
        reasons.append(reason)
    return list(dict.fromkeys(reasons))


_TABLES: dict[int, tuple[BackendSpec, OpTable]] = {}


def _table(spec: BackendSpec) -> OpTable:
    """The op table the engine builds for ``spec`` (one per spec, kept)."""
    key = id(spec)
    if key not in _TABLES or _TABLES[key][0] is not spec:
        _TABLES[key] = (spec, OpTable(spec.load_ops(), backend=spec.name))
    return _TABLES[key][1]


def _backend_spec(backend: str | BackendSpec) -> BackendSpec:
    if isinstance(backend, BackendSpec):
        return backend
    return get_plugins().get_backend(backend)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


__all__ = [
    "CaseResult",
    "ConformanceCase",
    "ConformanceReport",
    "SuppliedCases",
    "check_backend",
    "conformance_cases",
]
