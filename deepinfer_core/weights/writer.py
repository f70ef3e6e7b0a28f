"""Write safetensors files with ordinary permissions (the format-generic part of writing a
checkpoint; a family's own writer, e.g. :mod:`deepinfer_core.models.deepseek_v4.writer`, names
and quantises the tensors).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write one safetensors file with the permissions of any other new file
    (:func:`set_ordinary_mode`; safetensors itself creates it ``0600`` through a temporary file)."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    set_ordinary_mode(Path(path))


def set_ordinary_mode(path: Path) -> None:
    """Give ``path`` the permissions a newly created file (``0666``) or directory (``0777``)
    gets under the process umask: ``0644`` / ``0755`` under the usual ``022``.  The policy of
    every checkpoint file and directory DeepInfer writes, and of its tiny-model cache."""
    base = 0o777 if path.is_dir() else 0o666
    path.chmod(base & ~process_umask())


def process_umask() -> int:
    """The process umask, read without changing it where the OS tells it (``/proc``); else
    set to ``022`` for an instant and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
