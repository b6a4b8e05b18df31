"""Leased lookups (`exists(lease=True)`, what SGLang's HiCache backend asks before its gets): the hits are
leased by the lookup, and a fetch of the same keys, or of a prefix of them, READs under that lease with no
GetPages call of its own, exactly; a lookup nobody fetches, a fetch of other keys, a stale answer and a
closing client all release the lookup's lease, so none is left pinning the store's pages. Such a fetch
can be made whole on the caller's thread (`fetch_here`): exact, corrupt pages dropped, a failed read a
miss, a bad allocation a caller bug, and the lease given back every way."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from tests.pagestore.support import buffers, chain, make_pool, ns_stats, page_digest, scribble
from tests.support.procs import ServiceProc
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient
from xavier_core.pagestore.client import InOrder
from xavier_core.pagestore.metrics import client_metrics
from xavier_core.transfer.common.errors import InvalidPagesError

pytestmark = pytest.mark.integration


def _leases(address: str, fp: str) -> int:
    return sum(n.leases for n in ns_stats(address, fp))


async def _until_no_lease(address: str, fp: str, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while _leases(address, fp):
        assert time.monotonic() < deadline, f"a lease of {fp} was never released"
        await asyncio.sleep(0.05)


def _get_pages_steps() -> float:
    """Fetch calls timed as a GetPages round trip so far (the client's step metric, every client here)."""
    return client_metrics().fetch_seconds.labels("get_pages")._value.get()


Pool = list[np.ndarray]


async def _setup(
    store: ServiceProc, fp: str, seed: int, n: int, settings: ClientSettings | None = None
) -> tuple[Pool, Pool, PageStoreClient, PageNamespace, list[bytes]]:
    """Pages 0..n-1 of a seeded pool written under a chain of `fp`; a reader with an empty pool."""
    pool = make_pool(seed)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), settings)
    ns, keys = PageNamespace(fp), chain(fp, "", seed, n)
    assert await writer.write(ns, keys, list(range(n))) == n
    await writer.close()
    return pool, reader_pool, reader, ns, keys


async def test_a_fetch_after_a_leased_lookup_reads_under_its_lease(store: ServiceProc) -> None:
    pool, reader_pool, reader, ns, keys = await _setup(store, "fp-looked", 81, 6)
    try:
        other = chain("fp-looked", "", 82, 2)
        assert await reader.exists(ns, [*keys, *other], lease=True) == 6
        assert _leases(store.address, "fp-looked") == 1  # the lookup leased its hits
        asked = _get_pages_steps()
        assert await reader.lookup_and_fetch(ns, [*keys, *other], list(range(20, 28))) == 6
        assert reader.counters.leased_lookups_used == 1
        assert _get_pages_steps() == asked  # no GetPages of its own
        assert page_digest(reader_pool, list(range(20, 26))) == page_digest(pool, list(range(6)))
        await reader.flush()
        assert _leases(store.address, "fp-looked") == 0  # released after the READ, as a fetch's own

        # A prefix of the looked-up keys: the lease serves it, cut to its length.
        assert await reader.exists(ns, keys, lease=True) == 6
        assert await reader.lookup_and_fetch(ns, keys[:4], list(range(30, 34))) == 4
        assert reader.counters.leased_lookups_used == 2
        assert page_digest(reader_pool, list(range(30, 34))) == page_digest(pool, list(range(4)))
        await reader.flush()
        assert _leases(store.address, "fp-looked") == 0
    finally:
        await reader.close()


async def test_a_fetch_of_other_keys_asks_the_store_and_releases_the_lookup(store: ServiceProc) -> None:
    pool, reader_pool, reader, ns, keys = await _setup(store, "fp-looked-other", 83, 5)
    try:
        assert await reader.exists(ns, keys[:3], lease=True) == 3
        # Same first key, more keys than were looked up: the store is asked again (it may hold more).
        assert await reader.lookup_and_fetch(ns, keys, list(range(40, 45))) == 5
        assert reader.counters.leased_lookups_used == 0
        assert page_digest(reader_pool, list(range(40, 45))) == page_digest(pool, list(range(5)))
        await reader.flush()
        assert _leases(store.address, "fp-looked-other") == 0
    finally:
        await reader.close()


async def test_a_lookup_nobody_fetches_is_released(store: ServiceProc) -> None:
    settings = ClientSettings(lookup_lease_seconds=0.4)  # used, and released, after 0.2 s
    _, _, reader, ns, keys = await _setup(store, "fp-looked-stale", 84, 4, settings)
    try:
        assert await reader.exists(ns, keys, lease=True) == 4
        assert _leases(store.address, "fp-looked-stale") == 1
        await _until_no_lease(store.address, "fp-looked-stale")  # released by the client, unfetched
        assert reader.counters.errors == 0
        # A fetch after that asks the store itself, and is exact.
        assert await reader.lookup_and_fetch(ns, keys, list(range(50, 54))) == 4
        assert reader.counters.leased_lookups_used == 0
    finally:
        await reader.close()


async def test_closing_releases_every_lookup_and_a_miss_leases_nothing(store: ServiceProc) -> None:
    _, _, reader, ns, keys = await _setup(store, "fp-looked-close", 85, 3)
    assert await reader.exists(ns, chain("fp-looked-close", "", 86, 3), lease=True) == 0
    assert _leases(store.address, "fp-looked-close") == 0  # nothing stored: nothing leased
    assert await reader.exists(ns, keys, lease=True) == 3
    assert await reader.exists(ns, keys[1:], lease=True) == 2
    assert _leases(store.address, "fp-looked-close") == 2
    await reader.close()
    assert _leases(store.address, "fp-looked-close") == 0


async def test_a_fetch_under_a_lookup_is_made_whole_on_the_callers_thread(store: ServiceProc) -> None:
    """`fetch_here` (what SGLang's I/O thread calls): exact pages, no GetPages, no hop to the loop; the
    lease is released and the counters kept once the loop has been handed them."""
    pool, reader_pool, reader, ns, keys = await _setup(store, "fp-here", 87, 6)
    try:
        if not reader._checks_while_reading():
            pytest.skip("the page loop is not built here")
        assert reader.fetch_here(ns, keys, InOrder(range(20, 26))) is None  # no lookup yet
        assert await reader.exists(ns, keys, lease=True) == 6
        asked = _get_pages_steps()
        got = await asyncio.to_thread(reader.fetch_here, ns, keys, InOrder(range(20, 26)))
        assert got is not None and (got.hit, got.stuck) == (6, False)
        assert page_digest(reader_pool, list(range(20, 26))) == page_digest(pool, list(range(6)))
        assert _get_pages_steps() == asked
        await reader.flush()  # the loop took the hand-off before this await resumed (posted first)
        c = reader.counters
        assert (c.leased_lookups_used, c.hit_pages, c.direct_reads, c.errors) == (1, 6, 1, 0)
        assert _leases(store.address, "fp-here") == 0
        # Read then checked, the caller's thread cannot make it: the loop's fetch does.
        reader.settings = dataclasses.replace(reader.settings, check_while_reading=False)
        assert await reader.exists(ns, keys, lease=True) == 6
        assert await asyncio.to_thread(reader.fetch_here, ns, keys, InOrder(range(20, 26))) is None
    finally:
        await reader.close()


async def test_a_fetch_here_drops_a_corrupt_page_and_a_failed_read_is_a_miss(store: ServiceProc) -> None:
    pool, reader_pool, reader, ns, keys = await _setup(store, "fp-here-bad", 88, 5)
    vandal = PageStoreClient(store.address, buffers(make_pool(89)))
    try:
        if not reader._checks_while_reading():
            pytest.skip("the page loop is not built here")
        await scribble(store.address, vandal, "fp-here-bad", keys, 2)  # page 2's checksum no longer holds
        assert await reader.exists(ns, keys, lease=True) == 5
        got = await asyncio.to_thread(reader.fetch_here, ns, keys, InOrder(range(30, 35)))
        assert got is not None and got.hit == 2
        assert page_digest(reader_pool, [30, 31]) == page_digest(pool, [0, 1])
        await reader.flush()
        assert reader.counters.corrupt_pages == 1
        (st,) = ns_stats(store.address, "fp-here-bad")
        assert st.checksum_failures == 1 and st.leases == 0  # reported with the release, then dropped

        # A read that fails (the store's arena closed under it): a miss, the store forgotten, the lease
        # given back.
        assert await reader.exists(ns, keys[:2], lease=True) == 2
        loaded = reader.conn.loaded_store()
        assert loaded is not None and loaded.arena is not None
        loaded.arena.close()
        got = await asyncio.to_thread(reader.fetch_here, ns, keys[:2], InOrder(range(40, 42)))
        assert got is not None and got.hit == 0
        await reader.flush()
        assert reader.counters.errors == 1 and reader.conn.loaded_store() is None
        assert _leases(store.address, "fp-here-bad") == 0
        # The next fetch loads the store again and reads it.
        assert await reader.lookup_and_fetch(ns, keys[:2], [44, 45]) == 2
    finally:
        await vandal.close()
        await reader.close()


async def test_a_bad_allocation_here_raises_and_gives_the_lease_back(store: ServiceProc) -> None:
    _, _, reader, ns, keys = await _setup(store, "fp-here-alloc", 90, 3)
    try:
        if not reader._checks_while_reading():
            pytest.skip("the page loop is not built here")
        assert await reader.exists(ns, keys, lease=True) == 3
        with pytest.raises(InvalidPagesError):
            reader.fetch_here(ns, keys, lambda n: [5, 5, 6][:n])  # a page twice: a caller bug
        await reader.flush()
        assert _leases(store.address, "fp-here-alloc") == 0
    finally:
        await reader.close()
