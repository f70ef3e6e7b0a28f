"""The CUDA target the TileLang kernels are compiled for.

On a CUDA machine it is TileLang's own choice for the current device (``target="cuda"``: a
target of that device's architecture, ``sm_90a`` on an H100 / H200).  With
:data:`ARCH_ENV` set to a compute capability (``"9.0"``), it is the target TileLang would pick on
a device of that capability, built the same way, so its kernels' disk-cache keys are the
device's: ``python -m deepinfer_cuda_sm100.tl.precompile --arch 9.0`` on a machine without that
GPU (a CPU build host with the CUDA toolkit) fills a cache that the GPU machine's processes then
load instead of compiling.  Set it only for such builds: kernels compiled for another
architecture than the running device's do not launch there.
"""

from __future__ import annotations

import os

ARCH_ENV = "DEEPINFER_TILELANG_ARCH"
"""Compute capability (``"major.minor"``) to compile the TileLang kernels for instead of the
current device's."""


def capability_problem(text: str) -> str | None:
    """Why ``text`` is not a compute capability such as ``"9.0"`` (one line), or ``None``."""
    major, dot, minor = text.partition(".")
    if dot and major.isdigit() and minor.isdigit() and int(major) >= 7:
        return None
    return f"{text!r} is not a compute capability of 7.0 or later, e.g. 9.0 (H100 / H200) or 10.0 (B200)"


def target_capability() -> tuple[int, int] | None:
    """The capability :data:`ARCH_ENV` names, or ``None`` when it is unset (the current device's
    applies); a malformed value raises ``ValueError`` naming it."""
    text = os.environ.get(ARCH_ENV, "").strip()
    if not text:
        return None
    problem = capability_problem(text)
    if problem is not None:
        raise ValueError(f"{ARCH_ENV}: {problem}")
    major, minor = text.split(".")
    return int(major), int(minor)


def cuda_target() -> str | dict:
    """``target`` of ``tilelang.compile`` for every TileLang kernel: ``"cuda"`` (the current
    device's architecture), or the architecture of :data:`ARCH_ENV`'s capability, as TileLang
    names it (``{"kind": "cuda", "arch": "sm_90a"}`` for 9.0)."""
    capability = target_capability()
    if capability is None:
        return "cuda"
    from tilelang.contrib import nvcc

    return {"kind": "cuda", "arch": f"sm_{nvcc.get_target_arch(capability)}"}
