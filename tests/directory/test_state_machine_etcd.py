"""The stateful property test of the room lifecycle on the etcd backend, bounded.

Every call goes through the etcd command log, proposed alternately through two replicas (two
directories' worth of state); the lifecycle invariants of ``test_state_machine`` hold on the first, and
after every step both replicas hold exactly the same rooms, tombstones and peer epochs.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import astuple
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant
from xavier.v1 import directory_service_pb2 as dpb
from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.etcd_store import EtcdLog
from xavier_services.directory.records import PeerRecord, RoomRecord
from xavier_services.directory.state import DirectoryState, Pair

from tests.directory.etcd import Etcd
from tests.directory.helpers import source
from tests.directory.test_state_machine import LEASE, DirectoryMachine

pytestmark = pytest.mark.integration
_SERVER: list[Etcd] = []
_LOOP: list[asyncio.AbstractEventLoop] = []
"""One loop for every example: gRPC's asyncio poller stays bound to the loop it first ran on."""


@pytest.fixture(scope="module", autouse=True)
def _etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    server = Etcd(tmp_path_factory.mktemp("etcd-sm"))
    _SERVER.append(server)
    _LOOP.append(asyncio.new_event_loop())
    yield
    _LOOP.pop().close()
    _SERVER.clear()
    server.close()


class _Peers:
    def __init__(self, facade: EtcdFacade) -> None:
        self.f = facade

    def register(self, *args: Any) -> PeerRecord:
        log = self.f.next_log()
        peer: PeerRecord = self.f.run(log.register_peer(*args))
        return peer

    def heartbeat(self, *args: Any) -> PeerRecord | None:
        peer: PeerRecord | None = self.f.propose("heartbeat", *args)
        return peer

    def unregister(self, *args: Any) -> int:
        aborted: int = self.f.propose("unregister", *args)
        return aborted

    @property
    def _peers(self) -> dict[str, PeerRecord]:
        return self.f.first._peers_view()


class EtcdFacade:
    """The slice of DirectoryState's interface the machine uses, every change proposed through etcd."""

    def __init__(self, loop: asyncio.AbstractEventLoop, logs: list[EtcdLog]) -> None:
        self.loop, self.logs, self.turn = loop, logs, 0
        self.peers = _Peers(self)
        self.first = _View(logs[0].state)

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def next_log(self) -> EtcdLog:
        self.turn += 1
        return self.logs[self.turn % 2]

    def propose(self, op: str, *args: Any) -> Any:
        return self.run(self.next_log().propose(op, *args))

    def publish_source(self, rid: str, room_id: int, pair: Pair, src: dpb.SourceDescriptor) -> RoomRecord:
        room: RoomRecord = self.propose("publish", rid, room_id, *astuple(pair), src)
        return room

    def join_as_decode(self, room_id: int, pair: Pair) -> RoomRecord:
        room: RoomRecord = self.propose("join", room_id, *astuple(pair))
        return room

    def begin_transfer(self, *args: Any) -> RoomRecord:
        room: RoomRecord = self.propose("begin", *args)
        return room

    def complete_room(self, *args: Any) -> RoomRecord:
        room: RoomRecord = self.propose("complete", *args)
        return room

    def abort_room(self, *args: Any) -> RoomRecord:
        room: RoomRecord = self.propose("abort", *args)
        return room

    def sweep(self) -> int:
        ended: int = self.propose("sweep")
        return ended

    def _find(self, room_id: int) -> RoomRecord | None:
        return self.first.find(room_id)

    @property
    def _rooms(self) -> dict[int, RoomRecord]:
        return self.first.state._rooms

    @property
    def _tombstones(self) -> dict[int, RoomRecord]:
        return dict(self.first.state._tombstones)

    def room_stats(self) -> Any:
        return self.first.state.room_stats()


class _View:
    """Reads of one replica that never apply anything themselves (no lazy expiry)."""

    def __init__(self, state: DirectoryState) -> None:
        self.state = state

    def find(self, room_id: int) -> RoomRecord | None:
        s = self.state
        return s._rooms.get(room_id) or s._tombstones.get(room_id) or s._ended.get(room_id)

    def _peers_view(self) -> dict[str, PeerRecord]:
        return self.state.peers._peers

    def digest(self) -> tuple[Any, ...]:
        s = self.state

        def rooms(table: dict[int, RoomRecord]) -> dict[int, tuple[Any, ...]]:
            return {i: (r.state, r.end_cause, r.read_declined, r.expires_at) for i, r in table.items()}

        peers = {p.peer_id: (p.epoch, p.expires_at, sorted(p.rooms)) for p in s.peers._peers.values()}
        return rooms(s._rooms), rooms(dict(s._tombstones)), rooms(dict(s._ended)), peers


class EtcdDirectoryMachine(DirectoryMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = _LOOP[0]
        cfg = DirectorySettings(
            room_lease_seconds=LEASE,
            peer_lease_seconds=6.0,
            heartbeat_interval_seconds=1.0,
            max_rooms=6,
            ended_rooms_retained=10_000,
            backend="etcd",
            etcd_endpoints=[_SERVER[0].endpoint],
            etcd_prefix=f"/sm/{uuid.uuid4().hex}/",
            etcd_snapshot_every=10,  # snapshots and compactions all along the walk
            etcd_timeout_seconds=30.0,  # a loaded CI box must not turn a slow etcd into a failed step
        )
        self.cfg = cfg
        self.steps = 0
        logs = [EtcdLog(cfg, wall=self.clock) for _ in range(2)]
        for log in logs:
            self.loop.run_until_complete(log.start())
        logs[0].state.listener = lambda room: self.changes.append((room.room_id, room.state))
        self.state = EtcdFacade(self.loop, logs)  # type: ignore[assignment]

    def teardown(self) -> None:
        for log in self.state.logs:  # type: ignore[attr-defined]
            self.loop.run_until_complete(log.stop())

    @invariant()
    def replicas_agree(self) -> None:
        facade: EtcdFacade = self.state  # type: ignore[assignment]
        for log in facade.logs:
            facade.run(log.sync())
        a, b = (_View(log.state).digest() for log in facade.logs)
        assert a == b
        self.steps += 1
        if self.steps % 8 == 0:
            # A replica started now (newest snapshot + the log after it) holds the same state.
            fresh = EtcdLog(self.cfg)
            facade.run(fresh.start())
            try:
                assert _View(fresh.state).digest() == a
            finally:
                facade.run(fresh.stop())


# Derandomized: the walks are the same on every run (they go through a real etcd, so a failure must
# replay); the in-memory machine explores new walks on every run.
EtcdDirectoryMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEtcdDirectoryMachine = EtcdDirectoryMachine.TestCase


def test_leases_lapse_at_the_same_log_position_on_every_replica() -> None:
    """Expiry edges through the log (rare in the bounded walk above): OPEN and SOURCE_READY rooms expire
    and a lapsed peer's room ends PEER_LOST, on both replicas alike."""
    machine = EtcdDirectoryMachine()
    try:
        machine.register_everyone()
        facade: EtcdFacade = machine.state  # type: ignore[assignment]
        epoch = {p: machine.epochs[p][-1] for p in machine.epochs}
        pair = Pair("p0", epoch["p0"], "d0", epoch["d0"])
        other = Pair("p1", epoch["p1"], "d1", epoch["d1"])
        assert facade.join_as_decode(1, pair).state == dpb.ROOM_STATE_OPEN
        assert facade.publish_source("", 2, pair, source()).state == dpb.ROOM_STATE_SOURCE_READY
        assert facade.publish_source("", 3, other, source()).state == dpb.ROOM_STATE_SOURCE_READY
        machine.clock.advance(LEASE / 2)
        for peer in ("p0", "d0"):
            facade.peers.heartbeat("", peer, epoch[peer], None)
        machine.clock.advance(LEASE / 2 + 0.5)
        facade.sweep()  # rooms 1-3 lapsed (p0 and d0 heartbeat, p1 and d1 did not but hold 6 s leases)
        assert facade.publish_source("", 4, other, source()).state == dpb.ROOM_STATE_SOURCE_READY
        machine.clock.advance(1.0)
        facade.sweep()  # p1 and d1 lapsed: room 4 ends with them, long before its own lease
        expired = (dpb.ROOM_STATE_EXPIRED, dpb.ROOM_END_CAUSE_LEASE_EXPIRED)
        want = {1: expired, 2: expired, 3: expired, 4: (dpb.ROOM_STATE_ABORTED, dpb.ROOM_END_CAUSE_PEER_LOST)}
        for log in facade.logs:
            facade.run(log.sync())
            view = _View(log.state)
            rooms = {i: view.find(i) for i in want}
            assert {i: (r.state, r.end_cause) for i, r in rooms.items() if r is not None} == want
        machine.replicas_agree()
    finally:
        machine.teardown()
