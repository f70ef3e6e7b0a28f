"""Resolved op tables: what the model calls at run time.

An :class:`OpTable` maps every op name to one callable, chosen once at engine start: the
backend's implementation when it provides the op, else the reference.  A fused op with a
``decomposition`` (:class:`~deepinfer_core.ops.OpSpec`) that the backend does not provide runs
as that sequence of the table's own ops instead, so the backend's kernels for the parts serve
(source ``"decomposed"``; not a fallback, so neither logged nor refused by ``strict_ops``).
When a backend implementation has a ``supports`` predicate, each call checks it and falls
back to the reference (or the decomposition) for cases it rejects (logged once per op; an
error under ``strict_ops``).
Model code calls ops as attributes: ``ops.rms_norm(x, w, eps)``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from deepinfer_core.errors import OpNotSupportedError

from .registry import OpImpl, all_ops, is_extension, unaccepted_params

logger = logging.getLogger("deepinfer.ops")


class OpTable:
    """The ops of one engine, resolved against a backend.

    Args:
        impls: the backend's op implementations by name (may be empty).
        backend: the backend name (for log and error messages).
        strict: raise :class:`OpNotSupportedError` instead of falling back to the reference.
    """

    def __init__(self, impls: Mapping[str, OpImpl], backend: str = "reference", strict: bool = False):
        specs = all_ops()
        unknown = sorted(set(impls) - set(specs))
        if unknown:
            raise OpNotSupportedError(
                f"backend {backend!r} provides ops that are not in the op contract: {unknown}; "
                f"known ops: {sorted(specs)}"
            )
        self.backend = backend
        self.strict = strict
        # op name -> "backend" | "reference" | "backend+fallback" | "decomposed"
        self.sources: dict[str, str] = {}
        self._fns: dict[str, Callable[..., Any]] = {}
        self._logged: set[Any] = set()
        missing = [
            name
            for name, spec in specs.items()
            if name not in impls and not is_extension(name) and spec.decomposition is None
        ]
        if missing and backend != "reference":
            if strict:
                raise OpNotSupportedError(
                    f"backend {backend!r} does not provide ops {missing} and strict_ops=True forbids "
                    "falling back to the reference; implement them or set strict_ops=False"
                )
            logger.warning(
                "backend %r does not provide ops %s: using the reference implementations", backend, missing
            )
        for name, spec in specs.items():
            impl = impls.get(name)
            # the sequence over this table's ops (its parts looked up per call): a decomposition
            # replaces the reference wherever the backend's kernel does not serve
            fallback = (
                spec.reference if spec.decomposition is None else functools.partial(spec.decomposition, self)
            )
            if impl is None:
                self._fns[name] = fallback
                self.sources[name] = "reference" if spec.decomposition is None else "decomposed"
            elif impl.supports is None:
                self._fns[name] = impl.fn
                self.sources[name] = "backend"
            else:
                self._fns[name] = self._guarded(name, impl, fallback)
                self.sources[name] = "backend+fallback"
            if impl is not None:
                older = unaccepted_params(impl.fn, spec.reference) | unaccepted_params(
                    impl.supports, spec.reference
                )
                if older:
                    self._fns[name] = self._compatible(name, self._fns[name], older, fallback)
        # plain instance attributes: the per-op call on the hot path is one dict lookup
        self.__dict__.update(self._fns)

    def _guarded(self, name: str, impl: OpImpl, fallback: Callable[..., Any]) -> Callable[..., Any]:
        supports = impl.supports
        assert supports is not None
        spec = all_ops()[name]
        decomposed = spec.decomposition is not None  # the parts' own kernels and checks serve
        where = "its decomposition over this table's ops" if decomposed else "the reference"

        def call(*args: Any, **kwargs: Any) -> Any:
            verdict = supports(*args, **kwargs)
            if verdict is True:
                return impl.fn(*args, **kwargs)
            reason = verdict if isinstance(verdict, str) else "case not supported"
            if self.strict and not decomposed:
                raise OpNotSupportedError(
                    f"backend {self.backend!r} rejects this case of op {name!r} ({reason}) and "
                    "strict_ops=True forbids falling back to the reference"
                )
            if name not in self._logged:
                self._logged.add(name)
                logger.warning(
                    "op %r: backend %r rejects a case (%s); using %s", name, self.backend, reason, where
                )
            return fallback(*args, **kwargs)

        call.__name__ = name
        call.__doc__ = spec.reference.__doc__
        return call

    def _compatible(
        self, name: str, fn: Callable[..., Any], older: frozenset[str], reference: Callable[..., Any]
    ) -> Callable[..., Any]:
        """``fn`` for an implementation that lacks the op's optional parameters ``older``: calls
        that give one of them run on the reference (logged once), ``None`` ones are dropped."""

        def call(*args: Any, **kwargs: Any) -> Any:
            given = sorted(k for k in older if kwargs.get(k) is not None)
            if given:
                if self.strict:
                    raise OpNotSupportedError(
                        f"backend {self.backend!r}'s op {name!r} takes no {given} (optional arguments added "
                        "to the op contract) and strict_ops=True forbids the reference; update the backend"
                    )
                if (name, "compat") not in self._logged:
                    self._logged.add((name, "compat"))
                    logger.warning(
                        "op %r: backend %r takes no %s (optional arguments of the op contract it predates); "
                        "such calls use the reference",
                        name,
                        self.backend,
                        given,
                    )
                return reference(*args, **kwargs)
            return fn(*args, **{k: v for k, v in kwargs.items() if k not in older})

        call.__name__ = name
        call.__doc__ = all_ops()[name].reference.__doc__
        return call

    @classmethod
    def reference(cls) -> OpTable:
        """A table of the pure-PyTorch reference implementations only."""
        return cls({}, backend="reference")

    def __getitem__(self, name: str) -> Callable[..., Any]:
        """The resolved callable of op ``name``, core or extension (``ops["vendor.op"]``)."""
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(f"no op {name!r}; known ops: {', '.join(sorted(self._fns))}") from None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            return self.__dict__["_fns"][name]
        except KeyError:
            raise AttributeError(f"no op {name!r} in the op contract") from None
