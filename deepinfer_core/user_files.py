"""Files a user names on a command line: read one as text, check before a long run that one can
be written; a path that fails is one :class:`~deepinfer_core.errors.ConfigError` line naming the
flag, the path and why."""

from __future__ import annotations

import os
from pathlib import Path

from deepinfer_core.errors import ConfigError


def read_text_file(flag: str, path: str | Path) -> str:
    """The UTF-8 text of the file a command-line ``flag`` names; a one-line :class:`ConfigError`
    naming flag, path and reason when it cannot be read (missing, a folder, not UTF-8...)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError, ValueError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ConfigError(f"{flag} {path}: cannot read the file ({reason})") from None


def check_writable(path: str | Path, flag: str) -> None:
    """Fail early (before a long run) when ``path`` cannot be written: its folder is missing or
    read-only, or it names a folder."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file path")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable")
