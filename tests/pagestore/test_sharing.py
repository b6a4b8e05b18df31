"""Pages written by one client process are read, bitwise, by another; namespaces and salts never mix."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.pagestore.support import (
    buffers,
    chain,
    client_process,
    make_pool,
    ns_stats,
    page_digest,
)
from tests.support.procs import ServiceProc
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient

pytestmark = pytest.mark.integration

SRC = [3, 4, 5, 6, 20, 21, 40, 9, 10, 11, 12, 63]
DST = [0, 1, 2, 30, 31, 32, 33, 50, 51, 52, 7, 8]


def test_put_then_get_across_two_processes_is_bitwise(store: ServiceProc) -> None:
    ns = ("fp-share", "tenant-a", 0)
    keys = chain("fp-share", "tenant-a", 1, len(SRC))
    with client_process(store.address, seed=1) as a, client_process(store.address, seed=None) as b:
        assert a.call("write", ns, keys, SRC) == len(SRC)
        assert a.call("write", ns, keys, SRC) == 0  # already stored: nothing to write again
        hit, digests = b.call("fetch", ns, keys, DST)
        assert hit == len(SRC)
        assert digests == page_digest(make_pool(1), SRC)
        # A longer chain with the same head hits only the stored prefix.
        longer = chain("fp-share", "tenant-a", 1, len(SRC) + 3)
        hit, _ = b.call("fetch", ns, longer, [*DST, 60, 61, 62])
        assert hit == len(SRC)
    (got,) = ns_stats(store.address, "fp-share")
    assert got.pages == len(SRC) and got.bytes == len(SRC) * 4 * 2048
    assert got.hits == 2 * len(SRC) and got.misses == 3


async def test_salt_and_namespace_isolation(store: ServiceProc) -> None:
    pool = make_pool(2)
    client = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool))
    try:
        home = PageNamespace("fp-iso", "salt-1")
        keys = chain("fp-iso", "salt-1", 5, 6)
        assert await client.write(home, keys, list(range(6))) == 6
        # Same raw keys under another salt, fingerprint or rank: never served (I5).
        for other in (
            PageNamespace("fp-iso", "salt-2"),
            PageNamespace("fp-iso-b", "salt-1"),
            PageNamespace("fp-iso", "salt-1", rank=1),
            PageNamespace("fp-iso", ""),
        ):
            assert await reader.exists(other, keys) == 0
            assert await reader.lookup_and_fetch(other, keys, list(range(10, 16))) == 0
        # Keys of the same tokens chained under another salt miss in the home namespace too.
        assert await reader.lookup_and_fetch(home, chain("fp-iso", "salt-2", 5, 6), list(range(6))) == 0
        assert await reader.lookup_and_fetch(home, keys, list(range(10, 16))) == 6
        assert page_digest(reader_pool, list(range(10, 16))) == page_digest(pool, list(range(6)))
    finally:
        await client.close()
        await reader.close()


def test_eight_concurrent_clients_put_and_get(store: ServiceProc) -> None:
    ns = ("fp-eight", "", 0)
    shared, own = 4, 8
    pages = list(range(shared + own))

    def keys_of(i: int) -> list[bytes]:
        # Every client's prompt starts with the same shared prefix, then its own pages.
        return chain("fp-eight", "", 0, shared) + chain("fp-eight", "", 100 + i, shared + own)[shared:]

    def one(i: int) -> list[tuple[int, bool]]:
        results = []
        with client_process(store.address, seed=10 + i, shared=shared) as c:
            assert c.call("write", ns, keys_of(i), pages) <= len(pages)
            # A shared page another client reserved first is skipped here; wait for its commit.
            deadline = time.monotonic() + 30
            while c.call("exists", ns, keys_of(i)) < len(pages):
                assert time.monotonic() < deadline, "the shared prefix was never committed"
                time.sleep(0.05)
            for j in (i, (i + 1) % 8, (i + 5) % 8):
                hit, digests = c.call("fetch", ns, keys_of(j), [p + 32 for p in pages])
                if hit:  # another client may not have written yet: a prefix, and exact where it hit
                    want = page_digest(make_pool(10 + j, shared=shared), pages[:hit])
                    results.append((hit, digests == want))
                else:
                    results.append((0, True))
            assert c.call("counters").errors == 0
        return results

    with ThreadPoolExecutor(8) as pool:
        per_client = list(pool.map(one, range(8)))
    assert all(ok for results in per_client for _, ok in results)
    assert all(results[0][0] == len(pages) for results in per_client)  # its own chain, just written
    (got,) = ns_stats(store.address, "fp-eight")
    assert got.pages == shared + 8 * own  # the shared prefix is stored once
    assert got.checksum_failures == 0


async def test_write_through_queue_drops_when_full_and_calls_done_once(store: ServiceProc) -> None:
    pool = make_pool(3)
    client = PageStoreClient(store.address, buffers(pool), ClientSettings(write_queue=1))
    done: list[int] = []
    try:
        ns = PageNamespace("fp-queue")
        accepted = [
            client.write_through(ns, chain("fp-queue", "", i, 2), [2 * i, 2 * i + 1], done.append)
            for i in range(5)
        ]
        assert accepted[0] and not all(accepted)
        await client.flush()
        assert len(done) == 5
        assert client.counters.writes_dropped == accepted.count(False)
        assert sum(done) == 2 * accepted.count(True)
    finally:
        await client.close()


async def test_chains_longer_than_one_call_are_split(store: ServiceProc) -> None:
    small = 64  # bytes per segment: 1,100 pages fit the arena
    pool = make_pool(4, pages=1200, bpp=small)
    client = PageStoreClient(store.address, buffers(pool, small))
    dst_pool = make_pool(None, pages=1200, bpp=small)
    reader = PageStoreClient(store.address, buffers(dst_pool, small))
    try:
        ns = PageNamespace("fp-long")
        keys = chain("fp-long", "", 9, 1100)
        assert await client.write(ns, keys, list(range(1100))) == 1100
        assert await reader.lookup_and_fetch(ns, keys, list(range(100, 1200))) == 1100
        assert page_digest(dst_pool, list(range(100, 1200)), small) == page_digest(
            pool, list(range(1100)), small
        )
    finally:
        await client.close()
        await reader.close()


@pytest.mark.parametrize("slots", [5, 64])
async def test_a_pool_behind_host_staging_round_trips_bitwise(store: ServiceProc, slots: int) -> None:
    """The path a GPU pool takes (pages copied through a small host mirror around every READ and WRITE),
    on host pools: chains longer than the mirror are split, and every slot is back after each call."""
    staged = ClientSettings(staging_pages=slots, stage_host_pool=True)
    pool = make_pool(6)
    dst_pool = make_pool(None)
    writer = PageStoreClient(store.address, buffers(pool), staged)
    reader = PageStoreClient(store.address, buffers(dst_pool), staged)
    try:
        assert writer.staging is not None and reader.staging is not None
        ns = PageNamespace(f"fp-staged-{slots}")
        keys = chain(ns.contract_fingerprint, "", 11, len(SRC))
        assert await writer.write(ns, keys, SRC) == len(SRC)
        assert await reader.lookup_and_fetch(ns, keys, DST) == len(SRC)
        assert page_digest(dst_pool, DST) == page_digest(pool, SRC)
        # A chain whose tail is not stored: the stored prefix arrives, the rest of DST stays zero.
        more = chain(ns.contract_fingerprint, "", 12, 3)
        assert await reader.lookup_and_fetch(ns, [*keys[:2], *more], [60, 61, 62, 63, 59]) == 2
        assert page_digest(dst_pool, [60, 61]) == page_digest(pool, SRC[:2])
        assert page_digest(dst_pool, [62]) == page_digest(make_pool(None), [62])
        for client in (writer, reader):
            assert sorted(client.staging._free) == list(range(slots))
    finally:
        await writer.close()
        await reader.close()
