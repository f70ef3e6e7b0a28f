"""The op contract: every op the models call, with a documented signature and a reference.

An *op* is a pure function on tensors.  Each op is defined once, here in the core, by its
pure-PyTorch reference implementation, whose docstring is the contract (shapes, dtypes,
layout, semantics).  Backends override ops one by one with :class:`OpImpl` objects, each
with an optional ``supports`` predicate that receives exactly the op's arguments and
returns ``True`` when the backend kernel handles that case.

Ops marked ``batch_invariant`` must give bitwise-identical results for a row regardless of
the other rows in the batch when the engine runs with ``batch_invariant=True``.

**Extension ops.**  A plugin may define ops of its own the same way, with a reference in its
own package; their names are namespaced ``"<namespace>.<op>"`` (core ops have no dot).  They
join the contract when their module is imported (e.g. from a backend's ``load_ops``): every
:class:`~deepinfer_core.ops.OpTable` resolves them (a backend's kernel, else the plugin's
reference), code that knows them calls ``ops["namespace.op"]``, and the conformance suite
checks them against their reference like core ops.  No backend is expected to provide
another plugin's extension ops, so their absence is neither logged nor refused by
``strict_ops``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

SampleCases = Callable[[torch.Generator, torch.dtype], list[tuple[tuple, dict]]]
Decomposition = Callable[..., Any]
"""``(ops, *args, **kwargs) -> result``: a fused op as the sequence of a table's other ops (see
:class:`OpSpec`)."""


@dataclass(frozen=True)
class OpSpec:
    """One op of the contract.

    Attributes:
        name: unique op name, e.g. ``"rms_norm"``.
        family: module family (``norm``, ``linear``, ``attention``, ``moe``, ``rope``, ``mhc``...).
        reference: the pure-PyTorch reference implementation; its docstring is the contract.
        batch_invariant: whether the op must honour batch invariance (see module docs).
        sample_cases: ``(generator, dtype) -> [(args, kwargs), ...]`` small inputs used by the
            conformance suite (:mod:`deepinfer_core.testing`) to compare a backend against
            the reference.
        tolerances: ``{dtype: (atol, rtol)}`` used by the conformance suite.
        decomposition: for a fused op whose reference is a sequence of other ops, that sequence
            as a function of an op table and the op's arguments, ``(ops, *args, **kwargs)``,
            reaching the parts by attribute (``ops.rms_norm``; the reference passes a namespace
            of the parts' references).  An :class:`~deepinfer_core.ops.OpTable` whose
            backend does not provide the op runs this over its own ops (so the backend's kernels
            for the parts still serve), and a call the backend's ``supports`` rejects runs it too.
    """

    name: str
    family: str
    reference: Callable[..., Any]
    batch_invariant: bool = False
    sample_cases: SampleCases | None = None
    tolerances: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)
    decomposition: Decomposition | None = None

    @property
    def doc(self) -> str:
        """The contract text (the reference implementation's docstring)."""
        return (self.reference.__doc__ or "").strip()


@dataclass(frozen=True)
class OpImpl:
    """A backend's implementation of one op.

    Attributes:
        fn: callable with exactly the reference signature.
        supports: optional predicate called with the op's arguments; returns ``True`` when
            ``fn`` handles the case.  A ``False`` (or a string giving the reason) makes the
            engine use the reference implementation for that call (the op's decomposition
            over the table's other ops where it has one), logged once per op.
        sample_cases: optional ``(generator, dtype) -> [(args, kwargs), ...]`` of the shapes the
            kernel targets (the form of :attr:`OpSpec.sample_cases`); the conformance suite
            runs them against the reference in addition to the op's own cases.
    """

    fn: Callable[..., Any]
    supports: Callable[..., bool | str] | None = None
    sample_cases: SampleCases | None = None


_OPS: dict[str, OpSpec] = {}

DEFAULT_TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def define_op(
    name: str,
    family: str,
    *,
    batch_invariant: bool = False,
    sample_cases: SampleCases | None = None,
    tolerances: dict[torch.dtype, tuple[float, float]] | None = None,
    decomposition: Decomposition | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering a reference implementation as the definition of op ``name``
    (``decomposition``: see :class:`OpSpec`)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        in_core = fn.__module__.startswith("deepinfer_core.ops")
        if in_core == is_extension(name):
            raise ValueError(
                f"op {name!r} ({fn.__module__}): core ops have plain names; an op defined outside "
                "deepinfer_core.ops needs a namespaced name '<namespace>.<op>'"
            )
        if name in _OPS and _OPS[name].reference is not fn:
            raise ValueError(f"op {name!r} is defined twice ({_OPS[name].reference} and {fn})")
        _OPS[name] = OpSpec(
            name=name,
            family=family,
            reference=fn,
            batch_invariant=batch_invariant,
            sample_cases=sample_cases,
            tolerances={**DEFAULT_TOLERANCES, **(tolerances or {})},
            decomposition=decomposition,
        )
        return fn

    return wrap


def is_extension(name: str) -> bool:
    """Whether ``name`` is a plugin-defined (namespaced) op rather than a core op."""
    return "." in name


def all_ops() -> dict[str, OpSpec]:
    """Every op of the contract, by name (imports the op modules on first call)."""
    from deepinfer_core.ops import _load_all  # noqa: F401  (registers the op modules)

    return dict(_OPS)


def get_op(name: str) -> OpSpec:
    """The spec of op ``name``; raises ``KeyError`` naming the known ops when unknown."""
    ops = all_ops()
    if name not in ops:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(sorted(ops))}")
    return ops[name]


def unaccepted_params(fn: Callable[..., Any] | None, reference: Callable[..., Any]) -> frozenset[str]:
    """The reference's optional parameters that ``fn`` cannot take (no such parameter and no
    ``**kwargs``): an implementation written before an op gained an optional argument.  Calls
    that give such an argument (not ``None``) run on the reference; ``None`` ones are dropped."""
    if fn is None:
        return frozenset()
    try:
        params = inspect.signature(fn).parameters
        ref = inspect.signature(reference).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: assume it takes all
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset()
    return frozenset(
        name for name, p in ref.items() if p.default is not inspect.Parameter.empty and name not in params
    )
