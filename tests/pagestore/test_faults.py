"""Faults: corrupted pages are misses, leases expire, a killed store comes back, eviction spares leases."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import grpc
import pytest
from xavier.v1 import page_store_service_pb2 as pb

from tests.pagestore.support import (
    BPP,
    NBUF,
    PAGE_BYTES,
    buffers,
    chain,
    make_pool,
    ns_stats,
    one_page_spans,
    page_digest,
    raw_get,
    raw_release,
    start_store,
    stats,
    stub,
)
from tests.support.procs import ServiceProc
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient
from xavier_core.pagestore import client as client_module
from xavier_core.pagestore.client import _spans
from xavier_core.runtime.errors import from_rpc_error

pytestmark = pytest.mark.integration

SEGMENTS = [BPP] * NBUF


async def test_bad_checksum_at_commit_is_never_visible(
    store: ServiceProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = make_pool(21)
    client = PageStoreClient(store.address, buffers(pool))
    try:
        ns = PageNamespace("fp-badsum")
        keys = chain("fp-badsum", "", 1, 4)
        real = client_module.local_page_checksums
        monkeypatch.setattr(client_module, "local_page_checksums", lambda b, p: [bytes(16), *real(b, p)[1:]])
        assert await client.write(ns, keys, [0, 1, 2, 3]) == 3
        assert await client.exists(ns, keys) == 0  # the head failed: the chain is a miss from page 0
        assert await client.exists(ns, keys[1:]) == 3
        (got,) = ns_stats(store.address, "fp-badsum")
        assert got.checksum_failures == 1 and got.pages == 3
    finally:
        await client.close()


async def test_page_corrupted_after_commit_is_a_miss_and_dropped(store: ServiceProc) -> None:
    pool = make_pool(22)
    writer = PageStoreClient(store.address, buffers(pool))
    vandal = PageStoreClient(store.address, buffers(make_pool(23)))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool))
    try:
        ns = PageNamespace("fp-corrupt")
        keys = chain("fp-corrupt", "", 2, 6)
        assert await writer.write(ns, keys, list(range(6))) == 6
        # A stray writer with stale descriptors scribbles over page 3 after its commit.
        got = raw_get(store.address, "fp-corrupt", keys, 5.0)
        spans = _spans(got.spans)
        page3 = [s for s in one_page_spans(spans)][3]
        target = await vandal.conn.ensure_store(got.store_instance)
        rows = vandal.geometry.span_descriptors([page3], vandal._bases, [0])
        await asyncio.to_thread(vandal.conn.move, "WRITE", target, rows, 1)
        assert raw_release(store.address, got.lease_id).released
        hit = await reader.lookup_and_fetch(ns, keys, list(range(10, 16)))
        assert hit == 3  # pages 0..2 verified; page 3 failed its checksum: a miss, never wrong bytes
        assert page_digest(reader_pool, list(range(10, 13))) == page_digest(pool, [0, 1, 2])
        assert reader.counters.corrupt_pages == 1
        await reader.flush()  # the release that reports the corrupt page is not awaited by the fetch
        (st,) = ns_stats(store.address, "fp-corrupt")
        assert st.checksum_failures == 1 and st.pages == 5  # the corrupt page was dropped
        assert await reader.exists(ns, keys) == 3
        # Written again, the chain is whole.
        assert await writer.write(ns, keys, list(range(6))) == 1
        assert await reader.lookup_and_fetch(ns, keys, list(range(10, 16))) == 6
    finally:
        for c in (writer, vandal, reader):
            await c.close()


async def test_lease_expiry_with_stalled_reader_and_writer(store: ServiceProc) -> None:
    pool = make_pool(24)
    client = PageStoreClient(store.address, buffers(pool))
    try:
        ns = PageNamespace("fp-stall")
        keys = chain("fp-stall", "", 3, 4)
        assert await client.write(ns, keys, [0, 1, 2, 3]) == 4
        got = raw_get(store.address, "fp-stall", keys, 0.5)  # a reader that never comes back
        assert got.hit_count == 4
        (st,) = ns_stats(store.address, "fp-stall")
        assert st.leases == 1 and st.pinned_pages == 4
        ch, s = stub(store.address)
        with ch:
            put = s.PutPages(
                pb.PutPagesRequest(
                    request_id=uuid.uuid4().hex,
                    namespace=pb.PageNamespace(contract_fingerprint="fp-stall"),
                    keys=chain("fp-stall", "", 4, 2),
                    segment_bytes=SEGMENTS,
                    lease_seconds=0.5,
                ),
                timeout=5,
            )  # a writer that never commits
            assert list(put.reserved_indices) == [0, 1]
            await asyncio.sleep(1.0)
            (st,) = ns_stats(store.address, "fp-stall")
            assert st.leases == 0 and st.pinned_pages == 0 and st.reserved_pages == 0
            assert st.leases_expired == 2 and st.reservations_dropped == 2 and st.pages == 4
            with pytest.raises(grpc.RpcError) as info:
                s.CommitPut(
                    pb.CommitPutRequest(request_id="late", lease_id=put.lease_id, checksums=[bytes(16)] * 2),
                    timeout=5,
                )
            assert from_rpc_error(info.value).reason == "LEASE_EXPIRED"
        with pytest.raises(grpc.RpcError) as info:
            raw_release(store.address, got.lease_id)
        assert from_rpc_error(info.value).reason == "LEASE_EXPIRED"
        assert await client.exists(ns, chain("fp-stall", "", 4, 2)) == 0
    finally:
        await client.close()


async def test_eviction_under_the_byte_bound_spares_leased_pages(tmp_path: Path) -> None:
    # 16 chunks of 4 pages: 64 pages of 8 KiB in a 512 KiB arena.
    svc = start_store(tmp_path, arena=512 << 10, chunk=4 * PAGE_BYTES)
    pool = make_pool(25)
    client = PageStoreClient(svc.address, buffers(pool))
    try:
        ns = PageNamespace("fp-evict")
        old = chain("fp-evict", "", 1, 32)
        assert await client.write(ns, old, list(range(32))) == 32
        lease = raw_get(svc.address, "fp-evict", old[:8], 30.0)  # pins the head of the old chain
        assert lease.hit_count == 8
        new = chain("fp-evict", "", 2, 64)
        written = await client.write(ns, new, list(range(64)))
        assert written == 64 - 8  # everything but the pinned pages could be reclaimed
        got = stats(svc.address)
        assert got.pages * PAGE_BYTES <= got.capacity_bytes == 512 << 10
        (st,) = got.namespaces
        assert st.evictions == 32 - 8 and st.pages == 64
        reader_pool = make_pool(None)
        reader = PageStoreClient(svc.address, buffers(reader_pool))
        try:
            assert await reader.lookup_and_fetch(ns, old, list(range(32))) == 8
            assert page_digest(reader_pool, list(range(8))) == page_digest(pool, list(range(8)))
        finally:
            await reader.close()
        assert raw_release(svc.address, lease.lease_id).released
        assert stats(svc.address).leases == 0
    finally:
        await client.close()
        assert svc.stop() == 0


async def test_store_killed_and_restarted_client_keeps_working(tmp_path: Path) -> None:
    svc = start_store(tmp_path / "a")
    pool = make_pool(26)
    client = PageStoreClient(
        svc.address, buffers(pool), ClientSettings(rpc_timeout_s=0.5, transfer_timeout_s=2.0)
    )
    try:
        ns = PageNamespace("fp-restart")
        keys = chain("fp-restart", "", 1, 4)
        assert await client.write(ns, keys, [0, 1, 2, 3]) == 4
        assert await client.lookup_and_fetch(ns, keys, [10, 11, 12, 13]) == 4
        await client.flush()  # its lease released
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(10)
        # Down: misses and dropped writes, never an exception.
        assert await client.lookup_and_fetch(ns, keys, [10, 11, 12, 13]) == 0
        assert await client.write(ns, keys, [0, 1, 2, 3]) == 0
        assert client.counters.errors >= 2
        again = start_store(tmp_path / "b", listen=svc.address)
        try:
            deadline = time.monotonic() + 20
            written = 0
            while written == 0:  # the channel reconnects on its own within its backoff
                assert time.monotonic() < deadline, "client never reached the restarted store"
                written = await client.write(ns, keys, [0, 1, 2, 3])
                await asyncio.sleep(0.1)
            assert written == 4
            assert await client.lookup_and_fetch(ns, keys, [10, 11, 12, 13]) == 4
            assert page_digest(pool, [10, 11, 12, 13]) == page_digest(pool, [0, 1, 2, 3])
            await client.flush()
            assert stats(again.address).leases == 0
        finally:
            await client.close()
            assert again.stop() == 0
    finally:
        svc.kill()
