"""Paged hybrid KV-cache bookkeeping: pages and per-sequence slots.

The cache of a hybrid-attention model has two kinds of storage (see
:mod:`deepinfer_core.models.cache_spec`): *paged* storage that grows with the sequence
(compressed KV entries, indexer keys), addressed through a per-request block table of page
ids, each page covering ``page_size`` token positions in every layer; and *per-sequence*
storage of fixed size (the sliding-window ring, the compressor's partial window and overlap
carry), addressed by a sequence slot.  This module owns only the allocation of page ids and
slots; the tensors live in the model runner.
"""

from __future__ import annotations

from deepinfer_core.errors import DeepInferError


class CacheFullError(DeepInferError):
    """No free pages or slots are left (the scheduler must wait or preempt)."""


class KVCacheManager:
    """Allocates cache pages and sequence slots.

    Args:
        num_pages: pages in the pool.
        page_size: token positions covered by one page (a multiple of every compress ratio).
        num_slots: sequence slots (``max_num_seqs``).
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any request."""
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        """Sequence slots not held by any request."""
        return len(self._free_slots)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether ``num_pages`` pages are free."""
        return num_pages <= len(self._free_pages)

    def allocate_pages(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages; raises :class:`CacheFullError` when too few are free."""
        if num_pages > len(self._free_pages):
            raise CacheFullError(f"need {num_pages} cache pages, {len(self._free_pages)} free")
        return [self._free_pages.pop() for _ in range(num_pages)]

    def free_pages(self, pages: list[int]) -> None:
        """Return pages to the pool."""
        self._free_pages.extend(reversed(pages))

    def allocate_slot(self) -> int:
        """Take a sequence slot; raises :class:`CacheFullError` when none is free."""
        if not self._free_slots:
            raise CacheFullError(f"all {self.num_slots} sequence slots are in use")
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        """Return a sequence slot."""
        self._free_slots.append(slot)

    def usage(self) -> float:
        """Fraction of pages in use."""
        return 1.0 - len(self._free_pages) / max(self.num_pages, 1)
