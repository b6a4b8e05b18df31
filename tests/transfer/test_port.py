"""`KvPort` between two processes, driven only with buffer pointers, page ids and peer keys.

Each side is what SGLang's KV sender / receiver would hand the data plane: numpy buffers' addresses,
lengths, bytes per page and "cpu", then page indices. No engine exists in either process; the descriptor
travels as bytes, as it does through the directory.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from tests.transfer.kvpool import PAGE_SIZE, kv_buffers, make_pool, page_bytes, serve_port, spawned
from xavier_core.runtime.errors import FailedPrecondition, LayoutMismatch, Unavailable
from xavier_core.transfer import KvPort, peer_key
from xavier_core.transfer.common.stuck import REAP_POLL_S
from xavier_core.transfer.nixl.rooms import KvPoll, KvReceiver
from xavier_core.transfer.port.core import DEFAULT_POLL_INTERVAL_S, FLUSH_POLL_S
from xavier_core.transfer.port.pulls import ReadStuck

pytestmark = pytest.mark.integration

SRC_SEED = 23
SRC_KEY = peer_key("port-src", 1)


async def _serve(conn: Connection, name: str, seed: int) -> None:
    pool = make_pool(seed)  # held for the life of the port: NIXL reads these addresses
    await serve_port(conn, KvPort(name, kv_buffers(pool), PAGE_SIZE), "host-a")


def _source_main(conn: Connection, name: str, seed: int) -> None:
    asyncio.run(_serve(conn, name, seed))


class PortSource:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pool = make_pool(SRC_SEED)  # the bytes the source process holds

    async def call(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not await asyncio.to_thread(self.conn.poll, 15):
            raise TimeoutError(f"source did not answer {cmd[0]!r}")
        return self.conn.recv()

    async def publish(
        self, room: int, pages: list[int]
    ) -> tuple[dpb.SourceDescriptor, types_pb2.TransferEndpoint]:
        desc, endpoint = await self.call("publish", room, pages)
        return dpb.SourceDescriptor.FromString(desc), types_pb2.TransferEndpoint.FromString(endpoint)


@pytest.fixture(scope="module")
def source_conn() -> Iterator[Connection]:
    with spawned(_source_main, f"port-src-{os.getpid()}", SRC_SEED) as conn:
        yield conn


@pytest.fixture
async def reader(request: pytest.FixtureRequest) -> AsyncIterator[tuple[KvPort, list[np.ndarray]]]:
    pool = make_pool(None)
    name = f"port-dst-{os.getpid()}-{request.node.name}"  # a fresh agent per test: names must not repeat
    port = KvPort(name, kv_buffers(pool), PAGE_SIZE, device_lock=None)
    try:
        yield port, pool
    finally:
        await port.close()


async def test_pull_copies_exactly_the_published_pages_and_ends_the_room(
    source_conn: Connection, reader: tuple[KvPort, list[np.ndarray]]
) -> None:
    port, pool = reader
    src = PortSource(source_conn)
    src_pages, dst_pages = [9, 10, 11, 40, 2], [60, 61, 62, 0, 33]
    desc, endpoint = await src.publish(101, src_pages)
    assert desc.num_pages == 5 and desc.contract_fingerprint == "fp" and endpoint.host_id == "host-a"
    assert [(r.first_page, r.count) for r in desc.page_runs] == [(9, 3), (40, 1), (2, 1)]
    nbytes, seconds = await port.pull(101, desc, endpoint, SRC_KEY, dst_pages, timeout=10, park_timeout=5)
    assert nbytes == sum(a.nbytes // (a.shape[0] // PAGE_SIZE) for a in pool) * len(dst_pages)
    assert seconds > 0
    assert page_bytes(pool, dst_pages) == page_bytes(src.pool, src_pages)
    untouched = sorted(set(range(64)) - set(dst_pages))
    assert not any(np.frombuffer(b, np.uint8).any() for b in page_bytes(pool, untouched))
    # The reader's done notification ends the source's room without any directory.
    assert await src.call("wait", 101) == "done"
    assert await src.call("unpublish", 101, True) == (0, 1)
    assert port.totals.transfers == 1 and port.totals.bytes == nbytes
    assert port.manager.stats()["receivers"] == 0


async def _serve_counting(conn: Connection, name: str, seed: int) -> None:
    pool = make_pool(seed)
    port = KvPort(name, kv_buffers(pool), PAGE_SIZE)
    jobs = 0
    run = port.run

    async def counted(fn: Any, *args: Any) -> Any:
        nonlocal jobs
        jobs += 1
        return await run(fn, *args)

    port.run = counted  # type: ignore[method-assign]
    extra = {"jobs": lambda: jobs, "senders": lambda: port.manager.stats()["senders"]}
    await serve_port(conn, port, "host-a", extra=extra)


def _counting_source_main(conn: Connection, name: str, seed: int) -> None:
    asyncio.run(_serve_counting(conn, name, seed))


async def test_a_source_whose_reader_said_done_unpublishes_without_the_nixl_thread(
    reader: tuple[KvPort, list[np.ndarray]],
) -> None:
    """The source's NIXL thread forgets a room once its reader's "done" came, so unpublishing it hands
    that thread no job; a room unpublished with no word from a reader still goes through it."""
    port, _ = reader
    with spawned(_counting_source_main, f"port-src-jobs-{os.getpid()}", SRC_SEED) as conn:
        src = PortSource(conn)
        desc, endpoint = await src.publish(401, [3, 4])
        await port.pull(401, desc, endpoint, SRC_KEY, [7, 8], timeout=10, park_timeout=5)
        assert await src.call("wait", 401) == "done"
        assert await src.call("senders") == 0
        jobs = await src.call("jobs")
        assert await src.call("unpublish", 401, True) == (0, 1)
        assert await src.call("jobs") == jobs
        await src.publish(402, [5])
        assert await src.call("senders") == 1
        jobs = await src.call("jobs")
        assert await src.call("unpublish", 402, False) == (0, 1)
        assert await src.call("jobs") == jobs + 1 and await src.call("senders") == 0


async def test_each_fresh_readers_first_done_reaches_the_source() -> None:
    """A reader's "done" leaves from its read-end agent on an endpoint its first message wires up: the
    port keeps polling after the read, so even a new reader's first one arrives (eight new ports, a
    source of their own). Every other port carries "done" on its READ instead (xavier.v1.0's way): the
    source takes either."""
    with spawned(_source_main, f"port-src-fresh-{os.getpid()}", SRC_SEED) as conn:
        await _fresh_readers(PortSource(conn))


async def _fresh_readers(src: PortSource) -> None:
    for i in range(8):
        pool = make_pool(None)
        apart = i % 2 == 0
        port = KvPort(f"port-fresh-{os.getpid()}-{i}", kv_buffers(pool), PAGE_SIZE, read_end_agent=apart)
        try:
            assert port.agent.notifies_apart is apart
            desc, endpoint = await src.publish(300 + i, [i, i + 8])
            await port.pull(300 + i, desc, endpoint, SRC_KEY, [20, 21], timeout=10, park_timeout=5)
            assert page_bytes(pool, [20, 21]) == page_bytes(src.pool, [i, i + 8])
            assert await src.call("wait", 300 + i) == "done"
            assert (await src.call("unpublish", 300 + i, True))[0] == 0
        finally:
            await port.close()


async def test_after_a_read_the_port_polls_on_at_the_flush_rate(
    reader: tuple[KvPort, list[np.ndarray]],
) -> None:
    """A read that ended leaves the port polling for `NOTIF_FLUSH_S`, so a "done" still queued goes out,
    but every `FLUSH_POLL_S`, not at its read interval (under load that window never closes); live work
    (a published source), or a read-end endpoint still being set up, is polled at the read interval."""
    with spawned(_source_main, f"port-src-flush-{os.getpid()}", SRC_SEED) as conn:
        await _polls_on_at_the_flush_rate(reader[0], PortSource(conn))


async def _polls_on_at_the_flush_rate(port: KvPort, src: PortSource) -> None:
    for room, settle in ((103, True), (105, False)):
        desc, endpoint = await src.publish(room, [3, 4])
        await port.pull(room, desc, endpoint, SRC_KEY, [5, 6], timeout=10, park_timeout=5)
        assert await src.call("wait", room) == "done"
        assert (await src.call("unpublish", room, True))[0] == 0
        # The first read met the source: its read-end endpoint is polled fast while it settles.
        for _ in range(100 if settle else 0):
            if not await port.run(port.agent.notifier_settling):
                break
            await asyncio.sleep(0.05)
    busy, interval = await port.run(lambda: (port._busy(), port._interval()))
    assert busy and interval == FLUSH_POLL_S
    await port.publish(104, [7, 8], "fp")
    busy, interval = await port.run(lambda: (port._busy(), port._interval()))
    assert busy and interval == DEFAULT_POLL_INTERVAL_S
    await port.unpublish(104, completed=False)


async def test_decline_tells_the_source_no_read_will_come(
    source_conn: Connection, reader: tuple[KvPort, list[np.ndarray]]
) -> None:
    port, _ = reader
    src = PortSource(source_conn)
    desc, endpoint = await src.publish(102, [1, 2])
    await port.decline(102, desc.read_token, endpoint, SRC_KEY)
    assert await src.call("wait", 102) == "fail"
    assert await src.call("unpublish", 102, False) == (0, 1)


async def test_bad_descriptors_fail_before_any_read(
    source_conn: Connection, reader: tuple[KvPort, list[np.ndarray]]
) -> None:
    port, _ = reader
    src = PortSource(source_conn)
    desc, endpoint = await src.publish(103, [3, 4])
    forged = dpb.SourceDescriptor()
    forged.CopyFrom(desc)
    forged.read_token = "a:b"
    with pytest.raises(FailedPrecondition, match="read_token") as err:
        await port.pull(103, forged, endpoint, SRC_KEY, [5, 6], timeout=5, park_timeout=5)
    assert err.value.reason == "INVALID_SOURCE"
    with pytest.raises(FailedPrecondition) as err:
        await port.pull(103, desc, endpoint, SRC_KEY, [5], timeout=5, park_timeout=5)
    assert err.value.reason == "PAGE_COUNT_MISMATCH"
    short = types_pb2.TransferEndpoint()
    short.CopyFrom(endpoint)
    del short.regions[1:]
    with pytest.raises(LayoutMismatch):
        await port.pull(103, desc, short, SRC_KEY, [5, 6], timeout=5, park_timeout=5)
    # None of those touched the source: the real read still works.
    await port.pull(103, desc, endpoint, SRC_KEY, [5, 6], timeout=10, park_timeout=5)
    assert await src.call("wait", 103) == "done"
    await src.call("unpublish", 103, True)


async def test_a_failed_read_still_running_at_the_park_timeout_is_told_apart(
    source_conn: Connection, reader: tuple[KvPort, list[np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull that times out and whose READ NIXL will not let go of within the park timeout raises
    `ReadStuck` (not the plain transfer failure a caller may free its pages after), and the port
    remembers the room once for the caller (`take_stuck`), with a future that completes once the READ
    has let go."""
    port, _ = reader
    src = PortSource(source_conn)
    desc, endpoint = await src.publish(104, [3, 4])
    # No read is ever seen to end, so the pull times out; and its READ never lets go of the pages.
    monkeypatch.setattr(KvReceiver, "poll", lambda self: KvPoll.TRANSFERRING)
    monkeypatch.setattr(KvReceiver, "wait_idle", lambda self, timeout: False)
    with pytest.raises(ReadStuck) as err:
        await port.pull(104, desc, endpoint, SRC_KEY, [7, 8], timeout=0.1, park_timeout=0.2)
    assert err.value.reason == "TRANSFER_STUCK"
    released = port.take_stuck(104)
    assert released is not None and port.take_stuck(104) is None
    assert not released.done()
    monkeypatch.undo()  # the READ lets go now: the port says so within its next ask
    await asyncio.wait_for(released, 10 * REAP_POLL_S)
    # A pull that times out and lets go in time is the plain failure, and nothing is remembered.
    monkeypatch.setattr(KvReceiver, "poll", lambda self: KvPoll.TRANSFERRING)
    desc, endpoint = await src.publish(105, [3, 4])
    with pytest.raises(Unavailable) as plain:
        await port.pull(105, desc, endpoint, SRC_KEY, [7, 8], timeout=0.1, park_timeout=5)
    assert not isinstance(plain.value, ReadStuck) and plain.value.reason == "TRANSFER_FAILED"
    assert port.take_stuck(105) is None
    for room in (104, 105):
        await src.call("unpublish", room, False)
