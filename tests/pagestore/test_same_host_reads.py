"""Same-host reads: a get from a store process on this host copies the pages out of its arena, mapped
read-only, and is as exact as a NIXL READ (corrupt pages still dropped as misses); turned off, or where
the mapping cannot be made (another host, a file that is not the store's arena), the get goes over NIXL;
a restarted store is mapped anew and the old mapping released."""

from __future__ import annotations

import asyncio
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from xavier.v1 import page_store_service_pb2 as pb

from tests.pagestore.support import (
    buffers,
    chain,
    make_pool,
    ns_stats,
    page_digest,
    scribble,
    start_store,
    stats,
    stub,
)
from tests.support.procs import ServiceProc
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient, mapped
from xavier_core.pagestore.connection import StoreConnection
from xavier_core.pagestore.mapped import HEADER_BYTES, arena_header, map_shared_arena
from xavier_core.pagestore.metrics import client_metrics
from xavier_core.transfer.common.errors import PeerError

pytestmark = pytest.mark.integration

NIXL_ONLY = ClientSettings(same_host_reads=False)


async def _fetch(
    client: PageStoreClient, pool: list[np.ndarray], ns: PageNamespace, keys: list[bytes]
) -> int:
    dest = list(range(20, 20 + len(keys)))
    for a in pool:
        a[:] = 0
    hit = await client.lookup_and_fetch(ns, keys, dest)
    await client.flush()
    return hit


async def test_a_get_copies_out_of_the_mapped_arena_and_drops_corrupt_pages(store: ServiceProc) -> None:
    pool = make_pool(71)
    writer = PageStoreClient(store.address, buffers(pool))
    vandal = PageStoreClient(store.address, buffers(make_pool(72)))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool))
    by_path = client_metrics().reads
    mapped_before, nixl_before = by_path.labels("mapped")._value.get(), by_path.labels("nixl")._value.get()
    try:
        ns = PageNamespace("fp-mapped")
        keys = chain("fp-mapped", "", 1, 6)
        assert await writer.write(ns, keys, list(range(6))) == 6
        assert await _fetch(reader, reader_pool, ns, keys) == 6
        assert page_digest(reader_pool, list(range(20, 26))) == page_digest(pool, list(range(6)))
        assert reader.counters.reads == reader.counters.mapped_reads == 1
        assert reader.conn._store is not None and reader.conn._store.arena is not None
        assert by_path.labels("mapped")._value.get() == mapped_before + 1
        assert by_path.labels("nixl")._value.get() == nixl_before

        await scribble(store.address, vandal, "fp-mapped", keys, 3)  # page 3's checksum no longer holds
        assert await _fetch(reader, reader_pool, ns, keys) == 3
        assert page_digest(reader_pool, list(range(20, 23))) == page_digest(pool, list(range(3)))
        assert reader.counters.corrupt_pages == 1 and reader.counters.mapped_reads == 2
        (st,) = ns_stats(store.address, "fp-mapped")
        assert st.checksum_failures == 1 and st.pages == 5  # the corrupt page was dropped
    finally:
        for c in (writer, vandal, reader):
            await c.close()


async def test_with_same_host_reads_off_the_get_goes_over_nixl(store: ServiceProc) -> None:
    pool = make_pool(73)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), NIXL_ONLY)
    try:
        ns = PageNamespace("fp-nixl-only")
        keys = chain("fp-nixl-only", "", 2, 5)
        assert await writer.write(ns, keys, list(range(5))) == 5
        assert await _fetch(reader, reader_pool, ns, keys) == 5
        assert page_digest(reader_pool, list(range(20, 25))) == page_digest(pool, list(range(5)))
        assert (reader.counters.reads, reader.counters.mapped_reads) == (1, 0)
        assert reader.conn._store is not None and reader.conn._store.arena is None
    finally:
        await writer.close()
        await reader.close()


async def test_a_store_on_another_host_is_read_over_nixl(
    store: ServiceProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    ch, s = stub(store.address)
    with ch:
        endpoint = s.GetStoreEndpoint(pb.GetStoreEndpointRequest(tcp_receive_segment_bytes=256 << 10))
    assert endpoint.HasField("shared_arena") and endpoint.shared_arena.boot_id == mapped.boot_id()
    elsewhere = pb.GetStoreEndpointResponse()
    elsewhere.CopyFrom(endpoint)
    elsewhere.shared_arena.boot_id = "another-host"
    assert StoreConnection._map_arena(elsewhere) is None

    monkeypatch.setattr(mapped, "boot_id", lambda: "another-host")  # as a client on another host sees it
    pool = make_pool(74)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool))
    try:
        ns = PageNamespace("fp-elsewhere")
        keys = chain("fp-elsewhere", "", 3, 4)
        assert await writer.write(ns, keys, list(range(4))) == 4
        assert await _fetch(reader, reader_pool, ns, keys) == 4
        assert page_digest(reader_pool, list(range(20, 24))) == page_digest(pool, list(range(4)))
        assert (reader.counters.reads, reader.counters.mapped_reads, reader.counters.errors) == (1, 0, 0)
    finally:
        await writer.close()
        await reader.close()


def test_a_file_that_is_not_the_stores_arena_is_not_mapped() -> None:
    arena_bytes = 64 << 10
    fd = os.memfd_create("not-a-store-arena")
    try:
        os.ftruncate(fd, HEADER_BYTES + arena_bytes)
        with mmap.mmap(fd, HEADER_BYTES + arena_bytes) as m:
            m[: len(arena_header("instance-a"))] = arena_header("instance-a")
            m[HEADER_BYTES:] = np.random.default_rng(5).integers(0, 256, arena_bytes, np.uint8).tobytes()
            content = bytes(m[HEADER_BYTES:])
        base = 1 << 40  # the store's own address of its arena, unrelated to ours
        shared = pb.SharedArena(
            pid=os.getpid(),
            fd=fd,
            header_bytes=HEADER_BYTES,
            arena_bytes=arena_bytes,
            arena_base=base,
            boot_id=mapped.boot_id(),
        )
        with pytest.raises(PeerError):  # the header names another instance
            map_shared_arena(shared, "instance-b", base, arena_bytes)
        with pytest.raises(PeerError):  # not the region the endpoint gave NIXL
            map_shared_arena(shared, "instance-a", base + 4096, arena_bytes)
        too_long = pb.SharedArena()
        too_long.CopyFrom(shared)
        too_long.arena_bytes = 2 * arena_bytes
        with pytest.raises(PeerError):  # longer than the file: a copy from past its end would fault
            map_shared_arena(too_long, "instance-a", base, 2 * arena_bytes)
        gone = pb.SharedArena()
        gone.CopyFrom(shared)
        gone.fd = 1 << 20
        with pytest.raises(OSError):
            map_shared_arena(gone, "instance-a", base, arena_bytes)

        arena = map_shared_arena(shared, "instance-a", base, arena_bytes)
        dest = np.zeros(3 << 10, np.uint8)
        at = dest.ctypes.data
        rows = np.array(
            [[base + 100, at, 1000], [base + arena_bytes - 2072, at + 1000, 2072]], dtype=np.uint64
        )
        assert arena.copy(rows).wait() == "DONE"
        assert dest.tobytes() == content[100:1100] + content[-2072:]
        with pytest.raises(PeerError):  # a row past the arena's end is refused before any copy
            arena.copy(np.array([[base + arena_bytes - 10, at, 20]], dtype=np.uint64))
        arena.close()
        assert arena.closed
        with pytest.raises(PeerError):
            arena.copy(rows)
    finally:
        os.close(fd)


async def test_a_restarted_store_is_mapped_anew_and_the_old_mapping_released(tmp_path: Path) -> None:
    svc = start_store(tmp_path / "a")
    again: ServiceProc | None = None
    first, second = make_pool(75), make_pool(76)
    writer_a = PageStoreClient(svc.address, buffers(first))
    reader_pool = make_pool(None)
    reader = PageStoreClient(svc.address, buffers(reader_pool), ClientSettings(rpc_timeout_s=2.0))
    ns = PageNamespace("fp-remap")
    keys = chain("fp-remap", "", 4, 4)
    try:
        assert await writer_a.write(ns, keys, list(range(4))) == 4
        await writer_a.close()
        assert await _fetch(reader, reader_pool, ns, keys) == 4
        assert page_digest(reader_pool, list(range(20, 24))) == page_digest(first, list(range(4)))
        assert reader.conn._store is not None
        old = reader.conn._store.arena
        assert old is not None and not old.closed
        assert svc.stop() == 0

        again = start_store(tmp_path / "b", listen=svc.address)
        writer_b = PageStoreClient(again.address, buffers(second))
        try:
            assert await writer_b.write(ns, keys, list(range(4))) == 4  # other bytes under the same keys
        finally:
            await writer_b.close()
        hit = 0
        for _ in range(50):  # the reader's channel reconnects on its own within its backoff
            if (hit := await _fetch(reader, reader_pool, ns, keys)) == 4:
                break
            await asyncio.sleep(0.1)
        assert hit == 4
        assert page_digest(reader_pool, list(range(20, 24))) == page_digest(second, list(range(4)))
        assert reader.conn._store is not None
        new = reader.conn._store.arena
        assert new is not None and new is not old and old.closed
        assert reader.counters.mapped_reads == reader.counters.reads == 2
        assert stats(again.address).leases == 0
    finally:
        await reader.close()
        if again is not None:
            assert again.stop() == 0
        svc.kill()
