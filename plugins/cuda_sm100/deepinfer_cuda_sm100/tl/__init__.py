"""TileLang kernels of the ``cuda_sm100`` backend: the second kernel language, next to Triton.

TileLang (``tilelang``, DeepSeek's kernel language) expresses what Triton cannot: wgmma with
operands in shared memory, ``cp.async`` gathers pipelined against the math, accumulators
split between warpgroups.  It is an optional extra (``pip install -e
'plugins/cuda_sm100[tilelang]'`` from a checkout); without it the Triton kernels serve every
op (:func:`tilelang_problem` says why, logged once).  Kernels are compiled once per static
configuration with the CUDA toolkit's ``nvcc`` (or the ``nvidia-cuda-nvcc`` wheel's) and kept
in TileLang's disk cache (``~/.tilelang/cache``), so a second process loads them instead of
compiling.

Importing this package imports neither TileLang nor Triton; the kernel modules do.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import logging
import os
import shutil

from .target import target_capability

INSTALL_HINT = "pip install -e 'plugins/cuda_sm100[tilelang]' (from the root of a DeepInfer checkout)"
NVCC_HINT = "without the toolkit: pip install -e 'plugins/cuda_sm100[tilelang-nvcc]', nvcc from PyPI"


def find_nvcc(homes: list[str | None]) -> str | None:
    """The nvcc TileLang would compile with, looked for where TileLang looks: on ``PATH``, under
    each of ``homes`` (toolkit roots), or in the ``nvidia-cuda-nvcc`` wheel (TileLang's ``nvcc``
    extra, for machines without the toolkit); ``None`` when there is none."""
    found = shutil.which("nvcc")
    if found is not None:
        return found
    for home in filter(None, homes):
        path = os.path.join(home, "bin", "nvcc")
        if os.path.exists(path):
            return path
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    paths = [str(f.locate()) for f in files if f.name == "nvcc"]
    return next((p for p in paths if os.path.exists(p)), None)


@functools.cache
def tilelang_problem() -> str | None:
    """``None`` when TileLang kernels can be compiled here, else why not (one line)."""
    try:
        target_capability()
    except ValueError as exc:  # the variable names a malformed capability
        return str(exc)
    if importlib.util.find_spec("tilelang") is None:
        return f"TileLang is not installed ({INSTALL_HINT})"
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    homes += sorted(glob.glob("/usr/local/cuda-*"))
    if find_nvcc(homes) is None:
        return (
            "TileLang needs the CUDA toolkit's nvcc: none on PATH, under CUDA_HOME or in /usr/local/cuda*, "
            f"and no nvidia-cuda-nvcc wheel ({NVCC_HINT})"
        )
    # an installed TileLang whose native parts do not load (a missing libz3, a mismatched tvm-ffi)
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means the Triton kernels serve
        detail = (str(exc).strip().splitlines() or [""])[0]
        return f"TileLang does not import ({type(exc).__name__}: {detail}); reinstall it: {INSTALL_HINT}"
    return None


def usable_for(op: str, fallback: str) -> bool:
    """Whether TileLang kernels may serve ``op`` here (:func:`tilelang_problem` is ``None``);
    when not, one warning per op names why and what serves instead (``fallback``, e.g. "the
    Triton kernel serves every call")."""
    problem = tilelang_problem()
    if problem is not None:
        _warn_unusable(op, problem, fallback)
    return problem is None


@functools.cache
def _warn_unusable(op: str, problem: str, fallback: str) -> None:
    logging.getLogger("deepinfer.cuda_sm100").warning("%s: %s; %s", op, problem, fallback)
