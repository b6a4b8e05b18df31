"""Same-host reads: a get from a store process on this host reads the pages straight out of its memory,
as exactly as a NIXL READ (corrupt pages still dropped as misses); turned off, or where that read cannot
be made (another host, a process that is not the store instance), the get goes over NIXL; a restarted
store is checked anew and the old one's arena closed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from xavier.v1 import page_store_service_pb2 as pb
from xavier_services.peer.config import PeerServiceConfig

from tests.pagestore.support import (
    BPP,
    NBUF,
    PAGE_BYTES,
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
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient, direct, native
from xavier_core.pagestore.connection import StoreConnection
from xavier_core.pagestore.direct import arena_tag, open_direct_arena
from xavier_core.pagestore.layout import page_checksum
from xavier_core.pagestore.metrics import client_metrics, fetch_step_seconds
from xavier_core.pagestore.reading import PART_BYTES
from xavier_core.runtime.config import ConfigError, load_config
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


async def _written_then_read(
    writer: PageStoreClient,
    pool: list[np.ndarray],
    reader: PageStoreClient,
    reader_pool: list[np.ndarray],
    name: str,
    seed: int,
    n: int,
) -> tuple[PageNamespace, list[bytes]]:
    """`writer` stores pages 0..n-1 of `pool` under a chain of `name`; `reader` fetches them whole into
    its pages 20.. and they hold the same bytes. The namespace and keys, for more."""
    ns = PageNamespace(name)
    keys = chain(name, "", seed, n)
    assert await writer.write(ns, keys, list(range(n))) == n
    assert await _fetch(reader, reader_pool, ns, keys) == n
    assert page_digest(reader_pool, list(range(20, 20 + n))) == page_digest(pool, list(range(n)))
    return ns, keys


# A pool read straight into its pages, each page checked as it lands (where the page loop is built) or
# all read first and checked after; one behind host staging (a GPU pool's path), whose pages land
# page-major in the staging rows: checked as they land, or read first and checked after, in one piece and
# in pieces of two pages.
PATHS = {
    "pool": ClientSettings(),
    "pool-read-then-checked": ClientSettings(check_while_reading=False),
    "staged": ClientSettings(stage_host_pool=True, staging_pages=16),
    "staged-read-then-checked": ClientSettings(
        stage_host_pool=True, staging_pages=16, check_while_reading=False
    ),
    "staged-pieces": ClientSettings(stage_host_pool=True, staging_pages=16, read_piece_bytes=2 * PAGE_BYTES),
}
CHECKED_AS_IT_LANDS = {"pool", "staged"}


@pytest.mark.parametrize("path", list(PATHS))
async def test_a_get_reads_the_stores_memory_and_drops_corrupt_pages(store: ServiceProc, path: str) -> None:
    pool = make_pool(71)
    writer = PageStoreClient(store.address, buffers(pool))
    vandal = PageStoreClient(store.address, buffers(make_pool(72)))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), PATHS[path])
    by_path = client_metrics().reads
    direct_before, nixl_before = by_path.labels("direct")._value.get(), by_path.labels("nixl")._value.get()
    reads = 3 if path == "staged-pieces" else 1  # a call's reads: 6 pages in pieces of 2, or one
    name = f"fp-direct-{path}"
    steps = fetch_step_seconds()
    try:
        ns, keys = await _written_then_read(writer, pool, reader, reader_pool, name, 1, 6)
        spent = {k: v - steps.get(k, 0.0) for k, v in fetch_step_seconds().items()}
        # One pass (the read and check timed together) where the page loop is built, else a read then a check.
        one_pass = path in CHECKED_AS_IT_LANDS and native.available()
        assert (spent.get("read_checked", 0.0) > 0, spent.get("verify", 0.0) > 0) == (one_pass, not one_pass)
        assert reader.counters.reads == reader.counters.direct_reads == reads
        if path != "pool-read-then-checked":  # one read row per segment of every page (not coalesced)
            assert reader.counters.read_descriptors == 6 * NBUF
        assert reader.conn._store is not None and reader.conn._store.arena is not None
        assert by_path.labels("direct")._value.get() == direct_before + reads
        assert by_path.labels("nixl")._value.get() == nixl_before

        await scribble(store.address, vandal, name, keys, 3)  # page 3's checksum no longer holds
        assert await _fetch(reader, reader_pool, ns, keys) == 3
        assert page_digest(reader_pool, list(range(20, 23))) == page_digest(pool, list(range(3)))
        if path.startswith("staged"):  # behind staging, a page past the verified head never reaches the pool
            assert not any(a.reshape(-1, BPP)[23:26].any() for a in reader_pool)
        assert reader.counters.corrupt_pages == 1 and reader.counters.direct_reads == 2 * reads
        (st,) = ns_stats(store.address, name)
        assert st.checksum_failures == 1 and st.pages == 5  # the corrupt page was dropped
    finally:
        for c in (writer, vandal, reader):
            await c.close()


# Staged (a GPU pool's path), each page checked as it lands, in parts of two pages: 6 pages in 3 parts.
IN_PARTS = ClientSettings(stage_host_pool=True, staging_pages=16, checked_read_part_bytes=2 * PAGE_BYTES)


def _slots_all_back(client: PageStoreClient) -> bool:
    staging = client.staging
    assert staging is not None
    return staging._free == list(range(staging.slots)) and staging.usable == staging.slots


@pytest.mark.skipif(not native.available(), reason="the page loop is not built here")
@pytest.mark.parametrize("bad", [2, 3])
async def test_a_staged_read_in_parts_lands_exactly_and_stops_at_the_first_corrupt_page(
    store: ServiceProc, bad: int
) -> None:
    """Behind staging, a read checked as it lands is made in parts, each part's verified rows moving while
    the next is read: every page lands exactly; a corrupt page in the middle part (its first page, or one
    after a verified one) ends the read there: the verified head is in the pool, the rest a miss that
    never reaches it, the last part is not read, and every staging slot is back."""
    pool = make_pool(77 + bad)
    writer = PageStoreClient(store.address, buffers(pool))
    vandal = PageStoreClient(store.address, buffers(make_pool(72)))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), IN_PARTS)
    name = f"fp-parts-{bad}"
    steps = fetch_step_seconds()
    try:
        ns, keys = await _written_then_read(writer, pool, reader, reader_pool, name, 5, 6)
        spent = {k: v - steps.get(k, 0.0) for k, v in fetch_step_seconds().items()}
        assert spent.get("read_checked", 0.0) > 0 and spent.get("stage_copy", 0.0) > 0
        assert not spent.get("verify", 0.0)
        assert reader.counters.reads == reader.counters.direct_reads == 3  # one call of the loop a part
        assert reader.counters.read_descriptors == 6 * NBUF
        assert _slots_all_back(reader)

        await scribble(store.address, vandal, name, keys, bad)
        assert await _fetch(reader, reader_pool, ns, keys) == bad
        assert page_digest(reader_pool, list(range(20, 20 + bad))) == page_digest(pool, list(range(bad)))
        assert not any(a.reshape(-1, BPP)[20 + bad : 26].any() for a in reader_pool)
        # The first two parts read (the corrupt page's is the second), the third not.
        assert reader.counters.reads == 5 and reader.counters.read_descriptors == (6 + 4) * NBUF
        assert reader.counters.corrupt_pages == 1 and reader.counters.miss_pages == 6 - bad
        assert _slots_all_back(reader)
        (st,) = ns_stats(store.address, name)
        assert st.checksum_failures == 1 and st.pages == 5
    finally:
        for c in (writer, vandal, reader):
            await c.close()


@pytest.mark.skipif(not native.available(), reason="the page loop is not built here")
async def test_a_read_in_parts_that_fails_midway_is_a_miss_and_gives_its_slots_back(
    store: ServiceProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second part's read fails after the first part's rows were queued to the pool's device: the
    get is a miss, nothing reaches the pool, and every staging slot is back."""
    pool = make_pool(81)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), IN_PARTS)
    ns = PageNamespace("fp-parts-fail")
    keys = chain("fp-parts-fail", "", 6, 6)
    real = reader.conn.read_checked
    calls: list[int] = []

    def second_fails(store_peer: object, rows: np.ndarray) -> list[bytes]:
        calls.append(rows.shape[0])
        if len(calls) == 2:
            raise PeerError("the store's memory could not be read")
        return real(store_peer, rows)  # type: ignore[arg-type]

    monkeypatch.setattr(reader.conn, "read_checked", second_fails)
    try:
        assert await writer.write(ns, keys, list(range(6))) == 6
        assert await _fetch(reader, reader_pool, ns, keys) == 0
        assert calls == [2, 2]
        assert not any(a.any() for a in reader_pool)
        assert reader.counters.reads == 2 and reader.counters.errors == 1
        assert _slots_all_back(reader)
    finally:
        await writer.close()
        await reader.close()


def test_the_part_size_is_a_peer_config_key(tmp_path: Path) -> None:
    cfg_file = tmp_path / "peer.toml"
    cfg_file.write_text("[pagestore]\nchecked_read_part_bytes = -1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(PeerServiceConfig, cfg_file, {}, {})
    [(key, _, source)] = caught.value.issues
    assert key == "pagestore.checked_read_part_bytes" and source.startswith("file")
    assert load_config(PeerServiceConfig, None, {}, {}).pagestore.checked_read_part_bytes == 0
    env = {"XAVIER_PAGESTORE__CHECKED_READ_PART_BYTES": str(PART_BYTES)}
    assert load_config(PeerServiceConfig, None, env, {}).pagestore.checked_read_part_bytes == PART_BYTES


async def test_with_same_host_reads_off_the_get_goes_over_nixl(store: ServiceProc) -> None:
    pool = make_pool(73)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), NIXL_ONLY)
    try:
        await _written_then_read(writer, pool, reader, reader_pool, "fp-nixl-only", 2, 5)
        assert (reader.counters.reads, reader.counters.direct_reads) == (1, 0)
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
    assert endpoint.HasField("direct_arena") and endpoint.direct_arena.boot_id == direct.boot_id()
    elsewhere = pb.GetStoreEndpointResponse()
    elsewhere.CopyFrom(endpoint)
    elsewhere.direct_arena.boot_id = "another-host"
    assert StoreConnection._direct_arena(elsewhere) is None

    monkeypatch.setattr(direct, "boot_id", lambda: "another-host")  # as a client on another host sees it
    pool = make_pool(74)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool))
    try:
        await _written_then_read(writer, pool, reader, reader_pool, "fp-elsewhere", 3, 4)
        assert (reader.counters.reads, reader.counters.direct_reads, reader.counters.errors) == (1, 0, 0)
    finally:
        await writer.close()
        await reader.close()


def test_a_process_whose_tag_is_not_the_stores_is_not_read() -> None:
    """`open_direct_arena` against this very process standing in for a store: its tag must name the store
    instance asked for and its arena be the endpoint's region; then rows inside the arena are read
    exactly, and a row outside it, or any after `close`, is refused before anything is read."""
    arena_bytes = 64 << 10
    content = np.random.default_rng(5).integers(0, 256, arena_bytes, np.uint8)
    tag = np.frombuffer(bytearray(arena_tag("instance-a")), np.uint8)
    base = int(content.ctypes.data)
    advertised = pb.DirectArena(
        pid=os.getpid(),
        arena_base=base,
        arena_bytes=arena_bytes,
        boot_id=direct.boot_id(),
        tag_address=int(tag.ctypes.data),
        tag_bytes=tag.nbytes,
    )
    with pytest.raises(PeerError):  # the tag names another instance
        open_direct_arena(advertised, "instance-b", base, arena_bytes)
    with pytest.raises(PeerError):  # not the region the endpoint gave NIXL
        open_direct_arena(advertised, "instance-a", base + 4096, arena_bytes)
    nowhere = pb.DirectArena()
    nowhere.CopyFrom(advertised)
    nowhere.tag_address = 4096  # nothing is mapped there: the kernel answers EFAULT, nothing faults
    with pytest.raises(PeerError, match="Bad address"):
        open_direct_arena(nowhere, "instance-a", base, arena_bytes)
    gone = pb.DirectArena()
    gone.CopyFrom(advertised)
    gone.pid = _a_pid_nobody_has()
    with pytest.raises(PeerError, match="No such process"):
        open_direct_arena(gone, "instance-a", base, arena_bytes)

    arena = open_direct_arena(advertised, "instance-a", base, arena_bytes)
    dest = np.zeros(3 << 10, np.uint8)
    at = dest.ctypes.data
    rows = np.array([[base + 100, at, 1000], [base + arena_bytes - 2072, at + 1000, 2072]], dtype=np.uint64)
    assert arena.copy(rows).wait() == "DONE"
    assert dest.tobytes() == content.tobytes()[100:1100] + content.tobytes()[-2072:]
    with pytest.raises(PeerError):  # a row past the arena's end is refused before any read
        arena.copy(np.array([[base + arena_bytes - 10, at, 20]], dtype=np.uint64))
    if native.available():  # read and checked page by page: two pages of two segments each
        pages = np.array(
            [
                [[base, at, 512], [base + 4096, at + 512, 512]],
                [[base + 1024, at + 1024, 2048], [base, at + 3072, 0]],
            ],
            dtype=np.uint64,
        )
        dest[:] = 0
        sums = arena.read_checked(pages)
        c = content.tobytes()
        assert dest.tobytes()[:3072] == c[:512] + c[4096:4608] + c[1024:3072]
        assert sums == [page_checksum([c[:512], c[4096:4608]]), page_checksum([c[1024:3072]])]
        with pytest.raises(PeerError):  # a segment past the arena's end is refused before any read
            arena.read_checked(np.array([[[base, at, 8], [base + arena_bytes - 4, at + 8, 8]]], np.uint64))
        with pytest.raises(PeerError, match="Bad address"):  # a local range nothing is mapped at
            arena.read_checked(np.array([[[base, 4096, 8]]], np.uint64))
        # the same loop reading alone, unhashed (a benchmark's baseline): the same bytes land
        built = native.native_hash()
        assert built is not None
        dest[:] = 0
        assert built.read_pages(arena.pid, pages, threads=2) is None
        assert dest.tobytes()[:3072] == c[:512] + c[4096:4608] + c[1024:3072]
        with pytest.raises(OSError, match="Bad address"):
            built.read_pages(arena.pid, np.array([[[base, 4096, 8]]], np.uint64))
        dest[:] = 0  # and through the arena, which checks every segment first
        arena.read_unhashed(pages)
        assert dest.tobytes()[:3072] == c[:512] + c[4096:4608] + c[1024:3072]
        with pytest.raises(PeerError):
            arena.read_unhashed(np.array([[[base, at, 8], [base + arena_bytes - 4, at + 8, 8]]], np.uint64))
        with pytest.raises(PeerError, match="Bad address"):
            arena.read_unhashed(np.array([[[base, 4096, 8]]], np.uint64))
    arena.close()
    assert arena.closed
    with pytest.raises(PeerError):
        arena.copy(rows)
    with pytest.raises(PeerError):
        arena.read_checked(np.array([[[base, at, 8]]], np.uint64))


@pytest.mark.skipif(not native.available(), reason="the page loop is not built here")
@pytest.mark.parametrize("threads", [1, 3])
def test_the_loop_reads_pages_of_many_small_segments_in_groups_exactly(threads: int) -> None:
    """A store chunk keeps each segment of consecutive slots one after another; the loop reads a thread's
    group of pages in one system call, those ranges joined, and lands every segment where its row says,
    also where a page comes from a slot out of order (the join breaks there)."""
    segs, seg, slots = 4, 256, 40
    content = np.random.default_rng(9).integers(0, 256, segs * slots * seg, np.uint8)
    base = int(content.ctypes.data)
    order = list(range(slots))
    order[17], order[39] = order[39], order[17]  # two slots read out of order
    dest = np.zeros(slots * segs * seg, np.uint8)
    at = int(dest.ctypes.data)
    pages = np.array(
        [
            [[base + (s * slots + slot) * seg, at + (i * segs + s) * seg, seg] for s in range(segs)]
            for i, slot in enumerate(order)
        ],
        dtype=np.uint64,
    )
    built = native.native_hash()
    assert built is not None
    sums = built.read_checksums(os.getpid(), pages, threads=threads)
    c = content.tobytes()
    want = [[c[(s * slots + slot) * seg :][:seg] for s in range(segs)] for slot in order]
    assert dest.tobytes() == b"".join(b"".join(parts) for parts in want)
    assert sums == [page_checksum(parts) for parts in want]


def _a_pid_nobody_has() -> int:
    taken = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    return next(p for p in range(4_000_000, 1, -1) if p not in taken)


async def test_a_restarted_store_is_checked_anew_and_the_old_arena_closed(tmp_path: Path) -> None:
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
        assert reader.counters.direct_reads == reader.counters.reads == 2
        assert stats(again.address).leases == 0
    finally:
        await reader.close()
        if again is not None:
            assert again.stop() == 0
        svc.kill()


def test_the_read_thread_count_is_taken_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XAVIER_PAGE_READ_THREADS", raising=False)
    assert direct._copy_threads() == min(16, os.cpu_count() or 1)
    monkeypatch.setenv("XAVIER_PAGE_READ_THREADS", "3")
    assert direct._copy_threads() == 3
    for bad in ("0", "65", "four", "-2"):
        monkeypatch.setenv("XAVIER_PAGE_READ_THREADS", bad)
        with pytest.raises(ValueError, match="XAVIER_PAGE_READ_THREADS"):
            direct._copy_threads()
