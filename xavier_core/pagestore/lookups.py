"""Lookups that lease: a lookup's GetPages answer kept for the fetch of the same keys that follows it.

SGLang's HiCache first asks whether a prompt's pages are stored (`batch_exists`, one call per batch of
keys, on its prefetch thread) and a moment later gets the same batches (`batch_get_v1`, on its I/O
thread). Made as an ExistsPages call and then a GetPages call, each batch costs two round trips to the
store, and inside SGLang's process, whose scheduler holds the GIL, a round trip costs milliseconds. GetPages
answers what ExistsPages does and leases the hits as well, so a lookup made with `lease=True` is a GetPages
call with a short lease (`ClientSettings.lookup_lease_seconds`), and its answer waits here for the fetch
of those keys: that fetch READs under the lookup's lease and makes no GetPages call of its own.

An answer is used once, by a fetch whose keys are the lookup's or a prefix of them (a fetch of other keys
releases it and asks the store itself), and only while at least half its lease is left. One nobody takes
by then, or pushed out by newer ones past `LIMIT`, is released; so is every one left when the client
closes. Answers are kept on the client's event loop and may be taken from any thread (a lock guards them):
a fetch made on the caller's own thread (`PageStoreClient.fetch_here`) takes its answer there.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xavier.v1 import page_store_service_pb2 as pb

from xavier_core.pagestore.namespace import PageNamespace

__all__ = ["LIMIT", "LeasedLookups", "Looked"]

LIMIT = 64
"""Answers kept at once: SGLang looks up a prompt's batches one after another and fetches them in order,
so a few prompts' worth is plenty; more only pin store pages nobody will read."""


@dataclass(frozen=True)
class Looked:
    """A lookup's GetPages answer: its keys, the answer, and when the call was sent (`time.monotonic()`)."""

    keys: tuple[bytes, ...]
    resp: pb.GetPagesResponse
    sent: float


class LeasedLookups:
    """The answers of leased lookups not yet fetched, by namespace and first key."""

    def __init__(self, lease_seconds: float, release: Callable[[str], None]) -> None:
        """`release(lease_id)` gives an answer's lease back; it may be called on any thread."""
        self._fresh_s = lease_seconds / 2
        self._release = release
        self._items: OrderedDict[tuple[PageNamespace, bytes], Looked] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def put(
        self, namespace: PageNamespace, keys: Sequence[bytes], resp: pb.GetPagesResponse, sent: float
    ) -> None:
        """Keeps a lookup's answer (one that leased something) for a fetch of its keys; an older answer for
        the same first key, the oldest past `LIMIT`, and this one once stale, are released."""
        if not keys or not resp.lease_id:
            return
        key = (namespace, bytes(keys[0]))
        looked = Looked(tuple(bytes(k) for k in keys), resp, sent)
        dropped = []
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                dropped.append(old)
            self._items[key] = looked
            while len(self._items) > LIMIT:
                dropped.append(self._items.popitem(last=False)[1])
        for gone in dropped:
            self._release(gone.resp.lease_id)
        asyncio.get_running_loop().call_later(self._fresh_s, self._expire, key, looked)

    def take(self, namespace: PageNamespace, keys: Sequence[bytes]) -> Looked | None:
        """The answer kept for a fetch of `keys`, with `hit_count` cut to them, or None (the fetch asks the
        store). An answer kept for the same first key that does not cover `keys`, or is stale, is released."""
        if not keys:
            return None
        with self._lock:
            looked = self._items.pop((namespace, bytes(keys[0])), None)
        if looked is None:
            return None
        wanted = tuple(bytes(k) for k in keys)
        if looked.keys[: len(wanted)] != wanted or time.monotonic() - looked.sent > self._fresh_s:
            self._release(looked.resp.lease_id)
            return None
        if looked.resp.hit_count > len(wanted):
            resp = pb.GetPagesResponse()
            resp.CopyFrom(looked.resp)
            resp.hit_count = len(wanted)
            return Looked(wanted, resp, looked.sent)
        return looked

    def release_all(self) -> None:
        """Releases every answer kept (the client is closing)."""
        with self._lock:
            left = list(self._items.values())
            self._items.clear()
        for looked in left:
            self._release(looked.resp.lease_id)

    def _expire(self, key: tuple[PageNamespace, bytes], looked: Looked) -> None:
        with self._lock:
            if self._items.get(key) is not looked:
                return
            del self._items[key]
        self._release(looked.resp.lease_id)
