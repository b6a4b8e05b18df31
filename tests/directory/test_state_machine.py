"""Random sequences of peer and room operations (with expiries, restarts, openings from either side and
aborts before anyone opened the room) against the state machine."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.directory.records import LIVE_STATES, TERMINAL_STATES
from xavier_services.directory.state import Pair

from tests.directory.fakes import FakeClock, make_state
from tests.directory.helpers import endpoint, layout, source
from xavier_core.runtime.errors import XavierError

PREFILLS, DECODES = ("p0", "p1"), ("d0", "d1")
ROLE = {"p0": types_pb2.ROLE_PREFILL, "p1": types_pb2.ROLE_PREFILL, "d0": types_pb2.ROLE_DECODE}
ROLE["d1"] = types_pb2.ROLE_DECODE
OPEN, READY, XFER, DONE = (dpb.ROOM_STATE_OPEN, dpb.ROOM_STATE_SOURCE_READY,
                           dpb.ROOM_STATE_TRANSFERRING, dpb.ROOM_STATE_COMPLETED)  # fmt: skip
ABORTED, EXPIRED = dpb.ROOM_STATE_ABORTED, dpb.ROOM_STATE_EXPIRED
NEW = dpb.ROOM_STATE_UNSPECIFIED  # before a room's first report: the decode opens OPEN, the prefill READY
CAUSES = [c for c in dpb.RoomEndCause.values() if c != dpb.ROOM_END_CAUSE_UNSPECIFIED]

# Every edge the lifecycle allows; anything else the listener reports is a bug.
ALLOWED = {
    NEW: {OPEN, READY},
    OPEN: {READY, ABORTED, EXPIRED},
    READY: {XFER, DONE, ABORTED, EXPIRED},
    XFER: {DONE, ABORTED, EXPIRED},
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
            peer_lease_seconds=6.0,
            heartbeat_interval_seconds=1.0,
            max_rooms=6,
            ended_rooms_retained=10_000,
        )
        self.epochs: dict[str, list[int]] = {p: [] for p in ROLE}
        self.ids: list[int] = []  # room ids the router handed out, in order
        self.pairs: dict[int, tuple[str, str]] = {}
        self.last_state: dict[int, int] = {}
        self.opened_pairs: dict[int, tuple[str, str]] = {}

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
        self._try(lambda: self.state.peers.heartbeat("", peer, self._epoch(peer, stale), None))

    @rule(p=st.sampled_from(PREFILLS), d=st.sampled_from(DECODES))
    def route(self, p: str, d: str) -> None:
        """The router names a room for a pair; nothing reaches the directory yet."""
        room_id = len(self.ids) + 1
        self.ids.append(room_id)
        self.pairs[room_id] = (p, d)

    def _pair(self, data: st.DataObject) -> tuple[int, Pair]:
        # Recent ids are the likely live ones; older ones exercise calls on ended rooms and tombstones.
        recent = data.draw(st.sampled_from([True, True, True, False]))
        room_id = self.ids[-1] if recent else data.draw(st.sampled_from(self.ids))
        p, d = self.pairs[room_id]
        if data.draw(st.sampled_from([False] * 9 + [True])):  # a pair other than the router's
            p, d = data.draw(st.sampled_from(PREFILLS)), data.draw(st.sampled_from(DECODES))
        stale = data.draw(st.sampled_from([False] * 5 + [True]))
        return room_id, Pair(p, self._epoch(p, stale), d, self._epoch(d, stale))

    def _room_op(self, data: st.DataObject, op: str) -> None:
        if not self.ids:
            return
        room_id, pair = self._pair(data)
        p, pe, d, de = pair.prefill_peer_id, pair.prefill_epoch, pair.decode_peer_id, pair.decode_epoch
        rid = data.draw(st.sampled_from(["", "r1", "r2"]))
        calls = {
            "publish": lambda: self.state.publish_source(rid, room_id, pair, source()),
            "join": lambda: self.state.join_as_decode(room_id, pair),
            "begin": lambda: self.state.begin_transfer(rid, room_id, d, de),
            "complete": lambda: self.state.complete_room(rid, room_id, d, de),
            "abort": lambda: self.state.abort_room(
                rid,
                room_id,
                data.draw(st.sampled_from(CAUSES)),
                "test",
                *data.draw(st.sampled_from([("", 0), (p, pe), (d, de)])),
            ),
        }
        self._try(calls[op])

    @rule(skip_transfer=st.booleans(), decode_first=st.booleans())
    def progress(self, skip_transfer: bool, decode_first: bool) -> None:
        """Takes the newest routed room one step along the happy path."""
        if not self.ids:
            return
        room_id = self.ids[-1]
        p, d = self.pairs[room_id]
        pair = Pair(p, self._epoch(p, False), d, self._epoch(d, False))
        state = self.state._find(room_id)
        if state is None:
            opener = self.state.join_as_decode if decode_first else None
            if opener is not None:
                self._try(lambda: opener(room_id, pair))
            else:
                self._try(lambda: self.state.publish_source("", room_id, pair, source()))
        elif state.state == OPEN:
            self._try(lambda: self.state.publish_source("", room_id, pair, source()))
        elif state.state == READY and not skip_transfer:
            self._try(lambda: self.state.begin_transfer("", room_id, d, pair.decode_epoch))
        elif state.state in (READY, XFER):
            self._try(lambda: self.state.complete_room("", room_id, d, pair.decode_epoch))

    @rule(data=st.data(), op=st.sampled_from(["publish", "join", "begin", "complete", "abort"]))
    def room_call(self, data: st.DataObject, op: str) -> None:
        self._room_op(data, op)

    @rule(seconds=st.sampled_from([0.1, 0.6, 1.5, 4.5]), heartbeat=st.sampled_from([True, True, False]))
    def tick(self, seconds: float, heartbeat: bool) -> None:
        if heartbeat:
            for peer in ROLE:
                self._try(
                    lambda peer=peer: self.state.peers.heartbeat("", peer, self._epoch(peer, False), None)
                )
        self.clock.advance(seconds)
        self.state.sweep()
        now = self.clock()
        for room in self.state._rooms.values():
            # Every room ends within its lease: once swept, nothing lapsed is still live.
            assert room.expires_at > now
        for tomb in self.state._tombstones.values():
            assert tomb.expires_at > now and tomb.state == ABORTED

    @invariant()
    def transitions_follow_the_lifecycle(self) -> None:
        for room_id, new in self.changes:
            old = self.last_state.get(room_id, NEW)
            if old in TERMINAL_STATES and new == old:
                # Not a transition: an ended room is announced again when its decode declines the read
                # late (read_declined), so the source can unpin at once.
                room = self.state._find(room_id)
                assert room is not None and room.read_declined, f"room {room_id} re-announced as {old}"
                continue
            SEEN.add((old, new))
            assert old not in TERMINAL_STATES, f"room {room_id} left terminal state {old}"
            assert new in ALLOWED[old], f"room {room_id}: {old} -> {new}"
            self.last_state[room_id] = new
        self.changes.clear()

    @invariant()
    def counters_add_up(self) -> None:
        stats = self.state.room_stats()
        assert stats.active == len(self.state._rooms) <= 6
        reported = set(self.last_state) | {room_id for room_id, _ in self.changes}
        assert stats.opened == len(reported)  # tombstones are never counted as rooms
        assert stats.opened == stats.active + stats.completed + stats.aborted + stats.expired
        assert sum(stats.by_state[s] for s in LIVE_STATES) == stats.active

    @invariant()
    def live_rooms_keep_their_first_pair_at_current_epochs(self) -> None:
        peers = self.state.peers._peers
        for room in self.state._rooms.values():
            # The first opener's pair (normally the router's) sticks: a later caller cannot change it.
            first = self.opened_pairs.setdefault(room.room_id, (room.prefill_peer_id, room.decode_peer_id))
            assert (room.prefill_peer_id, room.decode_peer_id) == first
            for peer_id, epoch in (
                (room.prefill_peer_id, room.prefill_epoch),
                (room.decode_peer_id, room.decode_epoch),
            ):
                peer = peers.get(peer_id)
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


class _Draws:
    """Stands for hypothesis's `data` in a replayed walk: hands out the given draws in order."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object) -> object:
        return self.values.pop(0)


def test_a_late_decline_announces_an_ended_room_again() -> None:
    """The walk hypothesis found: a room ends when its prefill restarts, then its decode declines the read;
    the directory announces the ended room again (read_declined, so the source unpins), no transition."""
    m = DirectoryMachine()
    m.register_everyone()
    m.route(p="p0", d="d0")
    m.room_call(_Draws(True, False, False, ""), "publish")
    m.restart_or_leave(dtype="float32", leave=False, peer="p0")
    m.transitions_follow_the_lifecycle()
    decline = (dpb.ROOM_END_CAUSE_DECODE_DECLINED, ("d0", m._epoch("d0", False)))
    m.room_call(_Draws(True, False, False, "", *decline), "abort")
    assert m.changes == [(1, ABORTED)]
    m.transitions_follow_the_lifecycle()
    room = m.state._find(1)
    assert room is not None and room.read_declined and room.state == ABORTED
