"""One error family for DeepInfer.

Every error a user can trigger is a :class:`DeepInferError` subclass whose message says
what is wrong, names the culprit (file, tensor, field, plugin, request) and, where possible,
what to do about it.  The CLI prints these messages without a traceback.
"""

from __future__ import annotations


class DeepInferError(Exception):
    """Base class of every user-facing DeepInfer error."""


class ConfigError(DeepInferError, ValueError):
    """An invalid configuration value (engine config, model config.json, CLI flag, env var)."""


class PluginError(DeepInferError):
    """A plugin failed to load, declared an incompatible API range, or clashed with another."""


class BackendError(DeepInferError):
    """An unknown or unavailable backend was selected, or an op could not be resolved."""


class OpNotSupportedError(BackendError):
    """A backend lacks an op (or rejects a case) and ``strict_ops=True`` forbids the fallback."""


class WeightLoadError(DeepInferError):
    """A checkpoint is missing, truncated, mis-shaped, of the wrong dtype, or unsafe to read."""


class SamplingParamsError(DeepInferError, ValueError):
    """An invalid sampling parameter."""


class RequestError(DeepInferError):
    """A single request cannot be served (e.g. its prompt exceeds ``max_model_len``)."""


class DistributedError(DeepInferError):
    """A distributed run failed: a rank died, a collective failed or timed out, or a worker's
    engine could not start.  The message names the rank and where its log is."""


class DeviceTimeoutError(DeepInferError):
    """The device did not finish a step's work within ``device_timeout_s`` (a hung kernel or
    device); the message says what was waited for and for how long."""


def user_error_line(exc: BaseException) -> str | None:
    """The one ``error:`` line a command prints for a failure the user caused (a
    :class:`DeepInferError`, or an ``OSError`` on a path they named), ``None`` for any other."""
    if isinstance(exc, DeepInferError):
        return f"error: {exc}"
    if isinstance(exc, OSError):  # a path the user named: unreadable, unwritable, missing
        where = f" {exc.filename}" if exc.filename else ""
        return f"error: cannot access{where}: {exc.strerror or exc}"
    return None
