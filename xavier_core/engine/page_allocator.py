"""Reference-counted page allocator.

A page is free (on the free list), referenced (refcount > 0) or, when the prefix cache holds its key,
cached-unreferenced: refcount 0 but not free until the cache evicts it. Pins are references held on behalf
of a request id that outlive the request (prefill results waiting for transfer, reserved decode pages).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from xavier_core.engine.api import OutOfPagesError


class PageAllocator:
    """Free list plus per-page reference counts."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self._pins: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def num_pinned(self) -> int:
        """Distinct pages held by at least one pin."""
        return len({p for pages in self._pins.values() for p in pages})

    def refcount(self, page: int) -> int:
        """Current reference count of `page`."""
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """Takes `n` pages off the free list with refcount 1, or raises OutOfPagesError."""
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Adds one reference to each page (it must not be on the free list)."""
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> list[int]:
        """Drops one reference from each page; returns the pages whose count reached zero.

        The caller decides where those go: back to the free list (`free`) or to the prefix cache.
        """
        dropped: list[int] = []
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} released more often than referenced")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                dropped.append(p)
        return dropped

    def free(self, pages: Iterable[int]) -> None:
        """Returns unreferenced pages to the free list."""
        for p in pages:
            if self._refs[p] != 0:
                raise RuntimeError(f"page {p} freed while referenced")
            self._free.append(p)

    def pin(self, owner: str, pages: list[int]) -> None:
        """Records that `owner` holds one reference on each of `pages` (taken by the caller)."""
        self._pins.setdefault(owner, []).extend(pages)

    def unpin(self, owner: str) -> list[int]:
        """Forgets the pins of `owner`; returns the pages whose reference the caller must now release."""
        return self._pins.pop(owner, [])

    def is_pinned(self, owner: str) -> bool:
        """Whether `owner` holds pins."""
        return owner in self._pins
