"""One lookup for every component a plugin registers: find it by name, check that it is
available, build it, and keep the result (a failure too, with its reason).

Models, schedulers, drafters, logits processors and grammar backends are all found this way
(:class:`ComponentLookup`); what differs between them is only how a name is called in the
messages, what the factory's result must be, and how it is built into what the caller keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer_core.errors import ConfigError, PluginError
from deepinfer_core.plugins.records import ALLOW_ENV, ComponentSpec

Check = Callable[[Any, ComponentSpec], str | None]
"""``check(result, spec)``: why the factory's ``result`` is not what the kind needs, or ``None``."""


class Unusable(Exception):
    """Raised by a lookup's ``build`` when a found component cannot be used here; its message
    is kept as the failure's reason as it is (other errors of ``build`` read "failed to start")."""


def subclass_of(base: type) -> Check:
    """A :data:`Check` that the factory returned a subclass of ``base``."""

    def check(result: Any, spec: ComponentSpec) -> str | None:
        if isinstance(result, type) and issubclass(result, base):
            return None
        wanted = f"{base.__module__}.{base.__qualname__}"
        return f"(plugin {spec.plugin!r}) gave {result!r}, not a subclass of {wanted}"

    return check


class ComponentLookup:
    """Components of one kind, looked up by name, built on first use and kept.

    Args:
        plugins: the plugin manager (its ``components`` and ``clashes``).
        kind: the component kind (``models``, ``schedulers``, ``drafters``,
            ``logits_processors``, ``structured_backends``).
        label: how a name is called in messages, with ``{}`` where the name goes (quoted):
            ``"scheduler {}"`` reads ``scheduler 'fcfs'``.
        error: the exception class of a name that is unknown, unavailable or fails to build.
        hint: appended to the message of an unknown name (what would provide it).
        check: what the factory's result must be (a :data:`Check`, e.g. :func:`subclass_of`);
            a result that fails it raises ``check_error`` (default ``error``) with the reason.
        build: turns the factory's result into what is kept (default: the result itself, e.g.
            a class); an exception it raises is kept as ``"<label> failed to start: <error>"``
            (an :class:`Unusable` one with its own message).

    A name withdrawn because two plugins registered it raises a :class:`PluginError` naming
    both.  Every outcome is kept per name: a second :meth:`get` of a failed name raises the
    same error again without calling the plugin.
    """

    def __init__(
        self,
        plugins: Any,
        kind: str,
        label: str,
        *,
        error: type[Exception] = ConfigError,
        hint: str = "",
        check: Check | None = None,
        check_error: type[Exception] | None = None,
        build: Callable[[Any], Any] | None = None,
    ) -> None:
        self.plugins = plugins
        self.kind = kind
        self.label = label
        self.error = error
        self.hint = hint
        self.check = check
        self.check_error = check_error or error
        self.build = build
        self._kept: dict[str, Any] = {}  # name -> built component, or the exception to raise

    def get(self, name: str) -> Any:
        """The component ``name``, built (once); raises the kept failure when it cannot be had."""
        if name not in self._kept:
            self._kept[name] = self._make(name)
        kept = self._kept[name]
        if isinstance(kept, Exception):
            raise kept
        return kept

    def _make(self, name: str) -> Any:
        """The built component or the exception saying why there is none (not raised here)."""
        label = self.label.replace("{}", repr(name))
        clash = self.plugins.clashes.get((self.kind, name))
        if clash is not None:
            return PluginError(
                f"{label} is registered by several plugins {clash}; "
                f"uninstall one or exclude it with {ALLOW_ENV}"
            )
        registry = self.plugins.components[self.kind]
        spec = registry.get(name)
        if spec is None:
            return self.error(f"{label} is not registered (known: {sorted(registry)}){self.hint}")
        available, reason = spec.availability()
        if not available:
            return self.error(f"{label} is unavailable: {reason}")
        try:
            result = spec.factory()
        except Exception as e:  # the plugin's lazy import, typically
            return self.error(f"{label} failed to start: {type(e).__name__}: {e}")
        if self.check is not None:
            wrong = self.check(result, spec)
            if wrong is not None:
                return self.check_error(f"{label} {wrong}")
        if self.build is None:
            return result
        try:
            return self.build(result)
        except Unusable as e:
            return self.error(str(e))
        except Exception as e:
            return self.error(f"{label} failed to start: {e}")
