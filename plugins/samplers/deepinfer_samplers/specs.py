"""What the grammar backends share about a ``StructuredOutputsParams`` spec: its JSON schema as
canonical text, the key its compiled grammar is cached under, and the LRU cache of compiled
grammars (:class:`GrammarCache`)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class CacheInfo:
    """The compiled-grammar cache's counters (:meth:`GrammarCache.cache_info`).

    Attributes:
        hits: ``matcher`` calls answered from the cache (a valid spec's compiled grammar or an
            invalid spec's cached error).
        misses: calls that compiled (including every call while the cache is disabled).
        size: entries held now (valid and invalid specs).
        maxsize: the bound (:attr:`GrammarCache.cache_size`); ``0`` disables the cache.
    """

    hits: int
    misses: int
    size: int
    maxsize: int


class GrammarCache:
    """A thread-safe LRU cache of compiled grammars, the base of the grammar backends.

    Attributes:
        cache_size: how many compiled specs the cache keeps (default :data:`DEFAULT_CACHE_SIZE`);
            set it at any time, ``0`` disables caching.  Lowering it evicts the least recently
            used entries on the next :meth:`compiled` call.
    """

    def __init__(self) -> None:
        self.cache_size = DEFAULT_CACHE_SIZE
        # key -> a compiled grammar, or the error message (str) of an invalid spec
        self._cache: OrderedDict[tuple[str, ...], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def compiled(self, key: tuple[str, ...], compile_spec: Callable[[], Any]) -> Any:
        """The entry of ``key``: from the cache, else ``compile_spec()`` (run outside the lock:
        the backends drop the GIL while compiling) stored under it.  Raises :class:`ValueError`
        with the message of an invalid spec (cached like a valid one)."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self._hits += 1
            else:
                self._misses += 1
            self._evict()
        if entry is None:
            entry = compile_spec()
            with self._lock:
                if self.cache_size > 0:
                    self._cache[key] = entry
                    self._cache.move_to_end(key)
                self._evict()
        if isinstance(entry, str):
            raise ValueError(entry)
        return entry

    def cache_info(self) -> CacheInfo:
        """The cache's hit / miss counters, its size and bound."""
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache), self.cache_size)

    def cache_clear(self) -> None:
        """Drop every cached grammar and reset the counters."""
        with self._lock:
            self._cache.clear()
            self._hits = self._misses = 0

    def _evict(self) -> None:
        """Drop least recently used entries over :attr:`cache_size` (under the lock)."""
        while len(self._cache) > max(self.cache_size, 0):
            self._cache.popitem(last=False)


def json_text(schema: dict[str, Any] | str, backend: str) -> str:
    """``schema`` as compact JSON text, its key order kept (the backends emit an object's
    properties in the schema's order, so reordering keys would change the grammar); a str that
    is not valid JSON is returned unchanged (the compile reports it).  Raises
    :class:`ValueError`, naming ``backend``, for a dict that is not JSON-serialisable."""
    if isinstance(schema, str):
        try:
            return json.dumps(json.loads(schema), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except ValueError:
            return schema
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{backend}: the JSON schema is not JSON-serialisable: {e}") from None


def cache_key(spec: Any, json_options: Any, backend: str) -> tuple[str, ...]:
    """The canonical cache key of ``spec``: its kind and canonical text, plus for JSON the
    backend's whitespace options ``json_options`` (any JSON-able value); ``json=dict`` and
    ``json=`` its JSON text share a key."""
    if spec.choice is not None:
        return ("choice", json.dumps(list(spec.choice)))
    if spec.regex is not None:
        return ("regex", spec.regex)
    if spec.grammar is not None:
        return ("grammar", spec.grammar)
    return ("json", json_text(spec.json, backend), json.dumps(json_options, sort_keys=True))
