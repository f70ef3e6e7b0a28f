"""Whether a registered backend can run here: the skip reason of hardware tests."""

from __future__ import annotations

from deepinfer_core.errors import DeepInferError
from deepinfer_core.plugins import get_plugins


def backend_unavailable_reason(name: str) -> str | None:
    """``None`` when backend ``name`` is registered and its probe says it can run here, else
    why not (the plugin is not installed, or its probe's reason: no GPU, no driver...).

    For ``pytest.mark.skipif(reason is not None, reason=reason)`` on tests that need the
    backend's hardware: the skip then names what is missing.
    """
    try:
        spec = get_plugins().get_backend(name)
    except DeepInferError as exc:
        return str(exc)
    ok, reason = spec.is_available()
    return None if ok else (reason or f"backend {name!r} is unavailable")
