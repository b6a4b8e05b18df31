"""Host pages that a page store READ may still write, kept out of SGLang's host pool until it has ended.

SGLang lends `batch_get_v1` pages of its host pool; pages the call reports missing are freed
(`mem_pool_host.free`) and lent to other requests. A READ that outlives the call (the wait for it timed
out), or one NIXL refused to cancel (`Fetched.stuck`), may still write into them. `HostQuarantine` wraps
the pool's `free` (and `clear`, SGLang's cache flush) so that pages under a hold stay allocated when SGLang
frees them; lifting the hold (the READ ended) frees them then. A stuck READ's pages are kept
(`lift(hold, keep)`) and counted (`lost_tokens`) while NIXL still holds the READ: for good when nothing can
report its end, else until the page store client sees it end (`restore`), as the reference engine keeps its
pool pages.

The wrappers take the pool's own lock (SGLang's `free` and `clear` are synchronised on it) only through
the original methods, and this module's lock is never held while calling them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Hold", "HostQuarantine"]


class Hold:
    """The token indices of one READ's pages, under quarantine until lifted or kept."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tuple(tokens)
        self.open = True


class HostQuarantine:
    """Holds on token indices of SGLang host pool `pool` (see the module docstring)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._held: collections.Counter[int] = collections.Counter()
        self._withheld: set[int] = set()  # held indices that SGLang freed: freed for real when lifted
        self.lost_tokens = 0
        self._free: Callable[[Any], int] = pool.free
        self._clear: Callable[[], None] = pool.clear
        pool.free = self._guarded_free
        pool.clear = self._guarded_clear

    @property
    def held_tokens(self) -> int:
        """Token indices under a hold now (kept ones included)."""
        with self._lock:
            return len(self._held)

    def hold(self, tokens: Sequence[int]) -> Hold:
        """Puts `tokens` (allocated host indices) under a hold until `lift` or `keep`."""
        hold = Hold(tokens)
        with self._lock:
            self._held.update(hold.tokens)
        return hold

    def restore(self, kept: Sequence[int]) -> None:
        """Ends the keep of a stuck READ's indices (`lift(hold, keep)`): its READ has ended."""
        with self._lock:
            self.lost_tokens -= len(kept)
        self.lift(Hold(kept))

    def lift(self, hold: Hold, keep: Sequence[int] = ()) -> None:
        """Ends `hold`, except for the indices in `keep` (a stuck READ's pages: kept until `restore`). Indices
        SGLang freed meanwhile are freed now. Idempotent."""
        kept = set(keep)
        release: list[int] = []
        with self._lock:
            if not hold.open:
                return
            hold.open = False
            for t in hold.tokens:
                if t in kept:
                    continue
                self._held[t] -= 1
                if self._held[t] <= 0:
                    del self._held[t]
                    if t in self._withheld:
                        self._withheld.discard(t)
                        release.append(t)
            self.lost_tokens += len(kept)
        if release:
            import torch

            self._free(torch.tensor(release, dtype=torch.int64))

    def _guarded_free(self, indices: Any) -> int:
        flat = [int(i) for i in indices.reshape(-1).tolist()]
        with self._lock:
            held = [i for i in flat if i in self._held]
            self._withheld.update(held)
        if held:
            import torch

            kept = set(held)
            self._free(torch.tensor([i for i in flat if i not in kept], dtype=torch.int64))
            return len(flat)
        return self._free(indices)

    def _guarded_clear(self) -> None:
        """SGLang's flush makes every slot free again: held ones are taken back out."""
        self._clear()
        with self._lock:
            held = sorted(self._held)
            self._withheld.update(held)
        if not held:
            return
        import torch

        pool = self._pool
        taken = torch.tensor(held, dtype=torch.int64)
        with pool.lock:
            pool.free_slots = pool.free_slots[~torch.isin(pool.free_slots, taken)]
            if hasattr(pool, "slot_used"):
                pool.slot_used[taken] = True
