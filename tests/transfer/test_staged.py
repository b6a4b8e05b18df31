"""The staged NIXL transport between two processes (DRAM): the source gathers a room into its slab, the
reader READs whole chunks and scatters them. Real NIXL (UCX) both ways; the pools are numpy buffers."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from tests.transfer.kvpool import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    PAGE_SIZE,
    PAGES,
    kv_buffers,
    make_pool,
    page_bytes,
    serve_port,
    spawned,
)
from tests.transfer.test_port import SRC_SEED, PortSource
from xavier_core.runtime.errors import FailedPrecondition, Unavailable
from xavier_core.transfer import KvPort, peer_key

pytestmark = pytest.mark.integration

RECORD = 2 * LAYERS * PAGE_SIZE * HEADS * HEAD_DIM * 2  # one page of every buffer (float16)
CHUNK = 4 * RECORD  # four pages per chunk
SRC_CHUNKS = 12


async def _serve(conn: Connection, name: str, poll: float) -> None:
    pool = make_pool(SRC_SEED)  # held for the life of the port: NIXL reads these addresses
    port = KvPort(
        name, kv_buffers(pool), PAGE_SIZE, poll, transport="staged",
        slab_bytes=SRC_CHUNKS * CHUNK, chunk_bytes=CHUNK,
    )  # fmt: skip
    await serve_port(conn, port, "host-a", extra={"stats": lambda: port.stats()["staging"]})


def _source_main(conn: Connection, name: str, poll: float) -> None:
    asyncio.run(_serve(conn, name, poll))


class Source(PortSource):
    """A staged source process; `key` is the peer key a reader names it by."""

    def __init__(self, conn: Connection, key: str) -> None:
        super().__init__(conn)
        self.key = key


@contextlib.contextmanager
def _source(tag: str, poll: float) -> Iterator[Source]:
    name = f"staged-src-{tag}-{os.getpid()}"
    with spawned(_source_main, name, poll) as conn:
        yield Source(conn, peer_key(name, 1))


@pytest.fixture(scope="module")
def source() -> Iterator[Source]:
    with _source("fast", 0.0005) as src:
        yield src


@pytest.fixture
async def reader(request: pytest.FixtureRequest) -> AsyncIterator[tuple[KvPort, list[np.ndarray]]]:
    pool = make_pool(None)
    name = f"staged-dst-{os.getpid()}-{request.node.name}"
    port = KvPort(
        name, kv_buffers(pool), PAGE_SIZE, transport="staged", slab_bytes=8 * CHUNK, chunk_bytes=CHUNK
    )
    try:
        yield port, pool
    finally:
        await port.close()


def placement(n: int, run: int, rng: np.random.Generator) -> list[int]:
    """`n` distinct pages of the pool in runs of `run` pages (0: one contiguous run), in random order."""
    if run == 0:
        first = int(rng.integers(0, PAGES - n + 1))
        return list(range(first, first + n))
    starts = rng.permutation(np.arange(0, PAGES - run + 1, run))
    pages = [p for s in starts for p in range(s, s + run)]
    return pages[:n]


@pytest.mark.parametrize("run", [1, 4, 0])
async def test_staged_pull_is_bitwise_exact_for_scattered_pages(
    source: Source, reader: tuple[KvPort, list[np.ndarray]], run: int
) -> None:
    port, pool = reader
    rng = np.random.default_rng(run)
    written: set[int] = set()
    for room, n in enumerate((1, 4, 21, 32), start=100 * (run + 1)):
        src_pages, dst_pages = placement(n, run, rng), placement(n, run, rng)
        written.update(dst_pages)
        desc, endpoint = await source.publish(room, src_pages)
        chunks = sum(r.count for r in desc.staging_runs)
        assert chunks == -(-n // 4) and endpoint.HasField("staging_slab")
        assert (await source.call("stats"))["bytes_in_use"] == chunks * CHUNK
        await port.pull(room, desc, endpoint, source.key, dst_pages, timeout=10, park_timeout=5)
        assert page_bytes(pool, dst_pages) == page_bytes(source.pool, src_pages), (run, n)
        assert await source.call("wait", room) == "done"
        await source.call("unpublish", room, True)
        assert (await source.call("stats"))["bytes_in_use"] == 0
        assert port.staging_bytes_in_use == 0
    assert port.by_transport["staged"].transfers == 4 and port.by_transport["nixl"].transfers == 0
    untouched = sorted(set(range(PAGES)) - written)
    assert not any(np.frombuffer(b, np.uint8).any() for b in page_bytes(pool, untouched))


async def test_full_slabs_fall_back_to_page_runs_and_stay_exact(
    source: Source, reader: tuple[KvPort, list[np.ndarray]]
) -> None:
    port, pool = reader
    rng = np.random.default_rng(7)
    held = [(await source.publish(500 + i, placement(16, 1, rng)))[0] for i in range(3)]
    assert all(len(d.staging_runs) > 0 for d in held)  # 3 rooms x 4 chunks: the source slab is full
    before = (await source.call("stats"))["fallbacks"]
    src_pages, dst_pages = placement(9, 1, rng), placement(9, 1, rng)
    desc, endpoint = await source.publish(510, src_pages)
    assert not desc.staging_runs and (await source.call("stats"))["fallbacks"] == before + 1
    await port.pull(510, desc, endpoint, source.key, dst_pages, timeout=10, park_timeout=5)
    assert page_bytes(pool, dst_pages) == page_bytes(source.pool, src_pages)
    assert port.by_transport["nixl"].transfers == 1
    await source.call("wait", 510)
    await source.call("unpublish", 510, True)
    # The reader's slab is full (taken here by hand): a staged room is read as page runs too.
    room, dst_pages = 500, placement(16, 4, rng)
    src_pages = [r.first_page + k for r in held[0].page_runs for k in range(r.count)]
    assert port._slab is not None
    taken = port._slab.slab.alloc(8)
    assert taken is not None
    await port.pull(room, held[0], endpoint, source.key, dst_pages, timeout=10, park_timeout=5)
    port._slab.slab.free(taken)
    assert page_bytes(pool, dst_pages) == page_bytes(source.pool, src_pages)
    assert port.by_transport["nixl"].transfers == 2 and port.stats()["staging"]["fallbacks"] == 1
    for i in range(3):
        await source.call("unpublish", 500 + i, False)
    assert (await source.call("stats"))["bytes_in_use"] == 0 and port.staging_bytes_in_use == 0


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_abort_mid_transfer_frees_every_slab_chunk(
    reader: tuple[KvPort, list[np.ndarray]], how: str
) -> None:
    """A source that drives NIXL progress every 250 ms keeps the READs in flight past the reader's
    timeout, or its cancel: the pull fails, waits for its READs, returns its ring and tells the source."""
    port, _ = reader
    with _source(f"slow-{how}", 0.25) as slow:
        rng = np.random.default_rng(3)
        desc, endpoint = await slow.publish(700, placement(32, 1, rng))
        dst = placement(32, 1, rng)
        if how == "timeout":
            with pytest.raises(Unavailable) as err:
                await port.pull(700, desc, endpoint, slow.key, dst, timeout=0.05, park_timeout=10)
            assert err.value.reason == "TRANSFER_FAILED"
            assert port.by_transport["staged"].failures == 1
        else:
            task = asyncio.ensure_future(
                port.pull(700, desc, endpoint, slow.key, dst, timeout=10, park_timeout=10)
            )
            for _ in range(1000):  # until the READs are posted (set on the port's thread)
                if port._staged or task.done():
                    break
                await asyncio.sleep(0.005)
            assert port._staged and port.staging_bytes_in_use > 0  # READs in flight into the ring
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # The pull returned only once no READ could write the ring any more.
        assert port.staging_bytes_in_use == 0 and not port._staged
        assert await slow.call("wait", 700) == "fail"
        await slow.call("unpublish", 700, False)
        assert (await slow.call("stats"))["bytes_in_use"] == 0


async def test_forged_staging_runs_are_refused(
    source: Source, reader: tuple[KvPort, list[np.ndarray]]
) -> None:
    port, pool = reader
    desc, endpoint = await source.publish(800, [1, 2, 3, 4, 5])
    forged = dpb.SourceDescriptor()
    forged.CopyFrom(desc)
    forged.staging_runs[0].first_page = SRC_CHUNKS + 5  # past the end of the source's slab
    with pytest.raises(FailedPrecondition) as err:
        await port.pull(800, forged, endpoint, source.key, [6, 7, 8, 9, 10], timeout=5, park_timeout=5)
    assert err.value.reason == "INVALID_SOURCE"
    await port.pull(800, desc, endpoint, source.key, [6, 7, 8, 9, 10], timeout=10, park_timeout=5)
    assert page_bytes(pool, [6, 7, 8, 9, 10]) == page_bytes(source.pool, [1, 2, 3, 4, 5])
    await source.call("unpublish", 800, True)


async def test_refused_destination_pages_hold_no_slab_chunk(
    source: Source, reader: tuple[KvPort, list[np.ndarray]]
) -> None:
    """Destination pages the staged read refuses (repeated, past the pool) fail the pull before any
    READ is posted; the ring it had taken goes back, and the source is told no read comes."""
    port, pool = reader
    for room, dst in ((900, [6, 7, 7, 9, 10]), (901, [6, 7, 8, 9, PAGES])):
        desc, endpoint = await source.publish(room, [1, 2, 3, 4, 5])
        with pytest.raises(Unavailable) as err:
            await port.pull(room, desc, endpoint, source.key, dst, timeout=5, park_timeout=5)
        assert err.value.reason == "TRANSFER_FAILED"
        assert port.staging_bytes_in_use == 0 and not port._staged
        assert await source.call("wait", room) == "fail"
        await source.call("unpublish", room, False)
    await port.pull(902, *(await source.publish(902, [1, 2, 3, 4, 5])), source.key, [6, 7, 8, 9, 10],
                    timeout=10, park_timeout=5)  # fmt: skip
    assert page_bytes(pool, [6, 7, 8, 9, 10]) == page_bytes(source.pool, [1, 2, 3, 4, 5])
    await source.call("unpublish", 902, True)
    assert (await source.call("stats"))["bytes_in_use"] == 0 and port.staging_bytes_in_use == 0


async def test_a_source_slab_of_other_page_records_is_not_read_staged(
    source: Source, reader: tuple[KvPort, list[np.ndarray]]
) -> None:
    """A source whose pages are twice the reader's, with chunks of as many pages: the staged READ would
    land bytes of another layout (I4); the pull reads page runs, whose READ refuses the layout."""
    port, pool = reader
    desc, endpoint = await source.publish(950, [1, 2, 3, 4, 5])
    forged = types_pb2.TransferEndpoint()
    forged.CopyFrom(endpoint)
    for region in (*forged.regions, forged.staging_slab):
        region.bytes_per_page *= 2
    with pytest.raises(Unavailable):
        await port.pull(950, desc, forged, source.key, [6, 7, 8, 9, 10], timeout=5, park_timeout=5)
    assert port.by_transport["staged"].transfers == 0 and port.stats()["staging"]["fallbacks"] == 1
    assert not any(np.frombuffer(b, np.uint8).any() for b in page_bytes(pool, [6, 7, 8, 9, 10]))
    assert port.staging_bytes_in_use == 0
    await source.call("unpublish", 950, False)


async def test_a_room_published_twice_is_refused_and_the_first_stays(
    reader: tuple[KvPort, list[np.ndarray]],
) -> None:
    port, _ = reader
    await port.publish(990, [1, 2, 3, 4, 5], "fp")
    held = port.staging_bytes_in_use
    assert held > 0 and port.published == 1
    with pytest.raises(FailedPrecondition) as err:
        await port.publish(990, [6, 7], "fp")
    assert err.value.reason == "ROOM_BUSY"
    assert port.staging_bytes_in_use == held and port.published == 1 and 990 in port._senders
    await port.unpublish(990, completed=False)
    assert port.staging_bytes_in_use == 0 and port.published == 0


async def test_who_stages_follows_the_transport_setting(reader: tuple[KvPort, list[np.ndarray]]) -> None:
    staged, _ = reader
    assert staged.stages_for(None) and staged.stages_for("host-b") and not staged.needs_reader_host
    assert staged.endpoint("host-a").HasField("staging_slab")
    pool = make_pool(None)
    plain = KvPort(f"staged-auto-{os.getpid()}", kv_buffers(pool), PAGE_SIZE, transport="auto")
    try:
        # DRAM under auto: plain NIXL as before, no slab allocated or offered.
        assert not plain.stages_for(None) and plain.stats()["staging"] is None
        assert not plain.endpoint("host-a").HasField("staging_slab")
        assert plain.transfer_stats_pb().staging_bytes_in_use == 0
    finally:
        await plain.close()
