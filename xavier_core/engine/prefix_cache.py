"""Local prefix cache over the page allocator.

Full pages are registered under their prefix key (`xavier_core.prefix_keys`, a chain that names a page and
its whole prefix). A lookup walks the prompt's keys and confirms every hit by comparing token ids, so a key
collision can never serve wrong KV. Pages keep their key after their last reference is dropped and sit in an
LRU list; they are only evicted when the allocator runs dry (lazy eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from xavier_core.engine.api import OutOfPagesError
from xavier_core.engine.page_allocator import PageAllocator


class PrefixCache:
    """Page allocation with prefix reuse and LRU eviction of unreferenced cached pages."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with refcount 0, oldest first
        self.evictions = 0

    @property
    def num_cached(self) -> int:
        """Pages currently holding a key (referenced or not)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        """Cached pages nobody references: reclaimable on demand."""
        return len(self._lru)

    def available(self) -> int:
        """Pages that `allocate` can hand out right now (free plus evictable)."""
        return self.allocator.num_free + len(self._lru)

    def allocate(self, n: int) -> list[int]:
        """Allocates `n` pages, evicting least recently used cached pages if needed."""
        if n > self.available():
            raise OutOfPagesError(f"need {n} pages, {self.available()} available")
        while self.allocator.num_free < n:
            page, _ = self._lru.popitem(last=False)
            self._forget(page)
            self.allocator.free([page])
            self.evictions += 1
        return self.allocator.allocate(n)

    def release(self, pages: Sequence[int]) -> None:
        """Drops one reference per page; unreferenced pages go to the LRU list if cached, else are freed."""
        for page in self.allocator.release(pages):
            if page in self._key_of:
                self._lru[page] = None
            else:
                self.allocator.free([page])

    def match(self, keys: Sequence[bytes], token_ids: Sequence[int], max_pages: int) -> list[int]:
        """Returns the longest run of cached pages for the prefix, each with one reference taken."""
        pages: list[int] = []
        p = self.page_size
        for i, key in enumerate(keys[:max_pages]):
            page = self._by_key.get(key)
            if page is None or self._tokens_of[page] != tuple(token_ids[i * p : (i + 1) * p]):
                break
            pages.append(page)
        for page in pages:
            if self.allocator.refcount(page) == 0:
                del self._lru[page]
            self.allocator.retain([page])
        return pages

    def insert(self, key: bytes, page: int, tokens: Sequence[int]) -> None:
        """Registers a full, computed page under its key (no-op if the key or the page is already known)."""
        if key in self._by_key or page in self._key_of:
            return
        self._by_key[key] = page
        self._key_of[page] = key
        self._tokens_of[page] = tuple(tokens)

    def clear(self) -> None:
        """Frees every unreferenced cached page and forgets all keys."""
        while self._lru:
            page, _ = self._lru.popitem(last=False)
            self._forget(page)
            self.allocator.free([page])
        for page in list(self._key_of):
            self._forget(page)

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._by_key[key]
        del self._tokens_of[page]
