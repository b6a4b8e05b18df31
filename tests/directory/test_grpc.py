"""The directory as a real process over gRPC, driven through ``xavier_core.directory``."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from tests.directory.helpers import lifecycle, register_request, source
from tests.support.procs import ServiceProc, start_service
from xavier_core.directory import DirectoryClient, PeerSession, Registration
from xavier_core.directory.room_feed import RoomFeed
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
    "XAVIER_DIRECTORY__ROOM_LEASE_SECONDS": "2",
}
PREFILL, DECODE = types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE
ROUTER = dpb.ROOM_END_CAUSE_ROUTER_ABORT
Id = tuple[str, int]


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


def new_id() -> int:
    return secrets.randbits(63) or 1


def ids(p: PeerSession | Registration, d: PeerSession | Registration) -> tuple[Id, Id]:
    pr = p.registration if isinstance(p, PeerSession) else p
    dr = d.registration if isinstance(d, PeerSession) else d
    return (pr.peer_id, pr.epoch), (dr.peer_id, dr.epoch)


async def decode_waits(
    client: DirectoryClient, p: Id, d: Id, room_id: int, wait: float = 10
) -> asyncio.Future[dpb.BeginTransferResponse]:
    """The decode's BeginTransfer, once it opened the room and waits in it."""
    begin = asyncio.ensure_future(client.begin_transfer(room_id, p, d, wait_for_source=wait))
    for _ in range(400):
        try:
            if (await client.get_room(room_id)).state == dpb.ROOM_STATE_OPEN:
                return begin
        except NotFound:
            pass
        await asyncio.sleep(0.005)
    raise AssertionError("the decode never opened the room")


async def test_concurrent_lifecycles_return_stats_to_zero(client: DirectoryClient) -> None:
    p, d = await _pair(client, "conc")
    before = await client.get_stats()
    seen = await asyncio.gather(
        *(lifecycle(client, p.registration, d.registration, new_id()) for _ in range(200))
    )
    want = [
        dpb.ROOM_STATE_OPEN,
        dpb.ROOM_STATE_SOURCE_READY,
        dpb.ROOM_STATE_TRANSFERRING,
        dpb.ROOM_STATE_COMPLETED,
    ]
    assert all(s == want for s in seen)
    stats = await client.get_stats()
    assert stats.rooms_active == 0
    assert stats.rooms_completed - before.rooms_completed == 200
    assert stats.rooms_opened - before.rooms_opened == 200
    for state in ("OPEN", "SOURCE_READY", "TRANSFERRING"):
        assert stats.rooms_by_state[f"ROOM_STATE_{state}"] == 0
    await p.stop()
    await d.stop()


async def test_room_lease_expiry_ends_waits_and_calls(client: DirectoryClient) -> None:
    p, d = await _pair(client, "lease")
    pi, di = ids(p, d)
    room_id = new_id()
    start = time.monotonic()
    begin = await decode_waits(client, pi, di, room_id)
    ended = (await asyncio.wait_for(begin, 5)).room
    assert 1.9 <= time.monotonic() - start < 4.0
    assert ended.state == dpb.ROOM_STATE_EXPIRED and ended.end_cause == dpb.ROOM_END_CAUSE_LEASE_EXPIRED
    # A publication after the room ended is answered with the ended room: nobody will read it.
    late = await client.publish_source(room_id, pi, di, source())
    assert late.state == dpb.ROOM_STATE_EXPIRED
    with pytest.raises(LeaseExpired):
        await client.begin_transfer(room_id, pi, di)
    await p.stop()
    await d.stop()


async def test_peer_restart_gets_new_epoch_and_old_epoch_is_rejected(client: DirectoryClient) -> None:
    p, d = await _pair(client, "restart")
    old, dr = p.registration, d.registration
    pi, di = ids(old, dr)
    room = await client.publish_source(new_id(), pi, di, source())
    await p.stop(unregister=False)
    # The restarted process registers the same peer id again.
    p2 = PeerSession(client, register_request("p-restart", PREFILL))
    new = await p2.start()
    assert new.epoch > old.epoch
    ended = await client.get_room(room.room_id)
    assert ended.state == dpb.ROOM_STATE_ABORTED and ended.end_cause == dpb.ROOM_END_CAUSE_PEER_LOST
    assert "restarted" in ended.end_detail
    with pytest.raises(FailedPrecondition) as err:
        await client.publish_source(new_id(), pi, di, source())
    assert err.value.reason == "STALE_EPOCH" and err.value.metadata["current_epoch"] == str(new.epoch)
    with pytest.raises(FailedPrecondition, match="stale") as err:
        await client.begin_transfer(new_id(), pi, di, wait_for_source=1)
    assert err.value.reason == "STALE_EPOCH"
    with pytest.raises(FailedPrecondition) as err:
        await client.heartbeat(old.peer_id, old.epoch)
    assert err.value.reason == "STALE_EPOCH"
    assert await lifecycle(client, new, dr, new_id())
    await p2.stop()
    await d.stop()


async def test_bad_input(client: DirectoryClient) -> None:
    p, d = await _pair(client, "bad")
    pi, di = ids(p, d)
    with pytest.raises(NotFound) as nf:
        await client.get_room(12345)
    assert nf.value.reason == "ROOM_NOT_FOUND"
    for bad_id in (0, 1 << 63, (1 << 64) - 1):
        with pytest.raises(InvalidArgument):
            await client.get_room(bad_id)
    with pytest.raises(InvalidArgument):
        await client.publish_source(1 << 63, pi, di, source())
    with pytest.raises(NotFound) as nf:
        await client.begin_transfer(new_id(), ("nobody", 1), di, wait_for_source=1)
    assert nf.value.reason == "PEER_NOT_FOUND"
    with pytest.raises(FailedPrecondition) as fp:
        await client.publish_source(new_id(), di, pi, source())
    assert fp.value.reason == "WRONG_ROLE"
    room = await client.publish_source(new_id(), pi, di, source())
    with pytest.raises(FailedPrecondition) as fp:
        await client.complete_room(room.room_id, *pi)
    assert fp.value.reason == "WRONG_ROLE"
    runs = [types_pb2.PageRun(first_page=i, count=1) for i in range(65)]
    huge = dpb.SourceDescriptor(page_runs=runs, num_pages=65)
    with pytest.raises(InvalidArgument, match="page_runs"):
        await client.publish_source(new_id(), pi, di, huge)
    with pytest.raises(InvalidArgument, match="num_pages"):
        await client.publish_source(new_id(), pi, di, dpb.SourceDescriptor(num_pages=3))
    with pytest.raises(InvalidArgument, match="cause"):
        await client.abort_room(room.room_id, dpb.ROOM_END_CAUSE_UNSPECIFIED)
    with pytest.raises(InvalidArgument):
        await client.register_peer(dpb.RegisterPeerRequest(peer_id="x" * 200, role=PREFILL, address="a:1"))
    with pytest.raises(InvalidArgument, match="layout"):
        await client.register_peer(dpb.RegisterPeerRequest(peer_id="nolayout", role=PREFILL, address="a:1"))
    for token in ("!!!", "a", "Zm9v!"):  # not base64url: refused, not read as "from the start"
        with pytest.raises(InvalidArgument, match="page_token"):
            await client._call(client.stub.ListPeers, dpb.ListPeersRequest(page_token=token))
    # The room is still usable after every rejected call.
    assert (await client.get_room(room.room_id)).state == dpb.ROOM_STATE_SOURCE_READY
    aborted = await client.abort_room(room.room_id, ROUTER, "client went away")
    assert aborted.state == dpb.ROOM_STATE_ABORTED and aborted.end_detail == "client went away"
    assert aborted.end_cause == ROUTER
    await p.stop()
    await d.stop()


async def test_layout_mismatch_names_every_field(client: DirectoryClient) -> None:
    p = PeerSession(client, register_request("p-mm", PREFILL))
    d = PeerSession(client, register_request("d-mm", DECODE, dtype="float16", page_size=16))
    await asyncio.gather(p.start(), d.start())
    pi, di = ids(p, d)
    with pytest.raises(LayoutMismatch) as err:
        await client.publish_source(new_id(), pi, di, source())
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
            pi, di = ids(p, d)
            rooms = [await client.publish_source(new_id(), pi, di, source()) for _ in range(3)]
            with pytest.raises(CapacityExhausted):
                await client.publish_source(new_id(), pi, di, source())
            await client.abort_room(rooms[0].room_id, ROUTER, "make room")
            await client.publish_source(new_id(), pi, di, source())
            for i in range(3):
                await PeerSession(client, register_request(f"u-{i}", types_pb2.ROLE_UNIFIED)).start()
            peers = await client.list_peers()
            assert [x.peer_id for x in peers] == sorted(["p-cap", "d-cap", "u-0", "u-1", "u-2"])
            unified = await client.list_peers(role=types_pb2.ROLE_UNIFIED)
            assert [x.peer_id for x in unified] == ["u-0", "u-1", "u-2"]
            assert (await client.unregister_peer(*pi)) == 3
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
            assert (await lifecycle(client, new_p, new_d, new_id()))[-1] == dpb.ROOM_STATE_COMPLETED
            await p.stop()
            await d.stop()
    finally:
        proc.stop()


async def test_begin_transfer_waits_for_the_source(client: DirectoryClient) -> None:
    p, d = await _pair(client, "wait")
    pi, di = ids(p, d)
    room_id = new_id()
    begin = asyncio.ensure_future(client.begin_transfer(room_id, pi, di, request_id="b1", wait_for_source=10))
    await asyncio.sleep(0.3)
    assert not begin.done()  # the decode opened the room and waits in it
    assert (await client.get_room(room_id)).state == dpb.ROOM_STATE_OPEN
    src = source()
    src.read_token = "secret"
    assert (await client.publish_source(room_id, pi, di, src)).source.read_token == ""
    began = await asyncio.wait_for(begin, 5)
    assert began.room.state == dpb.ROOM_STATE_TRANSFERRING
    assert began.room.source.num_pages == 3
    assert began.source_endpoint.agent_name == pi[0]
    # The read token goes to the room's decode only: never in GetRoom answers.
    assert began.room.source.read_token == "secret"
    seen = await client.get_room(room_id)
    assert seen.source.num_pages == 3 and seen.source.read_token == ""
    # A retry of the same request id is answered from the applied change; a cached endpoint is left out.
    again = await client.begin_transfer(
        room_id, pi, di, request_id="b1", wait_for_source=5, source_endpoint_cached=True
    )
    assert again.room.state == dpb.ROOM_STATE_TRANSFERRING and not again.HasField("source_endpoint")
    done = await client.complete_room(room_id, *di)
    assert done.state == dpb.ROOM_STATE_COMPLETED and done.end_cause == dpb.ROOM_END_CAUSE_UNSPECIFIED
    await p.stop()
    await d.stop()


async def test_begin_transfer_wait_returns_an_ended_room(client: DirectoryClient) -> None:
    p, d = await _pair(client, "wait-end")
    pi, di = ids(p, d)
    room_id = new_id()
    begin = await decode_waits(client, pi, di, room_id)
    await client.abort_room(room_id, ROUTER, "client went away")
    ended = (await asyncio.wait_for(begin, 5)).room
    assert ended.state == dpb.ROOM_STATE_ABORTED and ended.end_cause == ROUTER
    assert ended.end_detail == "client went away"
    # The wait is bounded by the call's deadline.
    other = new_id()
    t0 = time.monotonic()
    with pytest.raises(Exception) as late:
        await client.begin_transfer(other, pi, di, wait_for_source=0.3)
    assert "DEADLINE" in type(late.value).__name__.upper() or "deadline" in str(late.value).lower()
    assert time.monotonic() - t0 < 3
    await client.abort_room(other, ROUTER, "done")
    await p.stop()
    await d.stop()


async def test_abort_before_either_side_came_is_seen_by_both(client: DirectoryClient) -> None:
    p, d = await _pair(client, "tomb")
    pi, di = ids(p, d)
    before = await client.get_stats()
    room_id = new_id()
    tomb = await client.abort_room(room_id, dpb.ROOM_END_CAUSE_PREFILL_FAILED, "prefill failed", *pi)
    assert tomb.state == dpb.ROOM_STATE_ABORTED and not tomb.prefill_peer_id
    begun = await asyncio.wait_for(client.begin_transfer(room_id, pi, di, wait_for_source=5), 2)
    assert begun.room.end_cause == dpb.ROOM_END_CAUSE_PREFILL_FAILED
    assert (await client.publish_source(room_id, pi, di, source())).state == dpb.ROOM_STATE_ABORTED
    after = await client.get_stats()
    assert after.rooms_opened == before.rooms_opened and after.rooms_active == before.rooms_active
    await p.stop()
    await d.stop()


async def test_a_pair_other_than_the_rooms_is_refused(client: DirectoryClient) -> None:
    p, d = await _pair(client, "pairs")
    pi, di = ids(p, d)
    room = await client.publish_source(new_id(), pi, di, source())
    with pytest.raises(FailedPrecondition) as err:
        await client.begin_transfer(room.room_id, (pi[0], pi[1] + 1), di, wait_for_source=1)
    assert err.value.reason == "PAIR_MISMATCH"
    await client.abort_room(room.room_id, ROUTER)
    await p.stop()
    await d.stop()


async def test_peer_feed_streams_every_room_of_the_peer(client: DirectoryClient) -> None:
    p, d = await _pair(client, "feed")
    pi, di = ids(p, d)
    live = await client.publish_source(new_id(), pi, di, source())
    feed = client.watch_peer_rooms(*pi)
    snapshot = await anext(feed)
    assert [r.room_id for r in snapshot] == [live.room_id]
    await client.begin_transfer(live.room_id, pi, di)
    await client.complete_room(live.room_id, *di)
    states: list[int] = []
    while len(states) < 2:
        batch = await asyncio.wait_for(anext(feed), 5)
        assert all(not r.HasField("source") for r in batch)  # the feed leaves the page runs out
        states += [r.state for r in batch if r.room_id == live.room_id]
    assert states == [dpb.ROOM_STATE_TRANSFERRING, dpb.ROOM_STATE_COMPLETED]
    await feed.aclose()
    with pytest.raises(FailedPrecondition) as err:
        await anext(client.watch_peer_rooms(pi[0], pi[1] + 1))
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
    pi, di = ids(p, d)
    feed = await _connected_feed(client, *pi)
    # Completed by the decode; the change lands before anyone waits for it.
    read = await client.publish_source(new_id(), pi, di, source())
    await client.begin_transfer(read.room_id, pi, di)
    await client.complete_room(read.room_id, *di)
    await asyncio.sleep(0.2)
    assert await feed.outcome(read.room_id, 5) == (dpb.ROOM_STATE_COMPLETED, True)
    # Aborted before any read began: no reader can exist.
    unread = await client.publish_source(new_id(), pi, di, source())
    waiting = asyncio.ensure_future(feed.outcome(unread.room_id, 5))
    await asyncio.sleep(0.1)
    await client.abort_room(unread.room_id, ROUTER, "cancelled")
    assert await waiting == (dpb.ROOM_STATE_ABORTED, False)
    # Aborted during the read: a read may have started.
    mid = await client.publish_source(new_id(), pi, di, source())
    await client.begin_transfer(mid.room_id, pi, di)
    await client.abort_room(mid.room_id, ROUTER, "cancelled")
    assert await feed.outcome(mid.room_id, 5) == (dpb.ROOM_STATE_ABORTED, True)
    # A room that never ends within the timeout: the caller must assume a reader.
    stuck = await client.publish_source(new_id(), pi, di, source())
    assert await feed.outcome(stuck.room_id, 0.2) == (dpb.ROOM_STATE_UNSPECIFIED, True)
    await client.abort_room(stuck.room_id, ROUTER, "done")
    for r in (read, unread, mid, stuck):
        feed.forget(r.room_id)
    await feed.stop()
    await p.stop()
    await d.stop()


async def test_decode_declines_the_read(client: DirectoryClient) -> None:
    p, d = await _pair(client, "decline")
    pi, di = ids(p, d)
    declined_cause = dpb.ROOM_END_CAUSE_DECODE_DECLINED
    feed = await _connected_feed(client, *pi)
    # The decode began the transfer, then ended the room saying it never posted a read.
    a = await client.publish_source(new_id(), pi, di, source())
    await client.begin_transfer(a.room_id, pi, di)
    ended = await client.abort_room(a.room_id, declined_cause, "cancelled", *di)
    assert ended.state == dpb.ROOM_STATE_ABORTED and ended.read_declined and ended.end_cause == declined_cause
    assert await feed.outcome(a.room_id, 5) == (dpb.ROOM_STATE_ABORTED, False)
    # The router ended it first (a read may have begun); the decode's word comes after and still counts.
    b = await client.publish_source(new_id(), pi, di, source())
    await client.begin_transfer(b.room_id, pi, di)
    await client.abort_room(b.room_id, ROUTER, "client went away")
    assert await feed.outcome(b.room_id, 5) == (dpb.ROOM_STATE_ABORTED, True)
    declined = asyncio.ensure_future(feed.read_declined(b.room_id, 5))
    await asyncio.sleep(0.1)
    assert not declined.done()
    late = await client.abort_room(b.room_id, declined_cause, "cancelled", *di)
    assert late.state == dpb.ROOM_STATE_ABORTED and late.read_declined and late.end_cause == ROUTER
    assert await asyncio.wait_for(declined, 5)
    # Only the room's decode may say so.
    c = await client.publish_source(new_id(), pi, di, source())
    with pytest.raises(FailedPrecondition) as err:
        await client.abort_room(c.room_id, declined_cause, "x", *pi)
    assert err.value.reason == "WRONG_ROLE"
    with pytest.raises(FailedPrecondition):
        await client.abort_room(c.room_id, declined_cause, "x")
    await client.abort_room(c.room_id, ROUTER, "done")
    for r in (a, b, c):
        feed.forget(r.room_id)
    await feed.stop()
    await p.stop()
    await d.stop()


async def test_room_feed_slots_are_per_epoch(tmp_path: Path) -> None:
    """Watches of a peer's old epoch (a dead process's streams not yet timed out) fill only that epoch's
    slots: the restarted peer, a new epoch, still watches its rooms."""
    env = {**ENV, "XAVIER_DIRECTORY__MAX_WATCHERS_PER_ROOM": "2"}
    proc = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path, env=env)
    try:
        async with DirectoryClient(proc.address) as client:
            p, d = await _pair(client, "feed")
            peer_id, epoch = ids(p, d)[0]

            def watch(e: int) -> Any:
                return client.stub.WatchPeerRooms(dpb.WatchPeerRoomsRequest(peer_id=peer_id, epoch=e))

            held = [watch(epoch) for _ in range(2)]
            for call in held:
                await call.read()  # the snapshot: the slot is taken
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await watch(epoch).read()
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await p.stop()  # the peer restarts: a new epoch, its old watches still open
            again = await client.register_peer(register_request(peer_id, PREFILL))
            assert again.epoch != epoch
            fresh = watch(again.epoch)
            assert list((await fresh.read()).rooms) == []  # the new epoch has slots of its own
            for call in (*held, fresh):
                call.cancel()
            await d.stop()
    finally:
        proc.stop()
