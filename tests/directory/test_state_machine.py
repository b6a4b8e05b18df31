"""Random sequences of peer and room operations (with expiries and restarts) against the state machine."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.directory.records import LIVE_STATES, TERMINAL_STATES

from tests.directory.fakes import FakeClock, make_state
from tests.directory.helpers import endpoint, layout, source
from xavier_core.runtime.errors import XavierError

PREFILLS, DECODES = ("p0", "p1"), ("d0", "d1")
ROLE = {"p0": types_pb2.ROLE_PREFILL, "p1": types_pb2.ROLE_PREFILL, "d0": types_pb2.ROLE_DECODE}
ROLE["d1"] = types_pb2.ROLE_DECODE
OPEN, READY, XFER, DONE = (dpb.ROOM_STATE_OPEN, dpb.ROOM_STATE_SOURCE_READY,
                           dpb.ROOM_STATE_TRANSFERRING, dpb.ROOM_STATE_COMPLETED)  # fmt: skip
RELEASED, ABORTED, EXPIRED = dpb.ROOM_STATE_RELEASED, dpb.ROOM_STATE_ABORTED, dpb.ROOM_STATE_EXPIRED

# Every edge the lifecycle allows; anything else the listener reports is a bug.
ALLOWED = {
    OPEN: {READY, ABORTED, EXPIRED},
    READY: {XFER, DONE, ABORTED, EXPIRED},
    XFER: {DONE, ABORTED, EXPIRED},
    DONE: {RELEASED, ABORTED, EXPIRED},
}
LEASE = 5.0
SEEN: set[tuple[int, int]] = set()
"""Edges taken across all examples (a coverage check for the test itself)."""


class DirectoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state, self.changes = make_state(
            self.clock,
            room_lease_seconds=LEASE,
            completed_retention_seconds=3.0,
            peer_lease_seconds=6.0,
            heartbeat_interval_seconds=1.0,
            max_rooms=6,
            ended_rooms_retained=10_000,
        )
        self.epochs: dict[str, list[int]] = {p: [] for p in ROLE}
        self.rooms: list[int] = []
        self.last_state: dict[int, int] = {}

    @initialize()
    def register_everyone(self) -> None:
        for peer in sorted(ROLE):
            self.register(peer, "float32")

    def _epoch(self, peer: str, stale: bool) -> int:
        known = self.epochs[peer]
        if not known:
            return 1
        return known[0] if stale else known[-1]

    def _try(self, call: object) -> None:
        try:
            call()  # type: ignore[operator]
        except XavierError:
            pass  # typed refusals are fine; any other exception fails the test

    @rule(
        peer=st.sampled_from(sorted(ROLE)),
        dtype=st.sampled_from(["float32", "float32", "float16"]),
        leave=st.sampled_from([False, False, True]),
    )
    def restart_or_leave(self, peer: str, dtype: str, leave: bool) -> None:
        if leave:
            self._try(lambda: self.state.peers.unregister(peer, self._epoch(peer, False)))
        else:
            self.register(peer, dtype)

    def register(self, peer: str, dtype: str) -> None:
        rec = self.state.peers.register("", peer, ROLE[peer], "h:1", layout(dtype=dtype), endpoint())
        assert not self.epochs[peer] or rec.epoch > self.epochs[peer][-1]
        self.epochs[peer].append(rec.epoch)

    @rule(peer=st.sampled_from(sorted(ROLE)), stale=st.sampled_from([False, False, True]))
    def heartbeat(self, peer: str, stale: bool) -> None:
        self._try(lambda: self.state.peers.heartbeat(peer, self._epoch(peer, stale), None))

    @rule(p=st.sampled_from(PREFILLS), d=st.sampled_from(DECODES), lease=st.sampled_from([None, 0.5, 2.0]))
    def open_room(self, p: str, d: str, lease: float | None) -> None:
        try:
            room = self.state.open_room("", p, self._epoch(p, False), d, self._epoch(d, False), b"", 0, lease)
        except XavierError:
            return
        self.rooms.append(room.room_id)
        self.last_state[room.room_id] = OPEN

    def _room_op(self, data: st.DataObject, op: str) -> None:
        if not self.rooms:
            return
        # Recent rooms are the likely live ones; older ones exercise calls on ended rooms.
        recent = data.draw(st.sampled_from([True, True, True, False]))
        room_id = self.rooms[-1] if recent else data.draw(st.sampled_from(self.rooms))
        room = self.state.get_room(room_id)
        stale = data.draw(st.sampled_from([False] * 5 + [True]))
        p, d = room.prefill_peer_id, room.decode_peer_id
        pe, de = self._epoch(p, stale), self._epoch(d, stale)
        rid = data.draw(st.sampled_from(["", "r1", "r2"]))
        calls = {
            "publish": lambda: self.state.publish_source(rid, room_id, p, pe, source()),
            "begin": lambda: self.state.begin_transfer(rid, room_id, d, de),
            "complete": lambda: self.state.complete_room(rid, room_id, d, de),
            "abort": lambda: self.state.abort_room(
                rid, room_id, "test", data.draw(st.sampled_from(["", p])), pe
            ),
            "renew": lambda: self.state.renew_lease(room_id, d, de, data.draw(st.sampled_from([None, 1.0]))),
        }
        if op == "release":
            role = data.draw(st.sampled_from([types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE]))
            who, who_epoch = data.draw(st.sampled_from([(p, pe), (d, de), (p, de)]))
            self._try(lambda: self.state.release_room(rid, room_id, role, who, who_epoch))
        else:
            self._try(calls[op])

    @rule(skip_transfer=st.booleans(), release_prefill=st.booleans())
    def progress(self, skip_transfer: bool, release_prefill: bool) -> None:
        """Takes the newest live room one step along the happy path."""
        live = [r for r in self.rooms if self.state.get_room(r).state not in TERMINAL_STATES]
        if not live:
            return
        room = self.state.get_room(live[-1])
        p, d, rid = room.prefill_peer_id, room.decode_peer_id, room.room_id
        pe, de = self._epoch(p, False), self._epoch(d, False)
        if room.state == OPEN:
            self._try(lambda: self.state.publish_source("", rid, p, pe, source()))
        elif room.state == READY and not skip_transfer:
            self._try(lambda: self.state.begin_transfer("", rid, d, de))
        elif room.state in (READY, XFER):
            self._try(lambda: self.state.complete_room("", rid, d, de))
        elif release_prefill and not room.prefill_released:
            self._try(lambda: self.state.release_room("", rid, types_pb2.ROLE_PREFILL, p, pe))
        else:
            self._try(lambda: self.state.release_room("", rid, types_pb2.ROLE_DECODE, d, de))

    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        self._room_op(data, "publish")

    @rule(data=st.data())
    def begin(self, data: st.DataObject) -> None:
        self._room_op(data, "begin")

    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        self._room_op(data, "complete")

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._room_op(data, "release")

    @rule(data=st.data(), abort=st.booleans())
    def abort_or_renew(self, data: st.DataObject, abort: bool) -> None:
        self._room_op(data, "abort" if abort else "renew")

    @rule(seconds=st.sampled_from([0.1, 0.6, 1.5, 4.5]), heartbeat=st.sampled_from([True, True, False]))
    def tick(self, seconds: float, heartbeat: bool) -> None:
        if heartbeat:
            for peer in ROLE:
                self._try(lambda peer=peer: self.state.peers.heartbeat(peer, self._epoch(peer, False), None))
        self.clock.advance(seconds)
        self.state.sweep()
        now = self.clock()
        for room_id in self.rooms:
            room = self.state.get_room(room_id)
            # Every room ends within its lease: once swept, nothing lapsed is still live.
            assert room.state in TERMINAL_STATES or room.expires_at > now

    @invariant()
    def transitions_follow_the_lifecycle(self) -> None:
        for room_id, new in self.changes:
            SEEN.add((self.last_state[room_id], new))
            old = self.last_state[room_id]
            assert old not in TERMINAL_STATES, f"room {room_id} left terminal state {old}"
            assert new in ALLOWED[old], f"room {room_id}: {old} -> {new}"
            self.last_state[room_id] = new
        self.changes.clear()

    @invariant()
    def counters_add_up(self) -> None:
        stats = self.state.room_stats()
        live = [r for r in self.state._rooms.values()]
        assert stats.active == len(live) <= 6
        assert stats.opened == len(self.rooms)
        assert stats.opened == stats.active + stats.released + stats.aborted + stats.expired
        assert sum(stats.by_state[s] for s in (*LIVE_STATES, DONE)) == stats.active
        assert stats.completed >= stats.released

    @invariant()
    def live_rooms_belong_to_current_epochs(self) -> None:
        peers = self.state.peers._peers
        for room in self.state._rooms.values():
            for peer_id, epoch, released in (
                (room.prefill_peer_id, room.prefill_epoch, room.prefill_released),
                (room.decode_peer_id, room.decode_epoch, room.decode_released),
            ):
                peer = peers.get(peer_id)
                if room.state in LIVE_STATES or not released:
                    assert peer is not None and peer.epoch == epoch and room.room_id in peer.rooms


DirectoryMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestDirectoryMachine = DirectoryMachine.TestCase


def test_machine_takes_every_edge() -> None:
    """The random walk above reaches every edge of the lifecycle (checked on a fixed seed)."""
    SEEN.clear()
    covered = DirectoryMachine.TestCase
    covered.settings = settings(
        max_examples=500, stateful_step_count=60, deadline=None, derandomize=True, database=None
    )
    covered().runTest()
    assert SEEN == {(old, new) for old, news in ALLOWED.items() for new in news}
