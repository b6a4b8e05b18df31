"""The page store client: fetch the longest stored prefix into local pages, write pages through.

One client per replica process. It reaches the store through one `StoreConnection` (see `connection`):
a gRPC channel, and a NIXL agent registered on the replica's KV buffers (the pool's `KvBuffer`s: one
segment per buffer, page p of buffer b at `addr + p * bytes_per_page`). Failure policy, so that the
store can only ever make a request faster:

- reads: every RPC has a deadline; a store that is down, slow or answers an error, a failed READ, or a
  page whose bytes fail their checksum ends the lookup as a (partial) miss, with a log line and a metric,
  never an exception;
- writes: `write_through` queues (bounded) and returns at once; a full queue drops the write and counts it;
- the store's NIXL endpoint is fetched once per store instance; a restarted store (new instance) is
  noticed in the next response and reloaded, and the gRPC channel reconnects by itself.

A pool on a GPU goes through `HostStaging`: NIXL and the checksums see its pinned host mirror, and pages
move between the pool and the mirror around each READ and WRITE (see `staging`). A store on this host is
read straight out of the store process's memory instead of by NIXL READs (`direct`;
`ClientSettings.same_host_reads`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
from xavier.v1 import page_store_service_pb2 as pb

from xavier_core.pagestore import native
from xavier_core.pagestore.connection import HolderStuck, StoreConnection, StorePeer, TransferStuck
from xavier_core.pagestore.layout import PageGeometry, Span, failed_pages, local_page_checksums, page_ranges
from xavier_core.pagestore.lookups import LeasedLookups
from xavier_core.pagestore.metrics import ClientCounters, StepClock, client_metrics
from xavier_core.pagestore.namespace import PageNamespace
from xavier_core.pagestore.reading import (
    Verify,
    cut_spans,
    piece_bounds,
    read_checked_in_parts,
    read_in_pieces,
)
from xavier_core.pagestore.staging import HostStaging
from xavier_core.pagestore.trouble import TroubleLog
from xavier_core.pagestore.writer import WriteQueue
from xavier_core.runtime.errors import XavierError
from xavier_core.runtime.tasks import Background
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError, PeerError
from xavier_core.transfer.common.runs import PageRun, expand
from xavier_core.transfer.common.source import page_runs_proto
from xavier_core.transfer.common.stuck import poll_until, released_when

__all__ = ["ClientSettings", "Fetched", "InOrder", "PageNamespace", "PageStoreClient"]

log = logging.getLogger(__name__)
Rows = npt.NDArray[np.uint64]
_T = TypeVar("_T")


@dataclass(frozen=True)
class ClientSettings:
    """Deadlines and bounds of one client."""

    rpc_timeout_s: float = 1.0
    """Deadline of every RPC; a slower store counts as down for that call."""
    transfer_timeout_s: float = 5.0
    """A NIXL READ or WRITE still running after this is cancelled (and the call is a miss)."""
    lease_seconds: float = 10.0
    """Lease asked for Get and Put; it must cover the transfer and the commit."""
    write_queue: int = 64
    """Queued write-throughs; more are dropped and counted."""
    staging_pages: int = 256
    """Pages of the pinned host mirror of a device pool (unused for a host pool); bounds one call's chunk."""
    stage_host_pool: bool = False
    """Pass a host pool through the mirror too: the exact path a device pool takes, on any machine."""
    read_piece_bytes: int = 0
    """A fetch's READ moves in pieces of about this many bytes (`PIECE_BYTES` is a fair size), each
    checked while the next moves (see `reading`); 0, the default: one READ per store call, checked once
    it has all landed. On an H200 host the pieces doubled a warm read's fetch (14 → 27 ms for 24 MiB:
    the mirror's per-piece copies), so they are for hosts where the check, not the copy, dominates."""
    log_interval_s: float = 30.0
    """While the store keeps failing, at most one log line per this many seconds (see `trouble`)."""
    same_host_reads: bool = True
    """Read a store on this host straight out of its process's memory, the leased pages on a few threads
    (`direct`), not with NIXL READs; the checks and staging after the read are the same. Off, or where
    that read is refused (another host, PID namespace or permission), every
    READ goes over NIXL."""
    lookup_lease_seconds: float = 2.0
    """Lease of a lookup made with `exists(lease=True)`: its hits wait, leased, for the fetch of the
    same keys, which then makes no GetPages call of its own (see `lookups`); used only while half of it
    is left, released then if nobody fetched them."""
    check_while_reading: bool = True
    """Where a store's memory is read straight into a host pool, or a GPU pool's page-major staging rows
    (`same_host_reads`, one piece), and the page loop is built (`native`), each page is checksummed right
    after its read, in the same loop, while its bytes are still in cache: one pass over memory, where
    reading all and then checking all makes two. Off: read first, then checked, as after a NIXL READ."""
    checked_read_part_bytes: int = 0
    """Such a read into a GPU pool's staging rows is made in parts of about this many bytes, each part's
    verified rows queued to the GPU while the next part is read (`reading.read_checked_in_parts`, which
    names a size: `reading.PART_BYTES`); a call of at most this many bytes, or 0 here (the default): one
    part, its rows crossing once it has all landed."""


@dataclass(frozen=True)
class Fetched:
    """What `PageStoreClient.fetch` left in the pages `allocate` gave, in the order it gave them."""

    hit: int
    """The first `hit` pages hold verified bytes of the first `hit` keys; the rest hold unspecified bytes."""
    stuck: bool
    """A timed-out READ that NIXL refused to cancel may still write into the pages past `hit`: the caller
    must not reuse them (lost to the pool, as a device pool loses the staging slots, unless `released`)."""
    released: asyncio.Future[None] | None = None
    """With `stuck`, where the transfer's end can be told (a copy from the holder): completes once it has
    ended, and the pages past `hit` may then go back into use."""


@dataclass(frozen=True)
class Standing:
    """Where a store call's hit pages stand in their holder's pool (`GetPagesResponse.holder_page_runs`):
    a copy of them must have ended by `deadline` (`time.monotonic()`), after which the holder may reuse
    them."""

    pages: list[int]
    deadline: float


FromHolder = Callable[[tuple[str, int], int, list[int], Standing | None], Awaitable[int]]
"""`(holder, index of the call's first key in the fetch's keys, local pages, where they stand) -> pages
copied`: copies a store call's hit pages from the replica that wrote them into the local pages; all of
them or 0, or raises `HolderStuck` when a failed copy was still running at its park timeout (the pages may
still change)."""


class InOrder:
    """A `fetch` allocator handing out `pages` in order (page i for key i); `handed` counts those given."""

    def __init__(self, pages: Sequence[int]) -> None:
        self.pages = list(pages)
        self.handed = 0

    def __call__(self, n: int) -> list[int]:
        out = self.pages[self.handed : self.handed + n]
        self.handed += len(out)
        return out


class _BadAllocation(InvalidPagesError):
    """`fetch`'s `allocate` gave pages outside the pool or twice: a caller bug, raised, not a miss."""


class PageStoreClient:
    """Async client of one page store for one set of local KV buffers (see the module docstring)."""

    def __init__(
        self,
        address: str,
        buffers: Sequence[KvBuffer],
        settings: ClientSettings | None = None,
        *,
        name: str | None = None,
        device_lock: threading.Lock | None = None,
        holder: tuple[str, int] | None = None,
    ) -> None:
        self.settings = settings or ClientSettings()
        self.holder = holder
        """(directory peer id, registration epoch) this replica names as the writer of every page it puts
        (`PutPagesRequest.holder`), so that readers of its host may copy them from its pool; None names
        none. Read at each put: a replica that registers again sets its new epoch here."""
        self.staging: HostStaging | None = None
        if self.settings.stage_host_pool or any(b.device != "cpu" for b in buffers):
            self.staging = HostStaging(buffers, self.settings.staging_pages, device_lock)
        # What NIXL registers and the checksums read: the pool itself, or its host mirror.
        self.buffers = self.staging.buffers if self.staging is not None else tuple(buffers)
        self.geometry = PageGeometry(tuple(b.bytes_per_page for b in buffers))
        self.conn = StoreConnection(
            address,
            self.buffers,
            name=name or f"pagestore-client-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            rpc_timeout_s=self.settings.rpc_timeout_s,
            transfer_timeout_s=self.settings.transfer_timeout_s,
            same_host_reads=self.settings.same_host_reads,
        )
        self.counters = ClientCounters()
        self._metrics = client_metrics()
        self._bases = [b.addr for b in self.buffers]
        self._num_pages = min(b.num_pages for b in buffers)
        self._writes = WriteQueue(self.write, self.settings.write_queue, self._dropped)
        self._releases = Background("pagestore-release")
        self._reapers = Background("pagestore-reap")  # stuck transfers, asked until they have ended
        self._trouble = TroubleLog(log, self.settings.log_interval_s)
        self._looked = LeasedLookups(self.settings.lookup_lease_seconds, self._release_unread)
        self._loop: asyncio.AbstractEventLoop | None = None  # the client's, once a leased lookup ran on it

    @property
    def address(self) -> str:
        """The store's gRPC address."""
        return self.conn.address

    # --- public API ---------------------------------------------------------------------------------

    async def lookup_and_fetch(
        self, namespace: PageNamespace, keys: Sequence[bytes], dest_pages: Sequence[int]
    ) -> int:
        """READs the longest stored prefix of `keys` into `dest_pages` (same length, page i for key i) and
        returns how many pages arrived verified; pages past that count hold unspecified bytes."""
        return (await self.fetch(namespace, keys, InOrder(self._check_pages(keys, dest_pages)))).hit

    async def fetch(
        self,
        namespace: PageNamespace,
        keys: Sequence[bytes],
        allocate: Callable[[int], Sequence[int]],
        *,
        from_holder: FromHolder | None = None,
    ) -> Fetched:
        """READs the longest stored prefix of `keys` into local pages that `allocate` hands out.

        Once the store has answered how many of a call's keys it holds (and leased them), `allocate(n)`
        gives up to `n` distinct local pages for the next `n` keys; fewer cut the fetch there. A miss never
        calls it, so a miss takes no local page. The caller owns every page it gave; see `Fetched` for
        which hold what. Pages `allocate` gives outside the pool, or twice, raise `InvalidPagesError`
        (a caller bug).

        With `from_holder`, a store call whose hit pages were all written by one replica (the store's
        `holder`) first asks `from_holder(holder, first key index, pages)` to copy them from that
        replica's pool into the pages; when it answers all of them, the call READs nothing (its lease is
        released unread), else the READ overwrites whatever came.
        """
        self._metrics.lookups.inc()
        hit = 0
        stuck = False
        released: asyncio.Future[None] | None = None
        given: set[int] = set()
        clock = StepClock()
        started = time.perf_counter()
        try:
            limit = self._chunk_limit()
            for at in range(0, len(keys), limit):
                chunk = list(keys[at : at + limit])
                got = await self._fetch(
                    namespace,
                    chunk,
                    lambda n: self._allocated(allocate, n, given),
                    clock,
                    at,
                    from_holder,
                )
                hit += got
                if got < len(chunk):
                    break
            self._trouble.ok()
        except _BadAllocation as exc:
            raise InvalidPagesError(str(exc)) from None
        except Exception as exc:
            # A device pool's stuck READ writes into staging slots (not lent meanwhile), not into pages; a
            # stuck copy from the holder writes into the pages in any pool.
            stuck = isinstance(exc, HolderStuck) or (isinstance(exc, TransferStuck) and self.staging is None)
            released = exc.released if stuck and isinstance(exc, TransferStuck) else None
            self.failed("get", exc)
        finally:
            clock.add("fetch", time.perf_counter() - started)
            clock.flush()
        self._count_hits(hit, len(keys))
        return Fetched(hit, stuck, released)

    def fetch_here(
        self, namespace: PageNamespace, keys: Sequence[bytes], allocate: Callable[[int], Sequence[int]]
    ) -> Fetched | None:
        """`fetch` made whole on the calling thread, with no hop to the client's event loop, where it can
        be; None where it cannot (the caller then calls `fetch`). It can be where a leased lookup answered
        `keys` (`exists(lease=True)`) from the store now loaded, read straight out of the store's memory
        into a host pool and checked as it lands (`check_while_reading`), in one store call: nothing then
        needs the loop but the lease's release and the client's counters, handed to it afterwards. Inside
        SGLang's process each hop between threads waits for the GIL behind its scheduler; this saves the
        four of a fetch (to the loop, to a worker, back, back). A READ made here ends before this returns
        (it cannot be left running), so `Fetched.stuck` is always False. May be called from any thread."""
        store = self.conn.loaded_store()
        if (
            self._loop is None
            or store is None
            or store.arena is None
            or self.staging is not None
            or not self._checks_while_reading()
            or len(keys) > self._chunk_limit()
        ):
            return None
        looked = self._looked.take(namespace, keys)
        if looked is None:
            return None
        resp = looked.resp
        if resp.store_instance != store.instance:  # a restarted store: the loop's fetch reloads it
            self._release_unread(resp.lease_id)
            return None
        clock = StepClock()
        started = time.perf_counter()
        corrupt: list[int] = []
        error: BaseException | None = None
        pages: list[int] = []
        try:
            pages = self._allocated(allocate, int(resp.hit_count), set())
            if pages:
                spans = _head(resp.spans, len(pages))
                corrupt = self._read_checked(store, spans, pages, list(resp.checksums[: len(pages)]), clock)
        except _BadAllocation as exc:
            self._release_unread(resp.lease_id)
            raise InvalidPagesError(str(exc)) from None
        except Exception as exc:
            error = exc
        finally:
            clock.add("fetch", time.perf_counter() - started)
            clock.flush()
        hit = 0 if error is not None else (corrupt[0] if corrupt else len(pages))
        self._on_loop(
            lambda: self._fetched_here(store, resp.lease_id, len(keys), len(pages), hit, corrupt, error)
        )
        return Fetched(hit, False)

    def _fetched_here(
        self,
        store: StorePeer,
        lease_id: str,
        keys: int,
        read: int,
        hit: int,
        corrupt: list[int],
        error: BaseException | None,
    ) -> None:
        """On the loop, after `fetch_here`: the lease's release, the counters and metrics a fetch keeps,
        and a failed read's trouble (its store forgotten, as `off_loop` forgets it)."""
        self._releases.start(self._release(lease_id, corrupt))
        self._metrics.lookups.inc()
        self.counters.leased_lookups_used += 1
        if read:
            self._count_reads(1, read * len(self.geometry.segment_bytes), direct=True)
        if error is not None:
            if isinstance(error, PeerError):
                self.conn.forget_store(store)
            self.failed("get", error)
        else:
            self._trouble.ok()
        self._count_corrupt(corrupt)
        self._count_hits(hit, keys)

    def _count_hits(self, hit: int, keys: int) -> None:
        """A fetch's hit and missed pages, in the counters and metrics (`fetch` and `fetch_here`)."""
        self.counters.hit_pages += hit
        self.counters.miss_pages += keys - hit
        self._metrics.hit_pages.inc(hit)
        self._metrics.miss_pages.inc(keys - hit)

    def _count_reads(self, reads: int, descriptors: int, *, direct: bool) -> None:
        """A store call's reads (direct: out of the store's memory, else NIXL READs) and their descriptors."""
        self.counters.reads += reads
        if direct:
            self.counters.direct_reads += reads
        self._metrics.reads.labels("direct" if direct else "nixl").inc(reads)
        self.counters.read_descriptors += descriptors

    def _count_corrupt(self, corrupt: Sequence[int]) -> None:
        """Fetched pages that failed their checksum (dropped: the hit ends before the first), logged and
        counted."""
        if corrupt:
            log.warning("page store: %d fetched pages failed their checksum; dropped", len(corrupt))
            self.counters.corrupt_pages += len(corrupt)
            self._metrics.corrupt_pages.inc(len(corrupt))

    async def exists(self, namespace: PageNamespace, keys: Sequence[bytes], *, lease: bool = False) -> int:
        """Length of the stored prefix of `keys` (0 when the store cannot be asked). With `lease`, the
        hits are leased for a fetch of these keys (or a prefix of them) that follows soon: it then makes no
        GetPages call of its own (`lookups`)."""
        try:
            if lease and len(keys) <= self._chunk_limit():
                return await self._leased_lookup(namespace, keys)
            resp = await self.conn.exists_pages(
                pb.ExistsPagesRequest(namespace=_ns_proto(namespace), keys=keys)
            )
            self._trouble.ok()
            return int(resp.hit_count)
        except Exception as exc:
            self.failed("exists", exc)
            return 0

    async def _leased_lookup(self, namespace: PageNamespace, keys: Sequence[bytes]) -> int:
        self._loop = asyncio.get_running_loop()
        req = self._get_pages_request(namespace, keys, self.settings.lookup_lease_seconds)
        sent = time.monotonic()
        resp = await self.conn.get_pages(req)
        self._trouble.ok()
        self._looked.put(namespace, keys, resp, sent)
        if resp.hit_count:  # the store's endpoint loaded now, so the get can be made on its caller's thread
            await self.conn.ensure_store(resp.store_instance)
        return int(resp.hit_count)

    def _get_pages_request(
        self, namespace: PageNamespace, keys: Sequence[bytes], lease_seconds: float
    ) -> pb.GetPagesRequest:
        return pb.GetPagesRequest(
            request_id=uuid.uuid4().hex,
            namespace=_ns_proto(namespace),
            keys=keys,
            segment_bytes=self.geometry.segment_bytes,
            lease_seconds=lease_seconds,
        )

    def write_through(
        self,
        namespace: PageNamespace,
        keys: Sequence[bytes],
        src_pages: Sequence[int],
        done: Callable[[int], None] | None = None,
        stand_s: float = 0.0,
    ) -> bool:
        """Queues a write of local pages `src_pages` under `keys` and returns at once.

        `done(committed_pages)` is called exactly once when the client no longer reads the source pages
        (after the write, after a failure, or at once when the queue is full): the caller keeps the pages
        unchanged until then. False means the write was dropped (queue full) and counted. `stand_s`: see
        `write`.
        """
        pages = self._check_pages(keys, src_pages)
        return self._writes.submit(namespace, list(keys), pages, done, stand_s)

    async def write(
        self, namespace: PageNamespace, keys: Sequence[bytes], src_pages: Sequence[int], stand_s: float = 0.0
    ) -> int:
        """Writes now: returns the pages newly committed (keys already stored count as nothing).

        `stand_s` > 0, with a `holder`: the store is told the pages stand in this pool that long after each
        of its commits (`PutPagesRequest.holder_page_runs`), for readers to copy them from here; the caller
        then keeps them unchanged for `stand_s` after this returns (a reader's copy ends before that)."""
        pages = self._check_pages(keys, src_pages)
        committed = 0
        try:
            limit = self._chunk_limit()
            for at in range(0, len(keys), limit):
                chunk_keys, chunk_pages = list(keys[at : at + limit]), pages[at : at + limit]
                committed += await self._put(namespace, chunk_keys, chunk_pages, stand_s)
            self._trouble.ok()
        except Exception as exc:
            self.failed("put", exc)
            self.counters.writes_failed += 1
        self.counters.pages_written += committed
        self._metrics.pages_written.inc(committed)
        return committed

    async def flush(self) -> None:
        """Waits until every queued write-through, and every lease release under way, has finished."""
        await self._writes.flush()
        await self._releases.wait()

    async def stats(self) -> pb.GetPageStoreStatsResponse:
        """The store's stats; raises `XavierError` when the store cannot answer."""
        return await self.conn.get_stats()

    async def close(self) -> None:
        """Stops the writer (queued writes are dropped), closes the channel and the NIXL agent. Pages and
        slots of transfers still stuck stay out of use."""
        await self._writes.close()
        self._looked.release_all()
        await self._releases.wait()
        await self._reapers.cancel()
        await self.conn.close()

    def _reap(self, exc: TransferStuck) -> asyncio.Future[None] | None:
        """Where a stuck transfer's end will be told (`exc.released`, set here from `exc.ended`, asked
        every `REAP_POLL_S` in a worker thread); None when nothing can tell it."""
        if exc.released is None and exc.ended is not None:
            ended = exc.ended
            exc.released = released_when(
                lambda: poll_until(lambda: asyncio.to_thread(ended)),
                self._reapers.start,
                "page store transfer",
            )
        return exc.released

    # --- one call's chunk -----------------------------------------------------------------------------

    async def _fetch(
        self,
        namespace: PageNamespace,
        keys: list[bytes],
        allocate: Callable[[int], list[int]],
        clock: StepClock,
        at: int,
        from_holder: FromHolder | None,
    ) -> int:
        # GetPages answers what Exists would and leases the hits in the same round trip (a leased lookup
        # of these keys made it already); local pages are taken only once it says there is something to read.
        looked = self._looked.take(namespace, keys)
        if looked is not None:
            resp, sent = looked.resp, looked.sent
            self.counters.leased_lookups_used += 1
        else:
            sent = time.monotonic()
            with clock.step("get_pages"):
                resp = await self.conn.get_pages(
                    self._get_pages_request(namespace, keys, self.settings.lease_seconds)
                )
        if resp.hit_count == 0:
            return 0
        corrupt: list[int] = []
        slots: list[int] = []
        try:
            with clock.step("endpoint"):
                store = await self.conn.ensure_store(resp.store_instance)
            with clock.step("allocate"):
                pages = allocate(int(resp.hit_count))
            if not pages:
                return 0
            if from_holder is not None and resp.HasField("holder") and resp.holder_pages >= len(pages):
                holder = (resp.holder.peer_id, int(resp.holder.epoch))
                stands = holder_standing(resp, len(pages), sent)
                with clock.step("holder"):
                    copied = await from_holder(holder, at, list(pages), stands)
                if copied == len(pages):
                    self.counters.holder_pages += copied
                    self._metrics.reads.labels("holder").inc()
                    return copied
            local = pages
            if self.staging is not None:
                with clock.step("stage_slots"):
                    slots = local = await self.staging.acquire(len(pages))
            direct = store.arena is not None
            rows_base = self.staging.rows_base if self.staging is not None and direct else None
            sums = list(resp.checksums[: len(pages)])
            spans = _head(resp.spans, len(pages))
            # One pass, each page checked as it lands: into a host pool, or into the staging's
            # page-major rows, from which the verified head crosses to the device (a part at a time).
            made: list[tuple[int, int]] | None = None  # a read in parts: those read, counted once it ends
            if direct and self._checks_while_reading() and (self.staging is None or rows_base is not None):
                made = []
                read = functools.partial(self._read_checked, store, spans, pages, sums, clock, slots, made)
            else:
                pieces = self._pieces(spans, local, rows_base)
                reads, descriptors = len(pieces), sum(rows.shape[0] for *_, rows in pieces)
                if rows_base is None:
                    verify = self._verifier(local, pages, sums)
                    read = functools.partial(read_in_pieces, self.conn, store, pieces, verify, clock)
                else:
                    read = functools.partial(self._read_rows, store, pieces, slots, pages, sums, clock)
                self._count_reads(reads, descriptors, direct=direct)
            try:
                corrupt = await self._off_loop(store, clock, read)
            finally:
                if made is not None:
                    segments = len(self.geometry.segment_bytes)
                    self._count_reads(len(made), sum(hi - lo for lo, hi in made) * segments, direct=True)
        except TransferStuck as exc:
            released = self._reap(exc)
            if self.staging is not None:  # NIXL may still write into them: not lent until it has ended
                await self.staging.retire(slots, until=released)
            slots = []
            raise
        finally:
            if slots and self.staging is not None:
                await self.staging.release(slots)
            # Not awaited: the pages are verified already, and a lease nobody releases expires anyway.
            self._releases.start(self._release(resp.lease_id, corrupt))
        self._count_corrupt(corrupt)
        return corrupt[0] if corrupt else len(pages)

    def _pieces(
        self, spans: list[Span], local: list[int], rows_base: int | None = None
    ) -> list[tuple[int, int, Rows]]:
        """The call's READ cut into pieces (`reading`): each piece's page range and descriptor rows, into
        `local` pages of the buffers, or, with `rows_base`, into the staging's page-major rows `local`."""
        out = []
        for lo, hi in piece_bounds(len(local), self.geometry.page_bytes, self.settings.read_piece_bytes):
            part = cut_spans(spans, lo, hi)
            if rows_base is None:
                rows = self.geometry.span_descriptors(part, self._bases, local[lo:hi])
            else:
                rows = self.geometry.row_descriptors(part, rows_base, local[lo:hi])
            out.append((lo, hi, rows))
        return out

    def _checks_while_reading(self) -> bool:
        """Whether a same-host read checks each page as it lands (`ClientSettings.check_while_reading`)."""
        s = self.settings
        return s.check_while_reading and not s.read_piece_bytes and native.available()

    def _read_checked(
        self,
        store: StorePeer,
        spans: list[Span],
        pages: list[int],
        sums: list[bytes],
        clock: StepClock,
        slots: Sequence[int] = (),
        made: list[tuple[int, int]] | None = None,
    ) -> list[int]:
        """A read out of a same-host store's memory, each page checked as it lands
        (`DirectArena.read_checked`): into the host pool's `pages`, or, behind staging, into the page-major
        rows at `slots`, whose verified head is then moved to the pool's `pages` (`HostStaging.
        checked_rows_to_pool`); a long one behind staging in parts, each part's rows moving while the next
        is read (`read_checked_in_parts`). Returns the indices of the pages that failed; each part read
        (`(lo, hi)` of the pages) is appended to `made`. Blocking: a worker thread."""
        rows = self._landing_rows(spans, pages, slots)
        parts = self._checked_parts(len(pages))
        if self.staging is not None and len(parts) > 1:
            return read_checked_in_parts(
                self.conn, store, rows, sums, self.staging, slots, pages, parts, clock, made
            )
        if made is not None:
            made.append((0, len(pages)))
        with clock.step("read_checked"):
            got = self.conn.read_checked(store, rows)
        corrupt = failed_pages(got, sums)
        self._landed(slots, pages[: corrupt[0] if corrupt else len(pages)], clock)
        return corrupt

    def _checked_parts(self, pages: int) -> list[tuple[int, int]]:
        """`(lo, hi)` of each part of a read of `pages` pages checked as it lands: parts of about
        `checked_read_part_bytes` behind staging (where the rows then cross to the device), else one."""
        if self.staging is None:
            return [(0, pages)]
        return piece_bounds(pages, self.geometry.page_bytes, self.settings.checked_read_part_bytes)

    def _landing_rows(self, spans: list[Span], pages: list[int], slots: Sequence[int]) -> Rows:
        """(pages, segments, 3) words of a same-host read of `spans`: into the host pool's `pages`, or,
        behind staging, into the page-major rows at `slots`."""
        staging = self.staging
        if staging is None:
            local = page_ranges(self.buffers, pages)[:, :, 0]
        else:
            assert staging.rows_base is not None
            local = self.geometry.row_addresses(staging.rows_base, slots)
        return self.geometry.page_descriptors(spans, local)

    def _landed(self, slots: Sequence[int], verified: list[int], clock: StepClock) -> None:
        """After a read by `_landing_rows`: behind staging, the rows at `slots` of the `verified` head
        cross to the pool's pages; a host pool holds them already."""
        if self.staging is not None:
            self.staging.checked_rows_to_pool(slots, verified, clock)

    def _read_rows(
        self,
        store: StorePeer,
        pieces: list[tuple[int, int, Rows]],
        slots: list[int],
        pages: list[int],
        sums: list[bytes],
        clock: StepClock,
    ) -> list[int]:
        """A device pool's read out of a same-host store's memory: each page lands page-major in the
        staging rows at `slots` (the read places every segment), is checked there and crosses to the
        device as it is, into a buffer of this call; the verified head is then scattered into the pool's
        `pages`. One crossing a page, where a READ into the buffer-major mirror takes three (there, to
        the device and back page-major for the check, see `HostStaging.to_pool_checked`). Returns the
        indices of the pages that failed. Blocking: a worker thread."""
        staging = self.staging
        assert staging is not None
        moved = staging.moved_rows(len(slots))

        def verify(lo: int, hi: int, piece_clock: StepClock) -> list[int]:
            return staging.check_rows(slots[lo:hi], sums[lo:hi], moved, lo, piece_clock)

        corrupt = read_in_pieces(self.conn, store, pieces, verify, clock)
        staging.rows_to_pool(moved, pages[: corrupt[0] if corrupt else len(pages)], clock)
        return corrupt

    def _verifier(self, local: list[int], pages: list[int], sums: list[bytes]) -> Verify:
        """Checks pages `lo:hi` of a call that landed in `local` (pool pages or staging slots) and, through
        a mirror, moves the verified head of them to the pool's `pages`."""

        def verify(lo: int, hi: int, clock: StepClock) -> list[int]:
            if self.staging is not None:  # checked on a page-major copy, and only the verified head moves
                return self.staging.to_pool_checked(local[lo:hi], pages[lo:hi], sums[lo:hi], clock)
            with clock.step("verify"):
                got = local_page_checksums(self.buffers, local[lo:hi])
            return failed_pages(got, sums[lo:hi])

        return verify

    async def _off_loop(self, store: StorePeer, clock: StepClock, fn: Callable[[], _T]) -> _T:
        """`conn.off_loop(store, fn)`, its hop to the worker thread and back counted as `worker`."""
        inside = [0.0]
        t = time.perf_counter()

        def timed() -> _T:
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                inside[0] = time.perf_counter() - t0

        try:
            return await self.conn.off_loop(store, timed)
        finally:
            clock.add("worker", time.perf_counter() - t - inside[0])

    async def _put(
        self, namespace: PageNamespace, keys: list[bytes], pages: list[int], stand_s: float
    ) -> int:
        req = pb.PutPagesRequest(
            request_id=uuid.uuid4().hex,
            namespace=_ns_proto(namespace),
            keys=keys,
            segment_bytes=self.geometry.segment_bytes,
            lease_seconds=self.settings.lease_seconds,
        )
        if self.holder is not None:
            req.holder.CopyFrom(pb.PageHolder(peer_id=self.holder[0], epoch=self.holder[1]))
            if stand_s > 0:
                req.holder_page_runs.extend(page_runs_proto(pages))
                req.holder_standing_seconds = stand_s
        resp = await self.conn.put_pages(req)
        if not resp.reserved_indices:
            return 0
        local = [pages[i] for i in resp.reserved_indices]
        slots: list[int] = []
        try:
            store = await self.conn.ensure_store(resp.store_instance)
            src = local
            if self.staging is not None:
                slots = src = await self.staging.acquire(len(local))
            rows = self.geometry.span_descriptors(_spans(resp.spans), self._bases, src)
            self.counters.writes += 1
            self.counters.write_descriptors += rows.shape[0]
            sums = await self.conn.off_loop(store, lambda: self._write_summed(store, rows, local, src))
        except BaseException as exc:
            if isinstance(exc, TransferStuck) and self.staging is not None:
                # NIXL may still read them: not lent until it has ended
                await self.staging.retire(slots, until=self._reap(exc))
                slots = []
            self._releases.start(self._release(resp.lease_id, []))
            raise
        finally:
            if slots and self.staging is not None:
                await self.staging.release(slots)
        commit = pb.CommitPutRequest(request_id=uuid.uuid4().hex, lease_id=resp.lease_id, checksums=sums)
        done = await self.conn.commit_put(commit)
        if done.checksum_failures:
            log.warning("page store: %d written pages failed their checksum", done.checksum_failures)
        return int(done.committed)

    def _write_summed(self, store: StorePeer, rows: Rows, pages: list[int], src: list[int]) -> list[bytes]:
        """Moves pool `pages` to staging `src` (a device pool), checksums `src` and WRITEs it; returns
        the checksums. One worker-thread hop for all of it."""
        if self.staging is not None:
            self.staging.to_host(pages, src)
        sums = local_page_checksums(self.buffers, src)
        self.conn.move("WRITE", store, rows, len(src))
        return sums

    def _chunk_limit(self) -> int:
        """Keys per call: the store's batch limit, and the host mirror's size for a device pool."""
        limit = self.conn.keys_per_call()
        # At least 1: with every slot retired, the call asks for one and is refused (a miss).
        return max(1, min(limit, self.staging.usable)) if self.staging is not None else limit

    # --- leases, counters, page checks ----------------------------------------------------------------

    def _release_unread(self, lease_id: str) -> None:
        """Releases a leased lookup's lease that no fetch took (in the background; from any thread)."""
        self._on_loop(lambda: self._releases.start(self._release(lease_id, [])))

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the client's event loop: now when called there, else soon (not waited for)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if self._loop is None or here is self._loop:
            fn()
        else:
            self._loop.call_soon_threadsafe(fn)

    async def _release(self, lease_id: str, corrupt: list[int]) -> None:
        req = pb.ReleaseLeaseRequest(request_id=uuid.uuid4().hex, lease_id=lease_id, corrupt_indices=corrupt)
        try:
            await self.conn.release_lease(req)
        except Exception as exc:  # the lease expires on its own
            self.failed("release", exc)

    def _dropped(self) -> None:
        self.counters.writes_dropped += 1
        self._metrics.writes_dropped.inc()

    def failed(self, op: str, exc: BaseException) -> None:
        """Records a store call that failed and was served as a miss: the counter, the metric
        (`errors{op,reason}`) and a rate-limited log line. Callers that gave up waiting on a call (a
        timed-out wait) record it here too."""
        reason = exc.reason if isinstance(exc, XavierError) else type(exc).__name__
        self.counters.errors += 1
        self._metrics.errors.labels(op, reason).inc()
        self._trouble.failed(op, exc)

    def _allocated(self, allocate: Callable[[int], Sequence[int]], n: int, given: set[int]) -> list[int]:
        out = [int(p) for p in allocate(n)]
        if len(out) > n:
            raise _BadAllocation(f"asked for at most {n} local pages, got {len(out)}")
        if out and (min(out) < 0 or max(out) >= self._num_pages):
            raise _BadAllocation(f"local pages must lie in 0..{self._num_pages - 1}")
        if len(set(out)) != len(out) or not given.isdisjoint(out):
            raise _BadAllocation("local pages repeat")
        given.update(out)
        return out

    def _check_pages(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[int]:
        if len(keys) != len(pages):
            raise InvalidPagesError(f"{len(keys)} keys but {len(pages)} local pages")
        out = [int(p) for p in pages]
        if out and (min(out) < 0 or max(out) >= self._num_pages):
            raise InvalidPagesError(f"local pages must lie in 0..{self._num_pages - 1}")
        if len(set(out)) != len(out):
            raise InvalidPagesError("local pages repeat")
        return out


def _spans(spans: Sequence[pb.PageSpan]) -> list[Span]:
    return [Span(s.chunk_address, s.chunk_slots, s.first_slot, s.count) for s in spans]


def _head(spans: Sequence[pb.PageSpan], pages: int) -> list[Span]:
    """The spans of the first `pages` pages (the response's spans may cover more)."""
    out: list[Span] = []
    for s in _spans(spans):
        if pages <= 0:
            break
        out.append(Span(s.chunk_address, s.chunk_slots, s.first_slot, min(s.count, pages)))
        pages -= s.count
    return out


def _ns_proto(ns: PageNamespace) -> pb.PageNamespace:
    return pb.PageNamespace(
        contract_fingerprint=ns.contract_fingerprint, cache_salt=ns.cache_salt, rank=ns.rank
    )


def holder_standing(resp: pb.GetPagesResponse, n: int, sent: float) -> Standing | None:
    """Where the first `n` holder pages of a GetPages answer stand in their holder's pool, with the
    deadline counted from when the call was `sent` (the store's clock ran no earlier); None when they do
    not stand or the answer does not cover them."""
    runs = resp.holder_page_runs
    if not runs or not resp.holder_standing_ms or sum(r.count for r in runs) != resp.holder_pages:
        return None
    try:
        pages = expand(PageRun(r.first_page, r.count) for r in resp.holder_page_runs)
    except InvalidPagesError:
        return None
    if len(pages) < n:
        return None
    return Standing(pages[:n], sent + resp.holder_standing_ms / 1e3)
