"""Compile the ``cpu`` backend's C++ kernels once, cache them, and load them.

The extension is one C++ file (``csrc/kernels.cpp``) compiled with the C++ compiler (``$CXX``,
else ``c++``) against the installed torch's headers and libraries
(``torch.utils.cpp_extension``), into ``$DEEPINFER_KERNEL_CACHE/cpu-kernels-<key>/`` (default
``~/.cache/deepinfer/kernels``).  The key hashes the source, the compile command, torch's and
Python's versions and the CPU (the code is compiled for this CPU: ``-march=native``), so any
change builds a new one.  Built into a temporary file and renamed
into place: concurrent builders are safe.  ``bash scripts/setup.sh`` builds it
(``python -m deepinfer_cpu.build``); otherwise the first engine that loads the backend does,
with one log line.  Nothing is compiled while serving.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("deepinfer.cpu")

CACHE_ENV = "DEEPINFER_KERNEL_CACHE"
"""Where compiled kernels live (default ``~/.cache/deepinfer/kernels``): a variable of its own,
so that pointing ``DEEPINFER_CACHE`` (the built-in model's folder) elsewhere does not rebuild them."""
MODULE_NAME = "_deepinfer_cpu_kernels"
SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
BUILD_HINT = "python -m deepinfer_cpu.build (bash scripts/setup.sh runs it)"

_loaded: ModuleType | None = None


def compiler() -> str | None:
    """Path of the C++ compiler (``$CXX``, else ``c++``), or ``None`` when there is none."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _python_include() -> Path:
    return Path(sysconfig.get_paths()["include"])


def _compile_flags() -> list[str]:
    import torch
    from torch.utils import cpp_extension

    return [
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-march=native",  # this machine's vector width (its CPU is part of the cache key)
        "-ffp-contract=off",  # no fused multiply-add: the same bits whatever the vector width
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DTORCH_EXTENSION_NAME={MODULE_NAME}",
        *(f"-isystem{p}" for p in cpp_extension.include_paths()),
        f"-isystem{_python_include()}",
    ]


def _link_flags() -> list[str]:
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    return [
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
    ]


def _cpu_signature() -> str:
    """The CPU's model and feature flags (``-march=native`` code runs only where they match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in keep}))


def cache_dir() -> Path:
    """The folder the compiled extension of this source, torch and Python lives in."""
    import torch

    key_src = "\n".join(
        [
            SOURCE.read_text(encoding="utf-8"),
            torch.__version__,
            sys.version,
            _cpu_signature(),
            *_compile_flags(),
            *_link_flags(),
        ]
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "deepinfer" / "kernels")
    return root / f"cpu-kernels-{key}"


def library_path() -> Path:
    """The compiled extension's file (it may not exist yet)."""
    return cache_dir() / f"{MODULE_NAME}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def is_built() -> bool:
    """Whether the extension of the current source is compiled and cached."""
    return library_path().is_file()


def unavailable_reason() -> str | None:
    """Why the kernels can be neither loaded nor built here, or ``None`` (never compiles)."""
    if is_built():
        return None
    if compiler() is None:
        return (
            f"no C++ compiler found (${'CXX'} or c++) and the kernels are not built in {cache_dir()}; "
            "install g++ (e.g. apt-get install g++), then run " + BUILD_HINT
        )
    if not (_python_include() / "Python.h").is_file():
        return (
            f"Python's headers are missing ({_python_include()}/Python.h) and the kernels are not built; "
            "install them (e.g. apt-get install python3-dev), then run " + BUILD_HINT
        )
    return None


def build() -> Path:
    """Compile the extension into :func:`cache_dir` unless it is there; return its path.

    Raises:
        RuntimeError: no compiler, or the compile failed (with the compiler's last lines).
    """
    target = library_path()
    if target.is_file():
        return target
    cxx = compiler()
    if cxx is None:
        raise RuntimeError(unavailable_reason())
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".tmp-", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *_compile_flags(), str(SOURCE), "-o", tmp, *_link_flags()]
    logger.warning("compiling the cpu backend's kernels into %s (once; ~20 s)", target.parent)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
            raise RuntimeError(f"compiling {SOURCE} failed ({' '.join(cmd)}):\n{tail}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("compiled the cpu backend's kernels in %.1f s", time.perf_counter() - start)
    return target


def load() -> ModuleType:
    """The compiled extension module, built first if needed (once per process)."""
    global _loaded
    if _loaded is None:
        import torch  # noqa: F401  (the extension links against torch's loaded libraries)

        path = build()
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded = module
    return _loaded


def main() -> None:
    """``python -m deepinfer_cpu.build``: build the extension now; print its path and the time."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        path = build()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"cpu backend kernels: {path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
