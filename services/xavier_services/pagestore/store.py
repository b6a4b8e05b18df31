"""The store's state: namespaces, slots, leases and LRU eviction (event-loop only, no locks).

Rules the code keeps:
- A page is visible (Exists, Get) only once committed with a verified checksum.
- A pinned page (some read lease holds it) and a reserved slot (a write lease holds it) are never evicted,
  reused or freed; an expired lease unpins or frees them like a release would.
- A page's holder is the replica its committing put named (``PutPagesRequest.holder``), or none: one tuple
  per write lease, shared by its pages. A key written again (after an eviction) is a new page with the new
  writer's holder.
- A page may also stand in its holder's pool (``PutPagesRequest.holder_page_runs``): the pool page the
  holder keeps unchanged for a while after its commit, which GetPages hands to readers until that long
  after the store committed it (`standing_run`), so a reader's copy ends before the holder's hold does.
- Eviction takes the least recently used unpinned committed page. Hits touch a chain tail-first, so the
  tail of a chain is older than its head and eviction shortens chains from the end instead of cutting
  them in the middle (a prefix lookup stops at the first miss).
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from xavier_core.pagestore.layout import PageGeometry, Span
from xavier_core.runtime.errors import CapacityExhausted, FailedPrecondition, LeaseExpired, NotFound
from xavier_services.pagestore.arena import Arena, Chunk
from xavier_services.pagestore.config import PageStoreSettings

NsKey = tuple[str, bytes, int]  # contract fingerprint, SHA-256 of the cache salt, rank
Holder = tuple[str, int]  # the writing replica's directory peer id and registration epoch
Standing = tuple[list[int], float]  # a write's pool page per reserved page, and seconds they stand


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    leases_expired: int = 0
    reservations_dropped: int = 0


@dataclass(eq=False)
class Namespace:
    key: NsKey
    geometry: PageGeometry
    slots_per_chunk: int
    chunks: list[Chunk] = field(default_factory=list)
    pages: dict[bytes, Page] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    committed: int = 0
    reserved: int = 0
    pinned: int = 0
    leases: int = 0


@dataclass(eq=False)
class Page:
    ns: Namespace
    key: bytes
    chunk: Chunk
    slot: int
    committed: bool = False
    checksum: bytes = b""
    pins: int = 0
    doomed: bool = False  # dropped while pinned: freed when the last read lease on it ends
    holder: Holder | None = None  # set when committed
    holder_page: int = -1  # where it stands in its holder's pool, when its put said so (set when committed)
    stands_until: float = 0.0  # time.monotonic() until which it stands there


@dataclass(eq=False)
class Lease:
    id: str
    ns: Namespace
    write: bool
    pages: list[Page]
    expires: float  # time.monotonic()
    expire_wall: float  # time.time(), for the response
    committing: bool = False
    holder: Holder | None = None  # a write lease's writer, given to each page it commits
    standing: Standing | None = None  # its pages' pool pages in the writer's pool, and for how long


class PageStore:
    """Namespaces, pages and leases over one arena."""

    def __init__(self, settings: PageStoreSettings, arena: Arena) -> None:
        self.settings = settings
        self.arena = arena
        self.namespaces: dict[NsKey, Namespace] = {}
        self.leases: dict[str, Lease] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # lease id -> "released" | "expired" | ...
        self._lru: OrderedDict[Page, None] = OrderedDict()  # committed pages, oldest first

    # --- namespaces -------------------------------------------------------------------------------------

    def find(self, key: NsKey) -> Namespace | None:
        return self.namespaces.get(key)

    def create(self, key: NsKey, geometry: PageGeometry) -> Namespace:
        if len(self.namespaces) >= self.settings.max_namespaces:
            raise CapacityExhausted(
                f"the store tracks {len(self.namespaces)} namespaces already",
                limit=self.settings.max_namespaces,
            )
        ns = Namespace(key, geometry, self.arena.chunk_bytes // geometry.page_bytes)
        self.namespaces[key] = ns
        return ns

    # --- reads ------------------------------------------------------------------------------------------

    def hit_prefix(self, ns: Namespace, keys: Sequence[bytes]) -> list[Page]:
        hits: list[Page] = []
        for key in keys:
            page = ns.pages.get(key)
            if page is None or not page.committed:
                break
            hits.append(page)
        return hits

    def get(self, ns: Namespace, keys: Sequence[bytes], lease_s: float) -> tuple[list[Page], Lease | None]:
        hits = self.hit_prefix(ns, keys)
        ns.counters.hits += len(hits)
        ns.counters.misses += len(keys) - len(hits)
        if not hits:
            return hits, None
        lease = self._new_lease(ns, False, hits, lease_s)
        for page in reversed(hits):
            self._lru.move_to_end(page)
            page.pins += 1
            ns.pinned += page.pins == 1
        return hits, lease

    @staticmethod
    def holder_run(pages: Sequence[Page]) -> tuple[Holder | None, int]:
        """The holder of the first page and how many leading pages share it; (None, 0) when it has none."""
        first = pages[0].holder if pages else None
        if first is None:
            return None, 0
        run = 0
        for page in pages:
            if page.holder != first:
                break
            run += 1
        return first, run

    @staticmethod
    def standing_run(pages: Sequence[Page]) -> tuple[list[int], float]:
        """Where `pages` (a holder run, `holder_run`) stand in their holder's pool, and the seconds left of
        the shortest standing; ([], 0.0) unless every one of them still stands."""
        now = time.monotonic()
        ids: list[int] = []
        until = float("inf")
        for page in pages:
            if page.holder_page < 0 or page.stands_until <= now:
                return [], 0.0
            ids.append(page.holder_page)
            until = min(until, page.stands_until)
        return (ids, until - now) if ids else ([], 0.0)

    # --- writes -----------------------------------------------------------------------------------------

    def put(self, ns: Namespace, keys: Sequence[bytes], lease_s: float) -> tuple[list[int], list[Page], int]:
        """Reserves slots for the keys not stored yet; returns (indices, pages, evicted). Never raises for
        lack of room: keys that find no slot are simply not reserved (the write is best effort)."""
        self._check_lease_room()
        new = [i for i, key in enumerate(keys) if key not in ns.pages]
        indices: list[int] = []
        pages: list[Page] = []
        evicted = 0
        while len(indices) < len(new):
            got = self._take_run(ns, len(new) - len(indices))
            if got is None:
                break
            chunk, first, count, n = got
            evicted += n
            for slot, i in zip(range(first, first + count), new[len(indices) :], strict=False):
                page = Page(ns, keys[i], chunk, slot)
                ns.pages[keys[i]] = page
                ns.reserved += 1
                indices.append(i)
                pages.append(page)
        return indices, pages, evicted

    def write_lease(
        self,
        ns: Namespace,
        pages: list[Page],
        lease_s: float,
        holder: Holder | None = None,
        standing: Standing | None = None,
    ) -> Lease:
        """A write lease of `pages`; `standing`, with `holder`: each page's pool page in the holder's pool,
        and how long it stands there after the commit."""
        lease = self._new_lease(ns, True, pages, lease_s)
        lease.holder = holder
        lease.standing = standing if holder is not None else None
        return lease

    def begin_commit(self, lease_id: str) -> Lease:
        lease = self._live(lease_id)
        if not lease.write:
            raise FailedPrecondition(
                f"lease {lease_id} is a read lease", reason="WRONG_LEASE_KIND", lease_id=lease_id
            )
        if lease.committing:
            raise FailedPrecondition(
                f"lease {lease_id} is being committed", reason="LEASE_BUSY", lease_id=lease_id
            )
        lease.committing = True  # the sweeper leaves it alone while its pages are hashed off the loop
        return lease

    def finish_commit(self, lease: Lease, good: Sequence[bool]) -> tuple[int, int]:
        ns = lease.ns
        committed = 0
        ids, seconds = lease.standing or ([], 0.0)
        until = time.monotonic() + seconds
        for i, (page, ok) in enumerate(zip(lease.pages, good, strict=True)):
            ns.reserved -= 1
            if ok:
                page.committed = True
                page.holder = lease.holder
                if ids:
                    page.holder_page, page.stands_until = ids[i], until
                ns.committed += 1
                committed += 1
            else:
                ns.counters.checksum_failures += 1
                self._free(page)
        for page in reversed([p for p, ok in zip(lease.pages, good, strict=True) if ok]):
            self._lru[page] = None
        self._end(lease, "committed", drop_reserved=False)
        return committed, len(lease.pages) - committed

    # --- leases -----------------------------------------------------------------------------------------

    def release(self, lease_id: str, corrupt: Sequence[int]) -> bool:
        lease = self.leases.get(lease_id)
        if lease is None:
            ended = self._ended.get(lease_id)
            if ended == "expired":
                raise LeaseExpired(f"lease {lease_id} expired", lease_id=lease_id)
            if ended is None:
                raise NotFound(f"no lease {lease_id}", reason="LEASE_NOT_FOUND", lease_id=lease_id)
            return False
        if lease.committing:
            raise FailedPrecondition(
                f"lease {lease_id} is being committed", reason="LEASE_BUSY", lease_id=lease_id
            )
        bad = [lease.pages[i] for i in sorted(set(corrupt)) if not lease.write and i < len(lease.pages)]
        self._end(lease, "released", drop_reserved=True)
        for page in bad:
            if page.committed:
                page.ns.counters.checksum_failures += 1
                self._drop_committed(page)
        return True

    def sweep(self, now: float | None = None) -> int:
        """Ends every lapsed lease; returns how many."""
        now = time.monotonic() if now is None else now
        lapsed = [lease for lease in self.leases.values() if lease.expires <= now and not lease.committing]
        for lease in lapsed:
            lease.ns.counters.leases_expired += 1
            self._end(lease, "expired", drop_reserved=True)
        return len(lapsed)

    def live_leases(self) -> int:
        return len(self.leases)

    # --- internals --------------------------------------------------------------------------------------

    def _check_lease_room(self) -> None:
        if len(self.leases) >= self.settings.max_leases:
            raise CapacityExhausted(f"{len(self.leases)} leases are live", limit=self.settings.max_leases)

    def _new_lease(self, ns: Namespace, write: bool, pages: list[Page], lease_s: float) -> Lease:
        self._check_lease_room()
        lease = Lease(uuid.uuid4().hex, ns, write, pages, time.monotonic() + lease_s, time.time() + lease_s)
        self.leases[lease.id] = lease
        ns.leases += 1
        self.arena.wake()
        return lease

    def _live(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is not None:
            return lease
        if self._ended.get(lease_id) == "expired":
            raise LeaseExpired(f"lease {lease_id} expired", lease_id=lease_id)
        raise NotFound(f"no live lease {lease_id}", reason="LEASE_NOT_FOUND", lease_id=lease_id)

    def _end(self, lease: Lease, how: str, *, drop_reserved: bool) -> None:
        del self.leases[lease.id]
        lease.ns.leases -= 1
        self._ended[lease.id] = how
        while len(self._ended) > self.settings.idempotency_entries:
            self._ended.popitem(last=False)
        if lease.write:
            if drop_reserved:
                for page in lease.pages:
                    lease.ns.reserved -= 1
                    lease.ns.counters.reservations_dropped += 1
                    self._free(page)
            return
        for page in lease.pages:
            page.pins -= 1
            if page.pins == 0:
                lease.ns.pinned -= 1
                if page.doomed:
                    self._free(page)

    def _take_run(self, ns: Namespace, want: int) -> tuple[Chunk, int, int, int] | None:
        """Up to `want` consecutive free slots of one chunk: (chunk, first slot, count, pages evicted).

        One put's pages go to as few runs as the arena allows, since a reader's READ takes one descriptor
        per run per segment: the first free run of the namespace's chunks that holds them all, else a
        fresh chunk, else the longest free run. So a put takes a free chunk before it scatters into holes
        shorter than itself; the holes fill once the arena has no free chunk, and a page is evicted only
        when no slot is free at all."""
        evicted = 0
        while True:
            # Only chunks with enough free slots are searched (a full arena's chunks have few).
            fit = next(
                (
                    (c, r)
                    for c in ns.chunks
                    if len(c.free) >= want
                    for r in _free_runs(c.free)
                    if r[1] >= want
                ),
                None,
            )
            if fit is None and self.arena.free_chunks:
                chunk = self.arena.free_chunks.pop()
                chunk.slots = ns.slots_per_chunk
                chunk.free = list(range(chunk.slots))
                chunk.used = 0
                ns.chunks.append(chunk)
                fit = (chunk, (0, chunk.slots))
            if fit is None:
                runs = [(c, r) for c in ns.chunks if c.free for r in _free_runs(c.free)]
                fit = max(runs, key=lambda cr: cr[1][1], default=None)
            if fit is not None:
                chunk, (first, length) = fit
                count = min(want, length)
                chunk.free = [s for s in chunk.free if not first <= s < first + count]
                heapq.heapify(chunk.free)
                chunk.used += count
                return chunk, first, count, evicted
            victim = next((p for p in self._lru if p.pins == 0), None)
            if victim is None:
                return None
            victim.ns.counters.evictions += 1
            self._drop_committed(victim)
            evicted += 1

    def _drop_committed(self, page: Page) -> None:
        del self._lru[page]
        page.ns.committed -= 1
        page.committed = False
        if page.ns.pages.get(page.key) is page:
            del page.ns.pages[page.key]
        if page.pins:
            page.doomed = True  # a reader still holds it: its slot is not reused under that reader
            return
        self._free(page)

    def _free(self, page: Page) -> None:
        ns = page.ns
        if ns.pages.get(page.key) is page:
            del ns.pages[page.key]
        chunk = page.chunk
        heapq.heappush(chunk.free, page.slot)
        chunk.used -= 1
        if chunk.used == 0:
            ns.chunks.remove(chunk)
            chunk.free = []
            chunk.slots = 0
            self.arena.free_chunks.append(chunk)

    def spans(self, pages: Sequence[Page]) -> list[Span]:
        """Groups pages (in order) into spans of consecutive slots of one chunk."""
        out: list[Span] = []
        for page in pages:
            last = out[-1] if out else None
            if (
                last
                and last.chunk_address == page.chunk.address
                and last.first_slot + last.count == page.slot
            ):
                out[-1] = Span(last.chunk_address, last.chunk_slots, last.first_slot, last.count + 1)
            else:
                out.append(Span(page.chunk.address, page.chunk.slots, page.slot, 1))
        return out


def _free_runs(free: list[int]) -> list[tuple[int, int]]:
    """(first slot, length) of each run of consecutive slots in a chunk's free heap, lowest first."""
    out: list[tuple[int, int]] = []
    for slot in sorted(free):
        if out and out[-1][0] + out[-1][1] == slot:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((slot, 1))
    return out
