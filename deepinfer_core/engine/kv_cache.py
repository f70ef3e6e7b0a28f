"""Paged hybrid KV-cache bookkeeping: pages, per-sequence slots and the prefix cache.

The cache of a hybrid-attention model has *paged* storage that grows with the sequence
(compressed KV entries, indexer keys, per-page compressor carry snapshots), addressed
through a per-request block table of page ids, each page covering ``page_size`` token
positions in every layer; and *per-sequence* storage of fixed size (the sliding-window ring,
the compressor's partial window and overlap carry), addressed by a sequence slot.  This
module owns the allocation of page ids and slots; the tensors live in the model runner.

Prefix caching (``enable_prefix_caching``): once every position of a page has been computed,
the page is registered under a chained hash of the token ids it covers and of every page
before it (``hash(previous page's hash, tokens)``), so equal prefixes map to equal chains.
Pages are reference counted; a page whose last user finished stays cached (evictable, least
recently freed first) until its memory is needed.  A new request whose leading full pages
match reuses them instead of recomputing their compressed entries, indexer keys and carry.
Never-hashed free pages are handed out before cached ones, so cached content lives as long
as possible.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from deepinfer_core.errors import DeepInferError


class CacheFullError(DeepInferError):
    """No free pages or slots are left (the scheduler must wait or preempt)."""


def page_hash(previous: int | None, tokens: Sequence[int]) -> int:
    """Chained hash of one full page: depends on the page's tokens and on every page before."""
    return hash((previous, tuple(tokens)))


class KVCacheManager:
    """Allocates cache pages (reference counted, optionally prefix cached) and sequence slots.

    Args:
        num_pages: pages in the pool.
        page_size: token positions covered by one page (a multiple of every compress ratio).
        num_slots: sequence slots (``max_num_seqs``).
        enable_prefix_caching: keep and match full pages by the hash of their token prefix.
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, enable_prefix_caching: bool = False):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # never hashed (or hash dropped)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed, unused: LRU order
        self._hash_of: dict[int, int] = {}  # page -> hash
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # page -> the tokens it covers
        self._page_of: dict[int, int] = {}  # hash -> page
        self._free_slots = list(range(num_slots - 1, -1, -1))

    # ---- pages ---------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages not held by any request (cached-but-unused pages count as free)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache (in use or evictable)."""
        return len(self._page_of)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether ``num_pages`` pages are free."""
        return num_pages <= self.num_free_pages

    def allocate_pages(self, num_pages: int) -> list[int]:
        """Take ``num_pages`` pages (evicting least recently used cached pages if needed);
        raises :class:`CacheFullError` when too few are free."""
        if num_pages > self.num_free_pages:
            raise CacheFullError(f"need {num_pages} cache pages, {self.num_free_pages} free")
        pages = []
        for _ in range(num_pages):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._forget(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free_pages(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced pages become free (cached ones stay
        matchable until evicted)."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise RuntimeError(f"page {page} freed more often than allocated")
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def _forget(self, page: int) -> None:
        h = self._hash_of.pop(page)
        del self._page_of[h]
        del self._tokens_of[page]

    # ---- prefix cache --------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """Longest run of cached full pages matching the start of ``token_ids``, covering at
        most ``max_tokens`` positions; takes a reference to each.  Returns ``(pages, hashes)``."""
        pages: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return pages, hashes
        prev: int | None = None
        p = self.page_size
        for j in range(max_tokens // p):
            tokens = tuple(token_ids[j * p : (j + 1) * p])
            h = page_hash(prev, tokens)
            page = self._page_of.get(h)
            if page is None or self._tokens_of[page] != tokens:
                break
            pages.append(page)
            hashes.append(h)
            prev = h
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
        return pages, hashes

    def register_page(self, page: int, previous: int | None, tokens: Sequence[int]) -> int:
        """Record that ``page`` holds the fully computed ``tokens`` following the prefix whose
        last page hash is ``previous``; returns the page's hash.  If an equal page is already
        cached, the existing one stays the match target."""
        h = page_hash(previous, tokens)
        if self.enable_prefix_caching and h not in self._page_of and page not in self._hash_of:
            self._page_of[h] = page
            self._hash_of[page] = h
            self._tokens_of[page] = tuple(tokens)
        return h

    # ---- slots ---------------------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        """Sequence slots not held by any request."""
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        """Take a sequence slot; raises :class:`CacheFullError` when none is free."""
        if not self._free_slots:
            raise CacheFullError(f"all {self.num_slots} sequence slots are in use")
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        """Return a sequence slot."""
        self._free_slots.append(slot)

    def usage(self) -> float:
        """Fraction of pages held by running requests."""
        return 1.0 - self.num_free_pages / max(self.num_pages, 1)
