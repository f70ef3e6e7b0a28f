"""A TileLang kernel compiled while the engine runs is logged: the kernels are meant to come from
TileLang's disk cache (compiled ahead by :mod:`deepinfer_cuda_sm100.tl.precompile` or by an
earlier process), and a compile inside a step stalls it for tens of seconds without a word.

:func:`logged_compile` wraps each kernel module's ``_kernel`` builder: a build that takes longer
than :data:`COMPILE_S` compiled rather than loaded, and is logged once at WARNING with the
configuration and the time, so a long first step is explained.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger("deepinfer.cuda_sm100.tl.compile")

COMPILE_S = 2.0
"""Seconds above which a kernel's build is taken for a compile (a disk-cache load takes well
under a second; an nvcc compile of these kernels several)."""

T = TypeVar("T")


def logged_compile(module: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator for ``module``'s kernel builder (wrapped inside its ``functools.cache``): a
    build slower than :data:`COMPILE_S` is logged with its arguments."""

    def wrap(build: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(build)
        def timed(*args, **kwargs) -> T:
            start = time.perf_counter()
            kernel = build(*args, **kwargs)
            took = time.perf_counter() - start
            if took > COMPILE_S:
                config = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
                logger.warning(
                    "TileLang compiled %s(%s) in %.1f s: it was not in the disk cache; "
                    "python -m deepinfer_cuda_sm100.tl.precompile compiles the kernels ahead of use",
                    module,
                    config,
                    took,
                )
            return kernel

        return timed

    return wrap
