"""A set of strings held as 64-bit hashes: about 8 bytes per member, for the custom ids of
inputs far larger than memory would hold as Python strings."""

from __future__ import annotations

import hashlib

import numpy as np

_BATCH = 1 << 14  # members kept in a Python set before they are merged into the sorted array


def id_hash(text: str) -> int:
    """The 64-bit BLAKE2b hash of ``text`` that :class:`IdSet` stores."""
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little"
    )


class IdSet:
    """Membership of strings by their 64-bit hash (:func:`id_hash`).

    Two different strings share a hash with probability about ``m**2 / 2**65`` over ``m``
    members (3e-8 for a million); such a pair would be taken for one string.  New members go
    to a small Python set, inserted into one sorted ``uint64`` array every 16,384 additions
    (the insertion copies the array once: 16 bytes per member at that moment).
    """

    def __init__(self) -> None:
        self._recent: set[int] = set()
        self._sorted = np.empty(0, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def __contains__(self, text: str) -> bool:
        return self._has(id_hash(text))

    def _has(self, h: int) -> bool:
        if h in self._recent:
            return True
        i = int(np.searchsorted(self._sorted, np.uint64(h)))
        return i < len(self._sorted) and int(self._sorted[i]) == h

    def add(self, text: str) -> None:
        """Add ``text`` (no effect when it is a member)."""
        h = id_hash(text)
        if self._has(h):
            return
        self._recent.add(h)
        if len(self._recent) >= _BATCH:
            fresh = np.sort(np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent)))
            # one new array (a copy of the old plus the new members), no sort of the whole
            self._sorted = np.insert(self._sorted, np.searchsorted(self._sorted, fresh), fresh)
            self._recent = set()
