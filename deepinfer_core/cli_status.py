"""The ``deepinfer`` command's exit statuses (see :mod:`deepinfer_core.cli`)."""

from __future__ import annotations

EXIT_REQUEST_FAILED = 1  # the engine ran, and some prompt / request failed (one error line says so)
EXIT_USAGE = 2  # bad flag, option, path, config file or environment variable
EXIT_INTERNAL = 3  # a bug in DeepInfer or a plugin; DEEPINFER_TRACEBACK=1 shows the traceback
EXIT_INTERRUPTED = 130
TRACEBACK_ENV = "DEEPINFER_TRACEBACK"
"""Set (to anything) to re-raise an internal error with its traceback instead of one line."""
