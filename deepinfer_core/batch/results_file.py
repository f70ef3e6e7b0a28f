"""The results file: what an earlier run finished (read on start, a torn last line cut away)
and the appending writer (one whole line per write, flushed; optionally fsynced)."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer_core.batch.id_set import IdSet
from deepinfer_core.errors import ConfigError

logger = logging.getLogger("deepinfer.batch")

LINE_START = b'{"id":'
"""How every result line starts (a torn line is cut away only when it starts so)."""

DUPLICATE_CODE = "duplicate_custom_id"
"""The error code of a line whose ``custom_id`` an earlier input line already used."""


@dataclass
class Finished:
    """What the results file already holds.

    Attributes:
        succeeded: custom ids with a result line without error.
        failed: custom ids with an error line (duplicates excepted).
        duplicates: per custom id, how many duplicate-id error lines were written.
        unnamed: error lines of input lines without a usable ``custom_id`` (written in input order).
        lines: result lines read.
    """

    succeeded: IdSet = field(default_factory=IdSet)
    failed: IdSet = field(default_factory=IdSet)
    duplicates: Counter[str] = field(default_factory=Counter)
    unnamed: int = 0
    lines: int = 0


def read_finished(path: str | os.PathLike[str]) -> Finished:
    """Scan an existing results file (streaming) and cut away a torn last line.

    A last line without its newline was being written when the run stopped: the file is
    truncated to the end of the line before it, logged in one line.

    Raises:
        ConfigError: a whole line is not a result line, or the torn last line does not start
            as one (the file is not a results file; naming the line).
    """
    done = Finished()
    p = Path(path)
    if not p.exists():
        return done
    with open(p, "rb+") as f:
        good_end = 0
        for number, raw in enumerate(f, start=1):
            whole = raw.endswith(b"\n")
            record = _parse(raw) if whole else None
            if record is None:
                if whole or not raw.startswith(LINE_START):
                    raise ConfigError(
                        f"-o {path}: line {number} is not a result line of run-batch; "
                        "give another output file"
                    )
                logger.warning(
                    "%s: line %d is incomplete (%d bytes; the previous run stopped while writing it): "
                    "removed, its request runs again",
                    path,
                    number,
                    len(raw),
                )
                f.truncate(good_end)
                break
            good_end += len(raw)
            done.lines += 1
            cid = record["custom_id"]
            error = record.get("error")
            if cid is None:
                done.unnamed += 1
            elif isinstance(error, dict) and error.get("code") == DUPLICATE_CODE:
                done.duplicates[cid] += 1
            elif error is None:
                done.succeeded.add(cid)
            else:
                done.failed.add(cid)
    return done


def _parse(raw: bytes) -> dict | None:
    """A result line's object, or ``None`` when it is not one."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict) or "custom_id" not in record:
        return None
    if record["custom_id"] is not None and not isinstance(record["custom_id"], str):
        return None
    return record


class ResultWriter:
    """Appends result lines to the results file: each line is handed to the OS in one piece and
    is on disk before the call returns with ``fsync`` (else in the OS's cache, which survives a
    killed process)."""

    def __init__(self, path: str | os.PathLike[str], fsync: bool = False):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._fsync = fsync

    def write(self, line: str) -> None:
        """Write one line (``line`` holds no newline; one is added)."""
        data = memoryview((line + "\n").encode("utf-8"))
        while data:
            data = data[os.write(self._fd, data) :]
        if self._fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
