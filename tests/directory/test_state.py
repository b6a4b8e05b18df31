"""The directory state machine, driven directly with a fake clock."""

from __future__ import annotations

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.directory.records import PeerRecord
from xavier_services.directory.state import DirectoryState

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
DONE, RELEASED = dpb.ROOM_STATE_COMPLETED, dpb.ROOM_STATE_RELEASED
ABORTED, EXPIRED = dpb.ROOM_STATE_ABORTED, dpb.ROOM_STATE_EXPIRED


def reg(state: DirectoryState, peer_id: str, role: int, request_id: str = "", **lay: object) -> PeerRecord:
    return state.peers.register(request_id, peer_id, role, "127.0.0.1:1", layout(**lay), endpoint())


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def setup(
    clock: FakeClock, **settings: object
) -> tuple[DirectoryState, list[tuple[int, int]], PeerRecord, PeerRecord]:
    state, changes = make_state(clock, **settings)
    return state, changes, reg(state, "p", PREFILL), reg(state, "d", DECODE)


def test_full_lifecycle_and_counters(clock: FakeClock) -> None:
    state, changes, p, d = setup(clock)
    room = state.open_room("o1", "p", p.epoch, "d", d.epoch, b"\x01" * 32, 12, None)
    state.publish_source("s1", room.room_id, "p", p.epoch, source())
    state.begin_transfer("b1", room.room_id, "d", d.epoch)
    state.complete_room("c1", room.room_id, "d", d.epoch)
    assert state.release_room("r1", room.room_id, PREFILL, "p", p.epoch).state == DONE
    assert state.release_room("r2", room.room_id, DECODE, "d", d.epoch).state == RELEASED
    assert [s for _, s in changes] == [READY, XFER, DONE, RELEASED]
    stats = state.room_stats()
    assert (stats.active, stats.opened, stats.completed, stats.released) == (0, 1, 1, 1)
    assert not p.rooms and not d.rooms
    # Ended rooms stay visible (without their page runs) and never change again.
    ended = state.get_room(room.room_id)
    assert ended.state == RELEASED and ended.source is None
    assert state.abort_room("", room.room_id, "late", "", 0).state == RELEASED


def test_release_before_completion_aborts(clock: FakeClock) -> None:
    state, _, p, d = setup(clock)
    room = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None)
    state.publish_source("", room.room_id, "p", p.epoch, source())
    out = state.release_room("", room.room_id, DECODE, "d", d.epoch)
    assert out.state == ABORTED and "before completion" in out.end_reason
    with pytest.raises(FailedPrecondition) as err:
        state.complete_room("", room.room_id, "d", d.epoch)
    assert err.value.reason == "WRONG_STATE"


def test_leases_expire_lazily_and_by_sweep(clock: FakeClock) -> None:
    state, changes, p, d = setup(clock, room_lease_seconds=1.0, completed_retention_seconds=2.0)
    lazy = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None)
    swept = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, 5.0)
    clock.advance(1.0)
    with pytest.raises(LeaseExpired):
        state.publish_source("", lazy.room_id, "p", p.epoch, source())
    assert state.sweep() == 0 and state.get_room(swept.room_id).state == OPEN
    state.publish_source("", swept.room_id, "p", p.epoch, source())
    state.complete_room("", swept.room_id, "d", d.epoch)
    for _ in range(3):  # a completed room outlives its retention while renewed
        clock.advance(1.5)
        state.renew_lease(swept.room_id, "d", d.epoch, None)
    assert state.sweep() == 0
    clock.advance(2.0)
    assert state.sweep() == 1
    assert (swept.room_id, EXPIRED) in changes and state.room_stats().expired == 2


def test_dead_peer_aborts_live_rooms_and_releases_completed(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, peer_lease_seconds=4.0, heartbeat_interval_seconds=1.0)
    live = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, 60.0)
    done = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, 60.0)
    state.publish_source("", done.room_id, "p", p.epoch, source())
    state.complete_room("", done.room_id, "d", d.epoch)
    clock.advance(3.0)
    assert state.peers.heartbeat("d", d.epoch, None) is d
    clock.advance(1.5)  # the prefill missed its lease; the decode did not
    state.sweep()
    assert state.get_room(live.room_id).state == ABORTED
    kept = state.get_room(done.room_id)
    assert kept.state == DONE and kept.prefill_released and not kept.decode_released
    assert state.peers.heartbeat("p", p.epoch, None) is None  # must register again
    assert state.release_room("", done.room_id, DECODE, "d", d.epoch).state == RELEASED
    assert state.room_stats().active == 0


def test_peer_restart_new_epoch_and_stale_calls(clock: FakeClock) -> None:
    state, _, p, d = setup(clock)
    old_epoch = p.epoch
    room = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None)
    p2 = reg(state, "p", PREFILL)
    assert p2.epoch > old_epoch
    assert state.get_room(room.room_id).state == ABORTED
    for call in (
        lambda: state.publish_source("", room.room_id, "p", old_epoch, source()),
        lambda: state.open_room("", "p", old_epoch, "d", d.epoch, b"", 0, None),
        lambda: state.peers.heartbeat("p", old_epoch, None),
        lambda: state.peers.unregister("p", old_epoch),
    ):
        with pytest.raises(FailedPrecondition) as err:
            call()
        assert err.value.reason == "STALE_EPOCH"
    # The new epoch works on new rooms but not on the old epoch's room.
    assert state.open_room("", "p", p2.epoch, "d", d.epoch, b"", 0, None).state == OPEN
    with pytest.raises(FailedPrecondition, match="stale"):
        state.publish_source("", room.room_id, "p", p2.epoch, source())


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
    a = state.open_room("same", "p", p.epoch, "d", d.epoch, b"x", 1, None)
    assert state.open_room("same", "p", p.epoch, "d", d.epoch, b"x", 1, None) is a
    with pytest.raises(FailedPrecondition) as err:
        state.open_room("same", "p", p.epoch, "d", d.epoch, b"y", 1, None)
    assert err.value.reason == "REQUEST_ID_REUSED"
    state.publish_source("pub", a.room_id, "p", p.epoch, source())
    assert state.publish_source("pub", a.room_id, "p", p.epoch, source()).state == READY
    with pytest.raises(FailedPrecondition, match="SOURCE_READY"):
        state.publish_source("other", a.room_id, "p", p.epoch, source())
    assert state.room_stats().opened == 1


def test_request_ids_per_room_are_bounded(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, request_ids_per_room=2)
    room = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None)
    state.publish_source("a", room.room_id, "p", p.epoch, source())
    state.begin_transfer("b", room.room_id, "d", d.epoch)
    state.complete_room("c", room.room_id, "d", d.epoch)
    assert room.request_ids is not None and list(room.request_ids) == ["b", "c"]


def test_bad_input(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, max_rooms=1, max_page_runs=2)
    for bad in (0, 1 << 63):
        with pytest.raises(InvalidArgument):
            state.get_room(bad)
    with pytest.raises(NotFound) as nf:
        state.get_room(99)
    assert nf.value.reason == "ROOM_NOT_FOUND"
    room = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None)
    with pytest.raises(CapacityExhausted):
        state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None)
    runs = [types_pb2.PageRun(first_page=i, count=1) for i in range(3)]
    with pytest.raises(InvalidArgument):
        state.publish_source(
            "", room.room_id, "p", p.epoch, dpb.SourceDescriptor(page_runs=runs, num_pages=3)
        )
    with pytest.raises(InvalidArgument):
        state.open_room("", "p", p.epoch, "d", d.epoch, b"z" * 65, 0, None)
    with pytest.raises(InvalidArgument):
        state.peers.register("", "bad id!", PREFILL, "a:1", layout(), endpoint())
    with pytest.raises(InvalidArgument):
        state.peers.register("", "x", PREFILL, "a:1", layout(num_layers=0), endpoint())
    with pytest.raises(InvalidArgument):
        state.peers.register("", "x", DECODE, "a:1", layout(), None)
    with pytest.raises(FailedPrecondition) as fp:
        state.release_room("", room.room_id, types_pb2.ROLE_UNIFIED, "p", p.epoch)
    assert fp.value.reason == "WRONG_ROLE"
    assert state.get_room(room.room_id).state == OPEN


def test_layout_mismatch_names_fields(clock: FakeClock) -> None:
    state, _ = make_state(clock)
    p = reg(state, "p", PREFILL)
    d = reg(state, "d", DECODE, num_kv_heads=4, weights_fingerprint="other")
    with pytest.raises(LayoutMismatch) as err:
        state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None)
    assert err.value.metadata["fields"] == "num_kv_heads,weights_fingerprint"


def test_ended_rooms_and_expiry_heap_are_bounded(clock: FakeClock) -> None:
    state, _, p, d = setup(clock, ended_rooms_retained=2)
    rooms = [state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None) for _ in range(3)]
    for room in rooms:
        state.abort_room("", room.room_id, "", "", 0)
    with pytest.raises(NotFound):
        state.get_room(rooms[0].room_id)
    live = state.open_room("", "p", p.epoch, "d", d.epoch, b"", 0, None)
    for _ in range(5000):
        state.renew_lease(live.room_id, "d", d.epoch, 30.0)
    state.sweep()
    assert len(state._expiry) <= 2 * 1 + 1024
