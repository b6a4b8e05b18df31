"""The directory as a real process over gRPC, driven through ``xavier_core.directory``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.peer.room_feed import RoomFeed

from tests.directory.helpers import lifecycle, register_request, source
from tests.support.procs import ServiceProc, start_service
from xavier_core.directory import DirectoryClient, PeerSession
from xavier_core.runtime.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    LayoutMismatch,
    LeaseExpired,
    NotFound,
)

pytestmark = pytest.mark.integration

ENV = {
    "XAVIER_DIRECTORY__HEARTBEAT_INTERVAL_SECONDS": "0.3",
    "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "3",
    "XAVIER_DIRECTORY__SWEEP_INTERVAL_SECONDS": "0.05",
    "XAVIER_DIRECTORY__MAX_ROOMS": "256",
    "XAVIER_DIRECTORY__MAX_PAGE_RUNS": "64",
}
PREFILL, DECODE = types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProc]:
    workdir = tmp_path_factory.mktemp("dir")
    proc = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], workdir, env=ENV)
    yield proc
    proc.stop()


@pytest.fixture
async def client(directory: ServiceProc) -> AsyncIterator[DirectoryClient]:
    async with DirectoryClient(directory.address, timeout=5.0) as c:
        yield c


async def _pair(client: DirectoryClient, tag: str) -> tuple[PeerSession, PeerSession]:
    p = PeerSession(client, register_request(f"p-{tag}", PREFILL))
    d = PeerSession(client, register_request(f"d-{tag}", DECODE))
    await asyncio.gather(p.start(), d.start())
    return p, d


async def test_concurrent_lifecycles_return_stats_to_zero(client: DirectoryClient) -> None:
    p, d = await _pair(client, "conc")
    before = await client.get_stats()
    seen = await asyncio.gather(*(lifecycle(client, p.registration, d.registration) for _ in range(200)))
    want = [
        dpb.ROOM_STATE_OPEN,
        dpb.ROOM_STATE_SOURCE_READY,
        dpb.ROOM_STATE_COMPLETED,
        dpb.ROOM_STATE_RELEASED,
    ]
    assert all(s == want for s in seen)
    stats = await client.get_stats()
    assert stats.rooms_active == 0
    assert stats.rooms_released - before.rooms_released == 200
    assert stats.rooms_opened - before.rooms_opened == 200
    for state in ("OPEN", "SOURCE_READY", "TRANSFERRING", "COMPLETED"):
        assert stats.rooms_by_state[f"ROOM_STATE_{state}"] == 0
    await p.stop()
    await d.stop()


async def test_short_lease_expiry_notifies_watchers(client: DirectoryClient) -> None:
    p, d = await _pair(client, "lease")
    pr, dr = p.registration, d.registration
    room = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch, lease=0.3)
    start = time.monotonic()
    states = [r async for r in client.watch_room(room.room_id, timeout=10)]
    assert [s.state for s in states] == [dpb.ROOM_STATE_OPEN, dpb.ROOM_STATE_EXPIRED]
    assert 0.25 <= time.monotonic() - start < 2.0
    assert states[-1].end_reason == "lease expired"
    with pytest.raises(LeaseExpired):
        await client.publish_source(room.room_id, pr.peer_id, pr.epoch, source())
    await p.stop()
    await d.stop()


async def test_completed_room_renewed_past_its_retention(client: DirectoryClient) -> None:
    p, d = await _pair(client, "renew")
    pr, dr = p.registration, d.registration
    room = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch, lease=5)
    await client.publish_source(room.room_id, pr.peer_id, pr.epoch, source())
    await client.begin_transfer(room.room_id, dr.peer_id, dr.epoch)
    await client.complete_room(room.room_id, dr.peer_id, dr.epoch)
    for _ in range(3):
        await client.renew_lease(room.room_id, dr.peer_id, dr.epoch, lease=0.4)
        await asyncio.sleep(0.25)
    assert (await client.get_room(room.room_id)).state == dpb.ROOM_STATE_COMPLETED
    await client.release_room(room.room_id, PREFILL, pr.peer_id, pr.epoch)
    released = await client.release_room(room.room_id, DECODE, dr.peer_id, dr.epoch)
    assert released.state == dpb.ROOM_STATE_RELEASED
    await p.stop()
    await d.stop()


async def test_peer_restart_gets_new_epoch_and_old_epoch_is_rejected(client: DirectoryClient) -> None:
    p, d = await _pair(client, "restart")
    old, dr = p.registration, d.registration
    room = await client.open_room(old.peer_id, old.epoch, dr.peer_id, dr.epoch)
    await p.stop(unregister=False)
    # The restarted process registers the same peer id again.
    p2 = PeerSession(client, register_request("p-restart", PREFILL))
    new = await p2.start()
    assert new.epoch > old.epoch
    ended = await client.get_room(room.room_id)
    assert ended.state == dpb.ROOM_STATE_ABORTED and "restarted" in ended.end_reason
    with pytest.raises(FailedPrecondition) as err:
        await client.publish_source(room.room_id, old.peer_id, old.epoch, source())
    assert err.value.reason == "STALE_EPOCH" and err.value.metadata["current_epoch"] == str(new.epoch)
    with pytest.raises(FailedPrecondition, match="stale") as err:
        await client.open_room(old.peer_id, old.epoch, dr.peer_id, dr.epoch)
    assert err.value.reason == "STALE_EPOCH"
    with pytest.raises(FailedPrecondition) as err:
        await client.heartbeat(old.peer_id, old.epoch)
    assert err.value.reason == "STALE_EPOCH"
    assert await lifecycle(client, new, dr)
    await p2.stop()
    await d.stop()


async def test_bad_input(client: DirectoryClient) -> None:
    p, d = await _pair(client, "bad")
    pr, dr = p.registration, d.registration
    with pytest.raises(NotFound) as nf:
        await client.get_room(12345)
    assert nf.value.reason == "ROOM_NOT_FOUND"
    for bad_id in (0, 1 << 63, (1 << 64) - 1):
        with pytest.raises(InvalidArgument):
            await client.get_room(bad_id)
    with pytest.raises(NotFound) as nf:
        await client.open_room("nobody", 1, dr.peer_id, dr.epoch)
    assert nf.value.reason == "PEER_NOT_FOUND"
    with pytest.raises(FailedPrecondition) as fp:
        await client.open_room(dr.peer_id, dr.epoch, pr.peer_id, pr.epoch)
    assert fp.value.reason == "WRONG_ROLE"
    room = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    with pytest.raises(FailedPrecondition) as fp:
        await client.publish_source(room.room_id, dr.peer_id, dr.epoch, source())
    assert fp.value.reason == "WRONG_ROLE"
    with pytest.raises(FailedPrecondition) as fp:
        await client.complete_room(room.room_id, dr.peer_id, dr.epoch)
    assert fp.value.reason == "WRONG_STATE"
    runs = [types_pb2.PageRun(first_page=i, count=1) for i in range(65)]
    huge = dpb.SourceDescriptor(page_runs=runs, num_pages=65)
    with pytest.raises(InvalidArgument, match="page_runs"):
        await client.publish_source(room.room_id, pr.peer_id, pr.epoch, huge)
    with pytest.raises(InvalidArgument, match="num_pages"):
        await client.publish_source(room.room_id, pr.peer_id, pr.epoch, dpb.SourceDescriptor(num_pages=3))
    with pytest.raises(InvalidArgument, match="lease"):
        await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch, lease=10_000)
    with pytest.raises(InvalidArgument):
        await client.register_peer(dpb.RegisterPeerRequest(peer_id="x" * 200, role=PREFILL, address="a:1"))
    with pytest.raises(InvalidArgument, match="layout"):
        await client.register_peer(dpb.RegisterPeerRequest(peer_id="nolayout", role=PREFILL, address="a:1"))
    # The room is still usable after every rejected call.
    assert (await client.get_room(room.room_id)).state == dpb.ROOM_STATE_OPEN
    aborted = await client.abort_room(room.room_id, "client went away")
    assert aborted.state == dpb.ROOM_STATE_ABORTED and aborted.end_reason == "client went away"
    await p.stop()
    await d.stop()


async def test_layout_mismatch_names_every_field(client: DirectoryClient) -> None:
    p = PeerSession(client, register_request("p-mm", PREFILL))
    d = PeerSession(client, register_request("d-mm", DECODE, dtype="float16", page_size=16))
    pr, dr = await asyncio.gather(p.start(), d.start())
    with pytest.raises(LayoutMismatch) as err:
        await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    assert err.value.reason == "LAYOUT_MISMATCH"
    assert err.value.metadata["fields"] == "dtype,page_size"
    assert "dtype" in err.value.message and "page_size" in err.value.message
    assert err.value.metadata["page_size"] == "prefill=4 decode=16"
    await p.stop()
    await d.stop()


async def test_capacity_and_list_peers(tmp_path: Path) -> None:
    env = {**ENV, "XAVIER_DIRECTORY__MAX_ROOMS": "3", "XAVIER_DIRECTORY__LIST_PAGE_SIZE": "2"}
    proc = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path, env=env)
    try:
        async with DirectoryClient(proc.address) as client:
            p, d = await _pair(client, "cap")
            pr, dr = p.registration, d.registration
            rooms = [await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch) for _ in range(3)]
            with pytest.raises(CapacityExhausted):
                await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
            await client.abort_room(rooms[0].room_id, "make room")
            await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
            for i in range(3):
                await PeerSession(client, register_request(f"u-{i}", types_pb2.ROLE_UNIFIED)).start()
            peers = await client.list_peers()
            assert [x.peer_id for x in peers] == sorted(["p-cap", "d-cap", "u-0", "u-1", "u-2"])
            unified = await client.list_peers(role=types_pb2.ROLE_UNIFIED)
            assert [x.peer_id for x in unified] == ["u-0", "u-1", "u-2"]
            assert (await client.unregister_peer(pr.peer_id, pr.epoch)) == 3
            assert (await client.get_stats()).rooms_active == 0
    finally:
        proc.stop()


async def test_directory_restart_peers_reregister_within_one_heartbeat(tmp_path: Path) -> None:
    interval = 0.3
    proc = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path / "a", env=ENV)
    address = proc.address
    try:
        async with DirectoryClient(address, timeout=2.0) as client:
            p, d = await _pair(client, "dirrestart")
            assert p.interval == pytest.approx(interval)
            old_p, old_d = p.registration, d.registration
            assert proc.stop() == 0
            await asyncio.sleep(2 * interval)  # heartbeats fail meanwhile (UNAVAILABLE) and are retried
            proc = start_service("xavier-directory", ["--listen", address], tmp_path / "b", env=ENV)
            back = time.monotonic()
            new_p, new_d = await asyncio.gather(
                p.wait_registered(old_p.epoch, timeout=10), d.wait_registered(old_d.epoch, timeout=10)
            )
            # One heartbeat period, plus the reconnect (backoff capped at 1 s) and scheduling slack.
            assert time.monotonic() - back < interval + 1.5
            assert new_p.epoch > old_p.epoch and new_d.epoch > old_d.epoch
            stats = await client.get_stats()
            assert stats.peers_by_role["ROLE_PREFILL"] == 1 and stats.peers_by_role["ROLE_DECODE"] == 1
            assert (await lifecycle(client, new_p, new_d))[-1] == dpb.ROOM_STATE_RELEASED
            await p.stop()
            await d.stop()
    finally:
        proc.stop()


async def test_begin_transfer_waits_for_the_source(client: DirectoryClient) -> None:
    p, d = await _pair(client, "wait")
    pr, dr = p.registration, d.registration
    room = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    begin = asyncio.ensure_future(
        client.begin_transfer(room.room_id, dr.peer_id, dr.epoch, request_id="b1", wait_for_source=10)
    )
    await asyncio.sleep(0.3)
    assert not begin.done()  # still OPEN: the call waits in the directory
    src = source()
    src.read_token = "secret"
    await client.publish_source(room.room_id, pr.peer_id, pr.epoch, src)
    began = await asyncio.wait_for(begin, 5)
    assert began.state == dpb.ROOM_STATE_TRANSFERRING
    assert began.source.num_pages == 3
    # The read token goes to the room's decode only: never in GetRoom or WatchRoom answers.
    assert began.source.read_token == "secret"
    seen = await client.get_room(room.room_id)
    assert seen.source.num_pages == 3 and seen.source.read_token == ""
    watch = client.watch_room(room.room_id, timeout=5)
    assert (await anext(watch)).source.read_token == ""
    await watch.aclose()
    # A retry of the same request id is answered from the applied change.
    again = await client.begin_transfer(
        room.room_id, dr.peer_id, dr.epoch, request_id="b1", wait_for_source=5
    )
    assert again.state == dpb.ROOM_STATE_TRANSFERRING
    done = await client.complete_room(room.room_id, dr.peer_id, dr.epoch, release=True)
    assert done.state == dpb.ROOM_STATE_RELEASED
    assert done.prefill_released and done.decode_released
    # Both sides are done: a late ReleaseRoom is a no-op on the ended room.
    late = await client.release_room(room.room_id, PREFILL, pr.peer_id, pr.epoch)
    assert late.state == dpb.ROOM_STATE_RELEASED
    await p.stop()
    await d.stop()


async def test_begin_transfer_wait_returns_an_ended_room(client: DirectoryClient) -> None:
    p, d = await _pair(client, "wait-end")
    pr, dr = p.registration, d.registration
    room = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    begin = asyncio.ensure_future(
        client.begin_transfer(room.room_id, dr.peer_id, dr.epoch, wait_for_source=10)
    )
    await asyncio.sleep(0.2)
    await client.abort_room(room.room_id, "client went away")
    ended = await asyncio.wait_for(begin, 5)
    assert ended.state == dpb.ROOM_STATE_ABORTED
    assert ended.end_reason == "client went away"
    # Only the decode of the room may wait on it.
    other = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    with pytest.raises(FailedPrecondition) as err:
        await client.begin_transfer(other.room_id, pr.peer_id, pr.epoch, wait_for_source=1)
    assert err.value.reason == "WRONG_ROLE"
    # The wait is bounded by the call's deadline.
    t0 = time.monotonic()
    with pytest.raises(Exception) as late:
        await client.begin_transfer(other.room_id, dr.peer_id, dr.epoch, wait_for_source=0.3)
    assert "DEADLINE" in type(late.value).__name__.upper() or "deadline" in str(late.value).lower()
    assert time.monotonic() - t0 < 3
    await client.abort_room(other.room_id, "done")
    await p.stop()
    await d.stop()


async def test_peer_feed_streams_every_room_of_the_peer(client: DirectoryClient) -> None:
    p, d = await _pair(client, "feed")
    pr, dr = p.registration, d.registration
    live = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    feed = client.watch_peer_rooms(pr.peer_id, pr.epoch)
    snapshot = await anext(feed)
    assert [r.room_id for r in snapshot] == [live.room_id]
    await client.publish_source(live.room_id, pr.peer_id, pr.epoch, source())
    await client.begin_transfer(live.room_id, dr.peer_id, dr.epoch)
    await client.complete_room(live.room_id, dr.peer_id, dr.epoch, release=True)
    states: list[int] = []
    while len(states) < 4:
        batch = await asyncio.wait_for(anext(feed), 5)
        assert all(not r.HasField("source") for r in batch)  # the feed leaves the page runs out
        states += [r.state for r in batch if r.room_id == live.room_id]
    assert states == [
        dpb.ROOM_STATE_SOURCE_READY,
        dpb.ROOM_STATE_TRANSFERRING,
        dpb.ROOM_STATE_COMPLETED,
        dpb.ROOM_STATE_RELEASED,
    ]
    await feed.aclose()
    with pytest.raises(FailedPrecondition) as err:
        await anext(client.watch_peer_rooms(pr.peer_id, pr.epoch + 1))
    assert err.value.reason == "STALE_EPOCH"
    with pytest.raises(NotFound):
        await anext(client.watch_peer_rooms("nobody", 1))
    await p.stop()
    await d.stop()


async def _connected_feed(client: DirectoryClient, peer_id: str, epoch: int) -> RoomFeed:
    feed = RoomFeed(client, lambda: (peer_id, epoch))
    feed.start()
    await asyncio.wait_for(feed.connected.wait(), 5)
    return feed


async def test_room_feed_outcomes(client: DirectoryClient) -> None:
    p, d = await _pair(client, "roomfeed")
    pr, dr = p.registration, d.registration
    feed = await _connected_feed(client, pr.peer_id, pr.epoch)
    # Completed and released by the decode; the change lands before anyone waits for it.
    read = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    await client.publish_source(read.room_id, pr.peer_id, pr.epoch, source())
    await client.begin_transfer(read.room_id, dr.peer_id, dr.epoch)
    await client.complete_room(read.room_id, dr.peer_id, dr.epoch, release=True)
    await asyncio.sleep(0.2)
    assert await feed.outcome(read.room_id, 5) == (dpb.ROOM_STATE_RELEASED, True)
    # Aborted before any read began: no reader can exist.
    unread = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    await client.publish_source(unread.room_id, pr.peer_id, pr.epoch, source())
    waiting = asyncio.ensure_future(feed.outcome(unread.room_id, 5))
    await asyncio.sleep(0.1)
    await client.abort_room(unread.room_id, "cancelled")
    assert await waiting == (dpb.ROOM_STATE_ABORTED, False)
    # Aborted during the read: a read may have started.
    mid = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    await client.publish_source(mid.room_id, pr.peer_id, pr.epoch, source())
    await client.begin_transfer(mid.room_id, dr.peer_id, dr.epoch)
    await client.abort_room(mid.room_id, "cancelled")
    assert await feed.outcome(mid.room_id, 5) == (dpb.ROOM_STATE_ABORTED, True)
    # A room that never ends within the timeout: the caller must assume a reader.
    stuck = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    assert await feed.outcome(stuck.room_id, 0.2) == (dpb.ROOM_STATE_UNSPECIFIED, True)
    await client.abort_room(stuck.room_id, "done")
    for r in (read, unread, mid, stuck):
        feed.forget(r.room_id)
    await feed.stop()
    await p.stop()
    await d.stop()


async def test_open_room_with_a_chosen_id(client: DirectoryClient) -> None:
    p, d = await _pair(client, "chosen")
    pr, dr = p.registration, d.registration
    room = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch, room_id=12345, request_id="c1")
    assert room.room_id == 12345
    # The same request again is the same room; another request for the id is refused.
    again = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch, room_id=12345, request_id="c1")
    assert again.room_id == 12345
    with pytest.raises(FailedPrecondition) as err:
        await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch, room_id=12345, request_id="c2")
    assert err.value.reason == "ROOM_EXISTS"
    with pytest.raises(InvalidArgument):
        await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch, room_id=1 << 63)
    await client.abort_room(12345, "done")
    await p.stop()
    await d.stop()


async def test_decode_declines_the_read(client: DirectoryClient) -> None:
    p, d = await _pair(client, "decline")
    pr, dr = p.registration, d.registration
    feed = await _connected_feed(client, pr.peer_id, pr.epoch)
    # The decode began the transfer, then ended the room saying it never posted a read.
    a = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    await client.publish_source(a.room_id, pr.peer_id, pr.epoch, source())
    await client.begin_transfer(a.room_id, dr.peer_id, dr.epoch)
    ended = await client.abort_room(a.room_id, "cancelled", dr.peer_id, dr.epoch, no_read=True)
    assert ended.state == dpb.ROOM_STATE_ABORTED and ended.read_declined
    assert await feed.outcome(a.room_id, 5) == (dpb.ROOM_STATE_ABORTED, False)
    # The router ended it first (a read may have begun); the decode's word comes after and still counts.
    b = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    await client.publish_source(b.room_id, pr.peer_id, pr.epoch, source())
    await client.begin_transfer(b.room_id, dr.peer_id, dr.epoch)
    await client.abort_room(b.room_id, "client went away")
    assert await feed.outcome(b.room_id, 5) == (dpb.ROOM_STATE_ABORTED, True)
    declined = asyncio.ensure_future(feed.read_declined(b.room_id, 5))
    await asyncio.sleep(0.1)
    assert not declined.done()
    late = await client.abort_room(b.room_id, "cancelled", dr.peer_id, dr.epoch, no_read=True)
    assert late.state == dpb.ROOM_STATE_ABORTED and late.read_declined
    assert await asyncio.wait_for(declined, 5)
    # Only the room's decode may say so.
    c = await client.open_room(pr.peer_id, pr.epoch, dr.peer_id, dr.epoch)
    with pytest.raises(FailedPrecondition) as err:
        await client.abort_room(c.room_id, "x", pr.peer_id, pr.epoch, no_read=True)
    assert err.value.reason == "WRONG_ROLE"
    with pytest.raises(FailedPrecondition):
        await client.abort_room(c.room_id, "x", no_read=True)
    await client.abort_room(c.room_id, "done")
    for r in (a, b, c):
        feed.forget(r.room_id)
    await feed.stop()
    await p.stop()
    await d.stop()
