"""How many NIXL descriptors a warm read posts, counted by the client: pages written by one write-through
come back as one descriptor per run of store slots per segment, whatever holes the store's chunks or the
reader's host mirror have; scattered pages still come back exact, a corrupted page is still a miss, and
no lease, staging slot or pool page is left behind."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from tests.pagestore.engines import prompt
from tests.pagestore.support import (
    NBUF,
    buffers,
    chain,
    make_pool,
    page_digest,
    raw_get,
    raw_release,
    scribble,
)
from tests.support.procs import ServiceProc
from xavier_core.engine.api import Sampling
from xavier_core.engine.reference import ReferenceEngine
from xavier_core.engine.tiny import make_tiny
from xavier_core.pagestore import ClientSettings, PageNamespace, PageStoreClient
from xavier_core.pagestore.layout import PageGeometry, Span
from xavier_core.pagestore.staging import HostStaging
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidPagesError

pytestmark = pytest.mark.integration

SLOTS_PER_CHUNK = 32  # the module store's 256 KiB chunks over NBUF x 2 KiB pages
STAGED = ClientSettings(stage_host_pool=True, staging_pages=48)
COALESCED = ClientSettings(check_while_reading=False)
"""A pool's same-host read of whole runs, checked once it has all landed (checked as each page lands, the
default, it reads page by page: one row per segment per page)."""


def raw_spans(address: str, fp: str, keys: list[bytes]) -> list[int]:
    """The run lengths of the store slots holding `keys` (a lease taken and given back)."""
    got = raw_get(address, fp, keys, 5.0)
    assert raw_release(address, got.lease_id).released
    return [s.count for s in got.spans]


async def _holes(client: PageStoreClient, address: str, fp: str) -> None:
    """Fills one chunk of namespace `fp` and drops three of its pages: slots 3, 10 and 20 come free."""
    keys = chain(fp, "", 1, SLOTS_PER_CHUNK)
    assert await client.write(PageNamespace(fp), keys, list(range(SLOTS_PER_CHUNK))) == SLOTS_PER_CHUNK
    got = raw_get(address, fp, keys, 5.0)
    assert [s.count for s in got.spans] == [SLOTS_PER_CHUNK]
    assert raw_release(address, got.lease_id, [3, 10, 20]).released
    assert raw_spans(address, fp, keys) == [3]  # the chain now stops at its first dropped page


async def test_a_write_through_reads_back_as_one_descriptor_per_run_per_segment(store: ServiceProc) -> None:
    pool = make_pool(41)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), COALESCED)
    try:
        await _holes(writer, store.address, "fp-runs")
        # 24 pages do not fit in the holes: they take one fresh chunk (one run), not the holes and a tail.
        keys = chain("fp-runs", "", 2, 24)
        wrote = writer.counters.write_descriptors
        assert await writer.write(PageNamespace("fp-runs"), keys, list(range(32, 56))) == 24
        assert writer.counters.write_descriptors - wrote == NBUF
        assert await reader.lookup_and_fetch(PageNamespace("fp-runs"), keys, list(range(24))) == 24
        assert reader.counters.reads == 1 and reader.counters.read_descriptors == NBUF
        assert page_digest(reader_pool, range(24)) == page_digest(pool, range(32, 56))
        # Longer than a chunk: one run per chunk it spans (a run never crosses a chunk).
        longer = chain("fp-runs", "", 3, 40)
        assert await writer.write(PageNamespace("fp-runs"), longer, list(range(40))) == 40
        read = reader.counters.read_descriptors
        assert await reader.lookup_and_fetch(PageNamespace("fp-runs"), longer, list(range(40))) == 40
        assert reader.counters.read_descriptors - read == 2 * NBUF
        assert page_digest(reader_pool, range(40)) == page_digest(pool, range(40))
    finally:
        await writer.close()
        await reader.close()


async def test_staging_leases_take_the_lowest_run_of_free_slots() -> None:
    pool = np.zeros(64 * 16, np.uint8)
    staging = HostStaging([KvBuffer(pool.ctypes.data, pool.nbytes, 16, "cpu")], 48)
    a, b, c = [await staging.acquire(10) for _ in range(3)]  # slots 0-9, 10-19, 20-29
    await staging.release(a)
    await staging.release(c)  # free: 0-9 and 20-47
    assert await staging.acquire(20) == list(range(20, 40))  # one run, not 30-47 then 0-1
    assert await staging.acquire(12) == [*range(0, 10), 40, 41]  # no run of 12 left: the lowest slots
    assert staging._free == list(range(42, 48))
    await staging.release(list(range(39, 19, -1)))
    await staging.release([*range(0, 10), 40, 41])
    await staging.release(b)
    assert staging._free == list(range(48))


async def test_a_fragmented_mirror_reads_a_run_as_one_descriptor_per_segment(store: ServiceProc) -> None:
    pool = make_pool(42)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    # Over NIXL: a same-host read lands page-major in the staging rows instead (the test below).
    reader = PageStoreClient(
        store.address, buffers(reader_pool), dataclasses.replace(STAGED, same_host_reads=False)
    )
    staging = reader.staging
    assert staging is not None
    try:
        keys = chain("fp-mirror", "", 1, 20)
        assert await writer.write(PageNamespace("fp-mirror"), keys, list(range(20))) == 20
        a, b, c = [await staging.acquire(10) for _ in range(3)]
        await staging.release(a)
        await staging.release(c)  # the mirror's free slots: 0-9 and 20-47, with 10-19 held
        dest = list(range(63, 43, -1))  # pool pages in reverse: the scatter to the pool maps each one
        assert await reader.lookup_and_fetch(PageNamespace("fp-mirror"), keys, dest) == 20
        assert reader.counters.read_descriptors == NBUF
        assert page_digest(reader_pool, dest) == page_digest(pool, range(20))
        await staging.release(b)
        assert staging._free == list(range(48))
    finally:
        await writer.close()
        await reader.close()


async def test_a_same_host_read_into_slots_of_two_runs_lands_each_page_in_its_pool_page(
    store: ServiceProc,
) -> None:
    pool = make_pool(44)
    writer = PageStoreClient(store.address, buffers(pool))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), STAGED)
    staging = reader.staging
    assert staging is not None
    try:
        keys = chain("fp-rows", "", 1, 20)
        assert await writer.write(PageNamespace("fp-rows"), keys, list(range(20))) == 20
        held = [await staging.acquire(10) for _ in range(4)]  # slots 0-39
        for run in (held[0], held[2]):
            await staging.release(run)  # free: 0-9, 20-29, 40-47: no run of 20
        dest = list(range(63, 43, -1))
        assert await reader.lookup_and_fetch(PageNamespace("fp-rows"), keys, dest) == 20
        assert reader.counters.direct_reads == 1 and reader.counters.read_descriptors == 20 * NBUF
        assert page_digest(reader_pool, dest) == page_digest(pool, range(20))
        for run in (held[1], held[3]):
            await staging.release(run)
        assert staging._free == list(range(48))
    finally:
        await writer.close()
        await reader.close()


@pytest.mark.parametrize("settings", [ClientSettings(), STAGED], ids=["pool", "mirror"])
async def test_scattered_pages_come_back_exact_and_a_corrupt_page_is_a_miss(
    store: ServiceProc, settings: ClientSettings
) -> None:
    fp = f"fp-scatter-{settings.stage_host_pool}"
    pool = make_pool(43)
    writer = PageStoreClient(store.address, buffers(pool))
    vandal = PageStoreClient(store.address, buffers(make_pool(44)))
    reader_pool = make_pool(None)
    reader = PageStoreClient(store.address, buffers(reader_pool), settings)
    try:
        await _holes(writer, store.address, fp)
        src = [5, 40, 41, 42, 7, 63, 0, 1, 2, 30]
        keys = chain(fp, "", 2, len(src))
        for i in (0, 1):  # one page a put: each fits a hole (slots 3 and 10), so the chain is scattered
            assert await writer.write(PageNamespace(fp), keys[i : i + 1], src[i : i + 1]) == 1
        assert await writer.write(PageNamespace(fp), keys, src) == len(src) - 2
        assert len(raw_spans(store.address, fp, keys)) == 3
        dest = [9, 8, 60, 61, 20, 2, 3, 50, 51, 52]
        assert await reader.lookup_and_fetch(PageNamespace(fp), keys, dest) == len(src)
        assert page_digest(reader_pool, dest) == page_digest(pool, src)
        # A stray writer scribbles over the seventh page: the six before it are served, it and the rest
        # are a miss, and the store drops it.
        await scribble(store.address, vandal, fp, keys, 6)
        for a in reader_pool:
            a[:] = 0
        assert await reader.lookup_and_fetch(PageNamespace(fp), keys, dest) == 6
        assert page_digest(reader_pool, dest[:6]) == page_digest(pool, src[:6])
        assert reader.counters.corrupt_pages == 1
        await reader.flush()
        assert await reader.exists(PageNamespace(fp), keys) == 6
        if reader.staging is not None:
            assert reader.staging._free == list(range(STAGED.staging_pages))
    finally:
        for c in (writer, vandal, reader):
            await c.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2")


@pytest.fixture
async def engines(model: Path, store: ServiceProc) -> AsyncIterator[list[ReferenceEngine]]:
    """A writer and two readers (one through the host staging) of one namespace; every pool starts empty."""
    out: list[ReferenceEngine] = []
    try:
        for settings in (ClientSettings(), ClientSettings(), ClientSettings(stage_host_pool=True)):
            eng = ReferenceEngine.load(model, num_pages=300, max_running=4)
            eng.use_page_store(PageStoreClient(store.address, eng.kv_buffers(), settings), "fp-engines")
            out.append(eng)
        yield out
    finally:
        for eng in out:
            assert eng._store is not None
            await eng._store.client.close()
            await eng.close()


async def test_a_prefix_written_through_by_one_engine_is_read_in_runs_by_others(
    engines: list[ReferenceEngine],
) -> None:
    writer, *readers = engines
    tokens = prompt(11, 50 * 16)  # 50 pages: two chunks of the store, so two runs
    greedy = Sampling(max_tokens=1, ignore_eos=True)
    assert [ev async for ev in writer.generate("w", tokens, greedy)]
    assert writer._store is not None
    await writer._store.client.flush()
    for i, reader in enumerate(readers):
        res = await reader.prefill(f"r{i}", [*tokens, 7], greedy)
        assert res.cached_tokens_store == len(tokens)
        reader.release_pages(f"r{i}")
        assert reader._store is not None
        counters = reader._store.client.counters
        segments = len(reader.kv_buffers())
        # Into the pool, read and checked page by page (the built loop): one row per segment per page;
        # through the mirror, a same-host read lands page-major in the staging rows: the same.
        client = reader._store.client
        runs = 50 if client.staging is not None or client._checks_while_reading() else 2
        assert counters.reads == 1 and counters.read_descriptors == runs * segments
        await reader._store.client.flush()
        s = reader.stats()
        assert s.running == s.waiting == s.pages_pinned == 0


def test_a_page_major_read_puts_each_segment_after_the_last_in_its_row() -> None:
    geometry = PageGeometry((16, 32, 8))
    spans = [Span(1000, 10, 2, 3), Span(5000, 4, 0, 2)]
    base, rows = 1 << 20, [7, 1, 2, 9, 4]
    got = geometry.row_descriptors(spans, base, rows)
    want = []
    slots = [(spans[0], 2), (spans[0], 3), (spans[0], 4), (spans[1], 0), (spans[1], 1)]
    for (span, slot), row in zip(slots, rows, strict=True):
        at = base + row * geometry.page_bytes
        addrs = geometry.slot_addresses(span.chunk_address, span.chunk_slots, slot)
        for addr, size in zip(addrs, (16, 32, 8), strict=True):
            want.append((addr, at, size))
            at += size
    assert [tuple(int(x) for x in r) for r in got] == want
    with pytest.raises(InvalidPagesError):
        geometry.row_descriptors(spans, base, rows[:4])
