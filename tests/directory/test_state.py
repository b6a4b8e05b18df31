"""The directory state machine, driven directly with a fake clock."""

from __future__ import annotations

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.directory.records import PeerRecord
from xavier_services.directory.state import DirectoryState, Pair

from tests.directory.fakes import FakeClock, make_state
from tests.directory.helpers import endpoint, layout, source
from xavier_core.runtime.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    LayoutMismatch,
    LeaseExpired,
    NotFound,
)

PREFILL, DECODE = types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE
OPEN, READY, XFER = dpb.ROOM_STATE_OPEN, dpb.ROOM_STATE_SOURCE_READY, dpb.ROOM_STATE_TRANSFERRING
DONE, ABORTED, EXPIRED = dpb.ROOM_STATE_COMPLETED, dpb.ROOM_STATE_ABORTED, dpb.ROOM_STATE_EXPIRED
ROUTER, PEER_LOST = dpb.ROOM_END_CAUSE_ROUTER_ABORT, dpb.ROOM_END_CAUSE_PEER_LOST
DECLINED = dpb.ROOM_END_CAUSE_DECODE_DECLINED


def reg(state: DirectoryState, peer_id: str, role: int, request_id: str = "", **lay: object) -> PeerRecord:
    return state.peers.register(request_id, peer_id, role, "127.0.0.1:1", layout(**lay), endpoint(peer_id))


def pair(p: PeerRecord, d: PeerRecord) -> Pair:
    return Pair(p.peer_id, p.epoch, d.peer_id, d.epoch)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def setup(
    clock: FakeClock, **settings: object
) -> tuple[DirectoryState, list[tuple[int, int]], PeerRecord, PeerRecord]:
    state, changes = make_state(clock, **settings)
    return state, changes, reg(state, "p", PREFILL), reg(state, "d", DECODE)


def test_decode_first_lifecycle_and_counters(clock: FakeClock) -> None:
    state, changes, p, d = setup(clock)
    room = state.join_as_decode(1, pair(p, d))
    assert room.state == OPEN and 1 in p.rooms and 1 in d.rooms
    assert state.publish_source("s1", 1, pair(p, d), source()) is room
    state.begin_transfer("b1", 1, "d", d.epoch)
    assert state.source_endpoint(room).agent_name == "p"
    assert state.complete_room("c1", 1, "d", d.epoch).state == DONE
    assert [s for _, s in changes] == [OPEN, READY, XFER, DONE]
    stats = state.room_stats()
    assert (stats.active, stats.opened, stats.completed, stats.aborted) == (0, 1, 1, 0)
    assert not p.rooms and not d.rooms
    # Ended rooms stay visible (without their page runs) and never change again.
    ended = state.get_room(1)
    assert ended.state == DONE and ended.source is None
    assert state.abort_room("", 1, ROUTER, "late", "", 0).state == DONE


def test_prefill_first_opens_source_ready_and_decode_adopts(clock: FakeClock) -> None:
    state, changes, p, d = setup(clock)
    room = state.publish_source("s1", 7, pair(p, d), source())
    assert room.state == READY and changes == [(7, READY)]
    assert state.join_as_decode(7, pair(p, d)) is room
    state.begin_transfer("b1", 7, "d", d.epoch)
    assert state.complete_room("c1", 7, "d", d.epoch).state == DONE
    assert state.room_stats().opened == 1


def test_a_pair_other_than_the_rooms_is_refused(clock: FakeClock) -> None:
    state, _, p, d = setup(clock)
    d2 = reg(state, "d2", DECODE)
    state.publish_source("", 3, pair(p, d), source())
    for call in (
        lambda: state.join_as_decode(3, pair(p, d2)),
        lambda: state.publish_source("", 3, Pair("p", p.epoch, "d", d.epoch + 1), source()),
    ):
        with pytest.raises(FailedPrecondition) as err:
            call()
        assert err.value.reason == "PAIR_MISMATCH" and "room 3 was opened for p@" in str(err.value)


def test_abort_before_anyone_opened_leaves_a_tombstone(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, room_lease_seconds=2.0)
    tomb = state.abort_room("a", 9, ROUTER, "client went away", "", 0)
    assert tomb.state == ABORTED and tomb.end_cause == ROUTER
    # Late openers see it ended; nothing is opened or counted.
    assert state.publish_source("s", 9, pair(p, d), source()).state == ABORTED
    assert state.join_as_decode(9, pair(p, d)).end_cause == ROUTER
    stats = state.room_stats()
    assert (stats.active, stats.opened, stats.aborted) == (0, 0, 0)
    # A tombstone lasts one room lease; then the id is free again.
    clock.advance(2.0)
    state.sweep()
    assert state.join_as_decode(9, pair(p, d)).state == OPEN


def test_a_decline_on_a_tombstone_tells_no_one(clock: FakeClock) -> None:
    state, changes, _, d = setup(clock)
    state.abort_room("a", 11, ROUTER, "client went away", "", 0)
    state.abort_room("b", 11, DECLINED, "", d.peer_id, d.epoch)
    # Nobody ever opened room 11: no member may hear of it, and it is never counted.
    assert all(room_id != 11 for room_id, _ in changes)
    assert state.room_stats().opened == 0


def test_decode_declines_even_after_the_room_ended(clock: FakeClock) -> None:
    state, changes, p, d = setup(clock)
    state.publish_source("", 4, pair(p, d), source())
    state.abort_room("", 4, ROUTER, "", "", 0)
    room = state.abort_room("", 4, dpb.ROOM_END_CAUSE_DECODE_DECLINED, "", "d", d.epoch)
    assert room.end_cause == ROUTER and room.read_declined and changes[-1] == (4, ABORTED)
    with pytest.raises(FailedPrecondition) as err:
        state.abort_room("", 4, dpb.ROOM_END_CAUSE_DECODE_DECLINED, "", "", 0)
    assert err.value.reason == "WRONG_ROLE"
    with pytest.raises(FailedPrecondition) as err:
        state.abort_room("", 4, dpb.ROOM_END_CAUSE_DECODE_DECLINED, "", "p", p.epoch)
    assert err.value.reason == "WRONG_ROLE"


def test_leases_expire_lazily_and_by_sweep(clock: FakeClock) -> None:
    state, changes, p, d = setup(clock, room_lease_seconds=1.0)
    state.join_as_decode(1, pair(p, d))
    clock.advance(0.5)
    state.join_as_decode(2, pair(p, d))
    clock.advance(0.5)
    with pytest.raises(LeaseExpired):
        state.begin_transfer("", 1, "d", d.epoch)
    assert state.get_room(1).end_cause == dpb.ROOM_END_CAUSE_LEASE_EXPIRED
    assert state.sweep() == 0 and state.get_room(2).state == OPEN
    clock.advance(0.5)
    assert state.sweep() == 1
    assert (2, EXPIRED) in changes and state.room_stats().expired == 2


def test_dead_peer_aborts_live_rooms(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, peer_lease_seconds=4.0, heartbeat_interval_seconds=1.0)
    state.join_as_decode(1, pair(p, d))
    state.publish_source("", 2, pair(p, d), source())
    state.join_as_decode(2, pair(p, d))
    state.complete_room("", 2, "d", d.epoch)
    clock.advance(3.0)
    assert state.peers.heartbeat("", "d", d.epoch, None) is d
    clock.advance(1.5)  # the prefill missed its lease; the decode did not
    state.sweep()
    lost = state.get_room(1)
    assert lost.state == ABORTED and lost.end_cause == PEER_LOST and "lease expired" in lost.end_detail
    assert state.get_room(2).state == DONE
    assert state.peers.heartbeat("", "p", p.epoch, None) is None  # must register again
    assert state.room_stats().active == 0


def test_peer_restart_new_epoch_and_stale_calls(clock: FakeClock) -> None:
    state, _, p, d = setup(clock)
    old = pair(p, d)
    state.join_as_decode(1, old)
    p2 = reg(state, "p", PREFILL)
    assert p2.epoch > old.prefill_epoch
    assert state.get_room(1).end_cause == PEER_LOST
    for call in (
        lambda: state.publish_source("", 2, old, source()),
        lambda: state.join_as_decode(3, old),
        lambda: state.peers.heartbeat("", "p", old.prefill_epoch, None),
        lambda: state.peers.unregister("p", old.prefill_epoch),
    ):
        with pytest.raises(FailedPrecondition) as err:
            call()
        assert err.value.reason == "STALE_EPOCH"
    # The new epoch works on new rooms but not in the old epoch's room.
    assert state.join_as_decode(4, pair(p2, d)).state == OPEN
    with pytest.raises(FailedPrecondition) as err:
        state.publish_source("", 1, pair(p2, d), source())
    assert err.value.reason == "PAIR_MISMATCH"


def test_epochs_grow_across_directory_restarts(clock: FakeClock) -> None:
    first, _ = make_state(clock)
    e1 = reg(first, "p", PREFILL).epoch
    clock.advance(0.001)
    second, _ = make_state(clock)
    assert reg(second, "p", PREFILL).epoch > e1


def test_idempotent_retries(clock: FakeClock) -> None:
    state, _, p, d = setup(clock)
    assert reg(state, "p", PREFILL, request_id="r").epoch == reg(state, "p", PREFILL, request_id="r").epoch
    p = state.peers.get("p")  # type: ignore[assignment]
    a = state.publish_source("pub", 5, pair(p, d), source())
    assert state.publish_source("pub", 5, pair(p, d), source()) is a
    with pytest.raises(FailedPrecondition, match="SOURCE_READY"):
        state.publish_source("other", 5, pair(p, d), source())
    state.begin_transfer("b", 5, "d", d.epoch)
    assert state.begin_transfer("b", 5, "d", d.epoch).state == XFER
    state.complete_room("c", 5, "d", d.epoch)
    assert state.complete_room("c", 5, "d", d.epoch).state == DONE
    assert state.room_stats().opened == 1


def test_request_ids_per_room_are_bounded(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, request_ids_per_room=2)
    room = state.publish_source("a", 1, pair(p, d), source())
    state.begin_transfer("b", 1, "d", d.epoch)
    state.complete_room("c", 1, "d", d.epoch)
    assert room.request_ids is not None and list(room.request_ids) == ["b", "c"]


def test_bad_input(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, max_rooms=1, max_page_runs=2)
    for bad in (0, 1 << 63):
        with pytest.raises(InvalidArgument):
            state.get_room(bad)
        with pytest.raises(InvalidArgument):
            state.join_as_decode(bad, pair(p, d))
    with pytest.raises(NotFound) as nf:
        state.get_room(99)
    assert nf.value.reason == "ROOM_NOT_FOUND"
    state.join_as_decode(1, pair(p, d))
    with pytest.raises(CapacityExhausted):
        state.join_as_decode(2, pair(p, d))
    runs = [types_pb2.PageRun(first_page=i, count=1) for i in range(3)]
    with pytest.raises(InvalidArgument):
        state.publish_source("", 1, pair(p, d), dpb.SourceDescriptor(page_runs=runs, num_pages=3))
    with pytest.raises(InvalidArgument):
        state.publish_source("", 1, pair(p, d), dpb.SourceDescriptor(page_runs=runs[:1], num_pages=2))
    for extra in ("staging_runs", "aux_runs"):
        forged = dpb.SourceDescriptor(page_runs=runs[:1], num_pages=1, **{extra: runs})
        with pytest.raises(InvalidArgument) as err:
            state.publish_source("", 1, pair(p, d), forged)
        assert err.value.metadata["field"] == f"source.{extra}"
    for cause in (dpb.ROOM_END_CAUSE_UNSPECIFIED, 99):
        with pytest.raises(InvalidArgument):
            state.abort_room("", 1, cause, "", "", 0)
    with pytest.raises(InvalidArgument):
        state.abort_room("", 1, ROUTER, "x" * 1025, "", 0)
    with pytest.raises(InvalidArgument):
        state.peers.register("", "bad id!", PREFILL, "a:1", layout(), endpoint())
    with pytest.raises(InvalidArgument):
        state.peers.register("", "x", PREFILL, "a:1", layout(num_layers=0), endpoint())
    with pytest.raises(InvalidArgument):
        state.peers.register("", "x", DECODE, "a:1", layout(), None)
    with pytest.raises(FailedPrecondition) as fp:
        state.join_as_decode(2, Pair("p", p.epoch, "p", p.epoch))
    assert fp.value.reason == "WRONG_ROLE"
    with pytest.raises(FailedPrecondition) as fp:
        state.join_as_decode(2, Pair("d", d.epoch, "p", p.epoch))
    assert fp.value.reason == "WRONG_ROLE"
    assert state.get_room(1).state == OPEN


def test_layout_mismatch_names_fields(clock: FakeClock) -> None:
    state, _ = make_state(clock)
    p = reg(state, "p", PREFILL)
    d = reg(state, "d", DECODE, num_kv_heads=4, weights_fingerprint="other")
    with pytest.raises(LayoutMismatch) as err:
        state.join_as_decode(1, pair(p, d))
    assert err.value.metadata["fields"] == "num_kv_heads,weights_fingerprint"
    with pytest.raises(LayoutMismatch):
        state.publish_source("", 1, pair(p, d), source())


def test_ended_rooms_tombstones_and_expiry_heap_are_bounded(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, ended_rooms_retained=2, max_rooms=4)
    for room_id in (1, 2, 3):
        state.join_as_decode(room_id, pair(p, d))
        state.abort_room("", room_id, ROUTER, "", "", 0)
    with pytest.raises(NotFound):
        state.get_room(1)
    for room_id in range(100, 110):
        state.abort_room("", room_id, ROUTER, "", "", 0)
    assert len(state._tombstones) == 4
    for room_id in range(1000, 4000):
        state.join_as_decode(room_id, pair(p, d))
        state.abort_room("", room_id, ROUTER, "", "", 0)
    state.sweep()
    assert len(state._expiry) <= 2 * 4 + 1024
