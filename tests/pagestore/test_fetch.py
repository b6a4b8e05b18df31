"""The read path's contract: local pages are taken only for leased hits, a short allocation cuts the fetch,
a bad allocation is a caller bug, a READ NIXL could not cancel marks the pages unsafe to reuse, and the
lease release the fetch does not wait for is still counted when it fails (the lease then expires)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tests.pagestore.support import buffers, chain, make_pool, ns_stats, page_digest
from tests.support.procs import ServiceProc
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient
from xavier_core.pagestore.connection import TransferStuck
from xavier_core.transfer.common.errors import InvalidPagesError
from xavier_core.transfer.common.stuck import REAP_POLL_S

pytestmark = pytest.mark.integration


async def test_a_miss_takes_no_local_page_and_a_hit_takes_exactly_its_pages(store: ServiceProc) -> None:
    pool = make_pool(31)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool))
    asked: list[int] = []

    def allocate(n: int) -> list[int]:
        asked.append(n)
        return list(range(20, 20 + n))

    try:
        ns = PageNamespace("fp-alloc")
        keys = chain("fp-alloc", "", 1, 6)
        assert (await reader.fetch(ns, keys, allocate)).hit == 0
        assert asked == []  # a miss: GetPages answered zero hits, no page was asked for
        assert await writer.write(ns, keys[:4], [0, 1, 2, 3]) == 4
        assert (await reader.fetch(ns, keys, allocate)).hit == 4
        assert asked == [4]  # only the stored prefix, once the store has leased it
        assert page_digest(reader_pool, [20, 21, 22, 23]) == page_digest(pool, [0, 1, 2, 3])
        assert reader.counters.hit_pages == 4 and reader.counters.miss_pages == 6 + 2
    finally:
        await writer.close()
        await reader.close()


async def test_a_short_allocation_cuts_the_fetch_and_a_bad_one_raises(store: ServiceProc) -> None:
    pool = make_pool(32)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool))
    try:
        ns = PageNamespace("fp-short")
        keys = chain("fp-short", "", 2, 5)
        assert await writer.write(ns, keys, [0, 1, 2, 3, 4]) == 5
        # The local pool has room for two pages only: those two arrive, verified, and the lease ends.
        assert (await reader.fetch(ns, keys, lambda n: [40, 41])).hit == 2
        assert page_digest(reader_pool, [40, 41]) == page_digest(pool, [0, 1])
        assert (await reader.fetch(ns, keys, lambda n: [])).hit == 0
        with pytest.raises(InvalidPagesError):
            await reader.fetch(ns, keys, lambda n: [10**6] * n)
        with pytest.raises(InvalidPagesError):
            await reader.fetch(ns, keys, lambda n: [7] * n)
        await reader.flush()
        (st,) = ns_stats(store.address, "fp-short")
        assert st.leases == 0 and st.pinned_pages == 0  # every lease above was released
    finally:
        await writer.close()
        await reader.close()


async def test_a_failed_release_is_counted_and_the_lease_expires(store: ServiceProc) -> None:
    pool = make_pool(33)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), ClientSettings(lease_seconds=0.5))
    try:
        ns = PageNamespace("fp-norelease")
        keys = chain("fp-norelease", "", 3, 3)
        assert await writer.write(ns, keys, [0, 1, 2]) == 3
        await reader.exists(ns, keys)  # opens the channel
        assert reader.conn._stub_ is not None

        async def lost(*_a: object, **_k: object) -> None:  # the release never reaches the store
            await asyncio.sleep(0.01)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "lost"
            )

        reader.conn._stub_.ReleaseLease = lost
        errors = reader.counters.errors
        assert (await reader.fetch(ns, keys, lambda n: list(range(10, 10 + n)))).hit == 3
        assert page_digest(reader_pool, [10, 11, 12]) == page_digest(pool, [0, 1, 2])
        await reader.flush()
        assert reader.counters.errors == errors + 1
        (st,) = ns_stats(store.address, "fp-norelease")
        assert st.leases == 1 and st.pinned_pages == 3  # still pinned: nobody released it
        for _ in range(100):
            (st,) = ns_stats(store.address, "fp-norelease")
            if st.leases == 0:
                break
            await asyncio.sleep(0.05)
        assert st.leases == 0 and st.pinned_pages == 0 and st.leases_expired == 1
    finally:
        await writer.close()
        await reader.close()


READ_THEN_CHECKED = ClientSettings(check_while_reading=False)
"""A reader whose READ is posted and then waited for (`StoreConnection.settle`), where a NIXL READ can end
stuck; a same-host read checked as it lands is one call that cannot."""


async def test_a_read_nixl_could_not_cancel_marks_the_pages_unsafe(
    store: ServiceProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = make_pool(34)
    writer = PageStoreClient(store.address, buffers(pool))
    pools = [make_pool(None), make_pool(None)]  # held: the READs land in their memory
    reader = PageStoreClient(store.address, buffers(pools[0]), READ_THEN_CHECKED)
    staged = PageStoreClient(
        store.address, buffers(pools[1]), ClientSettings(stage_host_pool=True, check_while_reading=False)
    )
    try:
        ns = PageNamespace("fp-stuck")
        keys = chain("fp-stuck", "", 4, 3)
        assert await writer.write(ns, keys, [0, 1, 2]) == 3

        for client in (reader, staged):
            real = client.conn.settle

            def stuck(*a: Any, real: Any = real) -> None:  # what NIXL refusing to cancel a late READ raises
                real(*a)
                raise TransferStuck("READ still in flight")

            monkeypatch.setattr(client.conn, "settle", stuck)
        got = await reader.fetch(ns, keys, lambda n: list(range(10, 10 + n)))
        assert got.hit == 0 and got.stuck  # the pool pages may still change: the caller must drop them
        got = await staged.fetch(ns, keys, lambda n: list(range(10, 10 + n)))
        assert got.hit == 0 and not got.stuck  # a staged READ lands in slots, which are kept out instead
        assert staged.staging is not None and len(staged.staging._free) == staged.staging.slots - 3
        assert reader.counters.errors == 1 and staged.counters.errors == 1
        assert got.released is None  # nothing can tell this READ's end: lost for good
    finally:
        for c in (writer, reader, staged):
            await c.close()


async def test_a_stuck_read_whose_end_can_be_told_gives_its_pages_and_slots_back(
    store: ServiceProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A READ NIXL refused to cancel is asked again (`TransferStuck.ended`) until it has ended: the fetch
    reports where that is told (`Fetched.released`), and a staged client's slots come back then."""
    pool = make_pool(34)
    writer = PageStoreClient(store.address, buffers(pool))
    pools = [make_pool(None), make_pool(None)]
    reader = PageStoreClient(store.address, buffers(pools[0]), READ_THEN_CHECKED)
    staged = PageStoreClient(
        store.address, buffers(pools[1]), ClientSettings(stage_host_pool=True, check_while_reading=False)
    )
    asked = {"reader": 0, "staged": 0}
    try:
        ns = PageNamespace("fp-stuck-ends")
        keys = chain("fp-stuck-ends", "", 4, 3)
        assert await writer.write(ns, keys, [0, 1, 2]) == 3
        for name, client in (("reader", reader), ("staged", staged)):
            real = client.conn.settle

            def ended(name: str = name) -> bool:  # NIXL lets go at the second ask
                asked[name] += 1
                return asked[name] >= 2

            def stuck(*a: Any, real: Any = real, ended: Any = ended) -> None:
                real(*a)
                raise TransferStuck("READ still in flight", ended)

            monkeypatch.setattr(client.conn, "settle", stuck)
        got = await reader.fetch(ns, keys, lambda n: list(range(10, 10 + n)))
        assert got.hit == 0 and got.stuck and got.released is not None
        await asyncio.wait_for(got.released, 10 * REAP_POLL_S)
        assert asked["reader"] == 2
        got = await staged.fetch(ns, keys, lambda n: list(range(10, 10 + n)))
        assert got.hit == 0 and not got.stuck
        staging = staged.staging
        assert staging is not None and staging.usable == staging.slots - 3
        for _ in range(100):  # the slots come back once the second ask says the READ ended
            if staging.usable == staging.slots:
                break
            await asyncio.sleep(0.1)
        assert staging.usable == staging.slots and len(staging._free) == staging.slots
    finally:
        for c in (writer, reader, staged):
            await c.close()
