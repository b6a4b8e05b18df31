"""The reference engine's page store seam: fetch a stored prefix before admission, write pages through.

Before a prefill or generate request is queued, `fetch_prefix` takes the longest local prefix-cache hit and
asks the store for the full pages beyond it: once the store has leased the stored run it allocates pool
pages for it (a miss takes none), READs them with NIXL and registers them in the local cache, so from then
on they are ordinary cached pages (a preempted request finds them again locally). All of it runs on the
event loop; the engine thread only ever sees a request that arrives with pages, so a slow store delays its
own request and nothing else.

When a prompt is computed (engine thread), the full pages the request computed itself are retained and
handed to the client's bounded write-through queue; the reference is dropped when the client says it no
longer reads them. A generating (unified) or decoding request's output goes the same way, from the page
its prompt ends in:
every `OUTPUT_BATCH_PAGES` full pages while it runs and the rest when it finishes, so a later prompt that
holds the answer (a chat's next turn on another replica, or a request resumed after its replica died)
finds it in the store. Store trouble never fails a request: the client turns it into a miss (reads) or a
dropped or failed write, each counted and logged by the client.

A replica that shares its prefixes (`share` set) may let the pages it writes through stand: it tells the
store where they are in its pool (`PageStoreClient.write`'s `stand_s`) and keeps them referenced that
long after the write (plus `STAND_SLACK_S`), so that a replica of its host that hits them in the store
copies them straight from this pool without asking first (`PrefixSharing`). At most `stand_share` of the
pool stands at a time; a write beyond that stands nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xavier_core.engine.api import InvalidRequestError, StoreStats
from xavier_core.engine.errors import RequestAbortedError
from xavier_core.engine.request import Request
from xavier_core.engine.scheduler import Scheduler
from xavier_core.pagestore.metrics import StepClock
from xavier_core.pagestore.namespace import PageNamespace
from xavier_core.prefix_keys import page_keys
from xavier_core.transfer.common.stuck import on_success

if TYPE_CHECKING:
    from xavier_core.pagestore.client import PageStoreClient, Standing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prefix:
    """Pages matched before admission (one reference each); the last `store_pages` came from the store."""

    pages: list[int]
    store_pages: int


SharePull = Callable[[tuple[str, int], Sequence[int], str, int, list[int], "Standing | None"], Awaitable[int]]
"""`(holder, prefix token ids, cache salt, first page, local pages, where they stand in the holder's pool)
-> pages pulled`: copies pages `first page ...` of a prefix from the replica that holds them into local
pages (all of them, or it answers 0); the service's `PrefixSharing.pull`."""

OUTPUT_BATCH_PAGES = 8
"""Full output pages a running request collects before they go to the store in one write."""
STAND_SLACK_S = 1.0
"""Pages that stand are kept this much longer than the store hands them out for."""


class StoreLink:
    """One engine's use of one page store client (see the module docstring)."""

    def __init__(
        self,
        client: PageStoreClient,
        contract_fingerprint: str,
        sched: Scheduler,
        lock: threading.Lock,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.client = client
        self.fingerprint = contract_fingerprint
        self.sched = sched
        self.cache = sched.cache
        self.page_size = sched.page_size
        self._lock = lock
        self._loop = loop
        # Requests fetching their prefix (not queued yet) -> whether an abort was asked meanwhile.
        self._prefetching: dict[str, bool] = {}
        self.share: SharePull | None = None
        """Where the store names a holder of the hit pages, pulls them from it instead of READing the
        store (`handoff.share_prefixes`); None reads the store."""
        self.stand_s = 0.0
        """With `share`: how long the pages written through stand for other replicas (see the module)."""
        self.stand_limit = 0
        """Pages that may stand at once."""
        self.standing = 0
        """Pages standing now."""

    def namespace(self, cache_salt: str) -> PageNamespace:
        return PageNamespace(self.fingerprint, cache_salt)

    def stats(self) -> StoreStats:
        c = self.client.counters
        return StoreStats(c.hit_pages, c.pages_written, c.writes_dropped, c.errors)

    # --- before admission (event loop) ---------------------------------------------------------------------

    async def take_prefix(self, req: Request) -> None:
        """Gives a request not yet queued its local and stored prefix (`Scheduler.adopt_prefix`).

        The fetch runs as its own task: a caller that goes away meanwhile does not cut a NIXL READ short;
        the pages go back once the fetch ends. An abort asked meanwhile raises `RequestAbortedError`."""
        if req.chain_seed is None:
            return
        if req.id in self._prefetching:
            raise InvalidRequestError(f"request id {req.id!r} is already in use")
        self._prefetching[req.id] = False
        task = asyncio.ensure_future(self.fetch_prefix(req))
        try:
            prefix = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self.drop_result)
            raise
        except Exception:  # the client turns store trouble into misses; this is a bug, still not fatal
            log.exception("prefix fetch failed; request %s computes its whole prompt", req.id)
            prefix = Prefix([], 0)
        finally:
            aborted = self._prefetching.pop(req.id, False)
        if aborted:
            self.release(prefix.pages)
            raise RequestAbortedError(f"request {req.id} was aborted")
        with self._lock:
            self.sched.adopt_prefix(req, prefix.pages, prefix.store_pages)

    def abort(self, request_id: str) -> None:
        """Marks a request still fetching its prefix as aborted (no-op for any other request)."""
        if request_id in self._prefetching:
            self._prefetching[request_id] = True

    def is_fetching(self, request_id: str) -> bool:
        """Whether the request is fetching its prefix now."""
        return request_id in self._prefetching

    async def fetch_prefix(self, req: Request) -> Prefix:
        """The local hit, extended by the stored pages that follow it. Run it as a task nobody cancels:
        a NIXL READ may be writing into the pages until it returns."""
        if req.chain_seed is None:
            return Prefix([], 0)
        p = self.page_size
        clock = StepClock()
        with clock.step("local_match"):
            if not req.prompt_keys:
                req.prompt_keys = page_keys(req.chain_seed, req.prompt, p)
            # At least one prompt token is computed: its logits give the first output token.
            limit = (len(req.prompt) - 1) // p
            with self._lock:
                local = self.cache.match(req.prompt_keys, req.prompt, limit)
        clock.flush()
        want = req.prompt_keys[len(local) : limit]
        if not want:
            return Prefix(local, 0)
        try:
            fetched = await self._fetch(req, want, len(local))
        except BaseException:
            self.release(local)
            raise
        return Prefix(local + fetched, len(fetched))

    async def _fetch(self, req: Request, keys: list[bytes], first: int) -> list[int]:
        ns = self.namespace(req.cache_salt)
        dest: list[int] = []

        def allocate(n: int) -> list[int]:
            # Called only once the store has leased `n` hit pages: a miss takes no page of the pool
            # (no local eviction) and costs the one GetPages round trip an Exists would have.
            with self._lock:
                got = self.cache.allocate(min(n, self.cache.available()))
            dest.extend(got)
            return got

        share = self.share
        from_holder = None
        if share is not None:
            p = self.page_size

            def from_holder(
                holder: tuple[str, int], at: int, pages: list[int], stands: Standing | None
            ) -> Awaitable[int]:
                last = first + at + len(pages)
                return share(holder, req.prompt[: last * p], req.cache_salt, first + at, pages, stands)

        hit, stuck, released = 0, False, None
        try:
            got = await self.client.fetch(ns, keys, allocate, from_holder=from_holder)
            hit, stuck, released = got.hit, got.stuck, got.released
        finally:
            p = self.page_size
            clock = StepClock()
            with clock.step("register"), self._lock:
                for i in range(hit):
                    at = (first + i) * p
                    self.cache.insert(keys[i], dest[i], req.prompt[at : at + p])
                if not stuck:
                    self.cache.release(dest[hit:])
            clock.flush()
        if stuck:  # a transfer may still write into them: kept referenced, not handed out meanwhile
            self._keep_until(dest[hit:], released)
        return dest[:hit]

    def _keep_until(self, pages: list[int], released: asyncio.Future[None] | None) -> None:
        """Keeps pages a stuck transfer may still write out of use until `released` completes (for good
        without it, or if it fails)."""
        if released is None:
            log.error("page store: %d pool pages lost to a stuck READ", len(pages))
            return
        log.error("page store: %d pool pages out of use until a stuck transfer ends", len(pages))

        def lift() -> None:
            self.release(pages)
            log.info("page store: %d pool pages back in use: the stuck transfer ended", len(pages))

        on_success(released, lift)

    def release(self, pages: Sequence[int]) -> None:
        """Drops the references a prefix held (a request that never reached the scheduler)."""
        with self._lock:
            self.cache.release(pages)

    def drop_result(self, task: asyncio.Task[Prefix]) -> None:
        """Done-callback of a fetch whose request went away meanwhile: its pages go back."""
        if not task.cancelled() and task.exception() is None:
            self.release(task.result().pages)

    # --- after the prompt (engine thread, lock held) -------------------------------------------------------

    def prompt_done(self, req: Request) -> None:
        """Writes through the full prompt pages this request computed (not those it found cached)."""
        p = self.page_size
        first, last = req.cached_tokens // p, len(req.prompt) // p
        if req.chain_seed is None or first >= last or len(req.prompt_keys) < last:
            return
        self._write_pages(req, first, last)

    def output_pages(self, req: Request, final: bool) -> None:
        """Writes through a generating request's full pages past its prompt's (see the module's
        docstring); `final`: it finished, write what is left."""
        if req.chain_seed is None:
            return
        first = max(req.output_pages_written, len(req.prompt) // self.page_size)
        last = req.num_registered  # each registered page has its key in prompt_keys
        if last - first < (1 if final else OUTPUT_BATCH_PAGES):
            return
        req.output_pages_written = last
        self._write_pages(req, first, last)

    def _write_pages(self, req: Request, first: int, last: int) -> None:
        """Hands the request's pages `first:last` (full, registered) to the write-through queue."""
        keys, pages = req.prompt_keys[first:last], req.pages[first:last]
        # The pages stay referenced until the client is done reading them, even if the request ends first.
        self.cache.allocator.retain(pages)
        try:
            self._loop.call_soon_threadsafe(self._write, self.namespace(req.cache_salt), keys, pages)
        except RuntimeError:  # the event loop is closed: nobody will write
            self.cache.release(pages)

    def _write(self, ns: PageNamespace, keys: list[bytes], pages: list[int]) -> None:
        stand = self.share is not None and self.stand_s > 0 and self.standing + len(pages) <= self.stand_limit
        stand_s = self.stand_s if stand else 0.0
        self.standing += len(pages) if stand else 0

        def done(committed: int) -> None:
            if stand and committed:  # readers may copy them until `stand_s` after the commit
                self._loop.call_later(stand_s + STAND_SLACK_S, self._unstand, pages)
            else:
                self._unstand(pages) if stand else self.release(pages)

        try:
            self.client.write_through(ns, keys, pages, done=done, stand_s=stand_s)
        except Exception:  # refused before queueing (done will not be called): nothing reads the pages
            log.exception("page store write-through refused")
            self._unstand(pages) if stand else self.release(pages)

    def _unstand(self, pages: list[int]) -> None:
        self.standing -= len(pages)
        self.release(pages)
