"""The ``cpu`` backend: availability probe and ops (the extension is built or loaded here)."""

from __future__ import annotations

from deepinfer_core.ops import OpImpl


def is_available() -> tuple[bool, str | None]:
    """``(True, None)`` when the kernels are built, or can be (a C++ compiler and Python's
    headers are present); else ``(False, reason)``.  Never compiles."""
    from deepinfer_cpu.build import unavailable_reason

    reason = unavailable_reason()
    return (reason is None), reason


def load_ops() -> dict[str, OpImpl]:
    """The op implementations over the compiled extension, compiling it first if it is not
    cached (one log line).  The ops it does not list fall back to the reference."""
    from deepinfer_cpu.build import load
    from deepinfer_cpu.ops import make_ops

    return make_ops(load())
