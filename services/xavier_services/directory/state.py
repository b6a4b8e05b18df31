"""The directory's state machine: peers with epochs and leases, rooms with their lifecycle.

Pure and synchronous (the servicer drives it from one event loop; tests drive it with a fake clock).

Rooms: OPEN → SOURCE_READY → (TRANSFERRING →) COMPLETED, or ABORTED / EXPIRED from any state before
COMPLETED. Terminal states (COMPLETED, ABORTED, EXPIRED) never change. Rules:

* Nobody opens a room on its own: the router chooses the id and the pair, and the first of the prefill's
  PublishSource and the decode's BeginTransfer to arrive opens it (SOURCE_READY or OPEN); the other
  adopts it. Both carry the pair, and a pair other than the room's is refused, so neither side can come
  too early and no one retries.
* An AbortRoom for an id nobody opened yet leaves an aborted *tombstone* for one room lease (not counted
  as a room): the late opener sees the room ended instead of opening it.
* A lapsed lease ends a live room as EXPIRED. Leases are checked lazily on every access and by
  :meth:`DirectoryState.sweep`, so an expiry never waits for the sweeper.
* A peer that dies (lease lapsed), leaves (unregister) or restarts (registers again: new epoch) aborts
  its live rooms with ``ROOM_END_CAUSE_PEER_LOST``.
* Calls carrying an epoch other than the room's or the peer's current one get STALE_EPOCH.
* Mutating calls are idempotent by request id: a retry of an applied request returns the room as it is.

Every change of a room's state is reported to ``listener`` (the servicer wakes the room's waiters).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.runtime.errors import (
    CapacityExhausted,
    FailedPrecondition,
    InvalidArgument,
    LeaseExpired,
    NotFound,
    Unavailable,
)
from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.peers import PeerTable
from xavier_services.directory.records import (
    ABORTED,
    COMPLETED,
    EXPIRED,
    OPEN,
    SOURCE_READY,
    TERMINAL_STATES,
    TRANSFERRING,
    PeerRecord,
    RoomRecord,
)
from xavier_services.directory.validate import (
    check_peer_id,
    check_request_id,
    check_room_id,
    check_source,
    check_text,
)

__all__ = ["DirectoryState", "Pair", "RoomStats"]

_ROLE_PREFILL = types_pb2.ROLE_PREFILL
_ROLE_DECODE = types_pb2.ROLE_DECODE
_DECLINED = dpb.ROOM_END_CAUSE_DECODE_DECLINED


@dataclass(frozen=True, slots=True)
class Pair:
    """The prefill and decode peers (at their epochs) the router chose for a room."""

    prefill_peer_id: str
    prefill_epoch: int
    decode_peer_id: str
    decode_epoch: int

    @classmethod
    def of(cls, req: dpb.PublishSourceRequest | dpb.BeginTransferRequest) -> Pair:
        """The pair a PublishSource or BeginTransfer request names."""
        return cls(req.prefill_peer_id, req.prefill_epoch, req.decode_peer_id, req.decode_epoch)


@dataclass(frozen=True, slots=True)
class RoomStats:
    """Room counters; ``opened == active + completed + aborted + expired`` always holds."""

    active: int
    by_state: dict[int, int]
    opened: int
    completed: int
    aborted: int
    expired: int


class DirectoryState:
    """Peers and rooms. ``clock`` is monotonic seconds; ``wall`` is Unix seconds (timestamps, epochs)."""

    def __init__(
        self,
        settings: DirectorySettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        listener: Callable[[RoomRecord], None] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.wall_offset = wall() - clock()
        self.listener = listener
        self.peers = PeerTable(settings, clock, wall, self._peer_gone)
        self._rooms: dict[int, RoomRecord] = {}
        self._ended: OrderedDict[int, RoomRecord] = OrderedDict()
        self._tombstones: OrderedDict[int, RoomRecord] = OrderedDict()
        self._expiry: list[tuple[float, int]] = []
        self._by_state = dict.fromkeys(dpb.RoomState.values(), 0)
        self._opened = 0

    # --- rooms ----------------------------------------------------------------

    def publish_source(
        self, request_id: str, room_id: int, pair: Pair, source: dpb.SourceDescriptor
    ) -> RoomRecord:
        """The prefill's source pages: opens the room SOURCE_READY, or moves the decode's OPEN room there.

        A room that already ended (e.g. a tombstone of the router's abort) comes back as it ended.
        """
        check_source(source, self.settings)
        check_request_id(request_id)
        room = self._find(room_id)
        if room is None:
            self._check_source_peer(pair, source)
            room = self._open(room_id, pair, SOURCE_READY, source)
            room.remember(request_id, self.settings.request_ids_per_room)
            return room
        if not room.prefill_peer_id:
            return room  # a tombstone: ended before either member opened it
        self._require_pair(room, pair)
        if room.state in TERMINAL_STATES:
            return room
        room, _ = self._member(request_id, room_id, pair.prefill_peer_id, pair.prefill_epoch, _ROLE_PREFILL)
        if room.seen(request_id):
            return room
        self._require_state(room, (OPEN,))
        self._check_source_peer(pair, source)
        room.source = source
        room.remember(request_id, self.settings.request_ids_per_room)
        self._transition(room, SOURCE_READY)
        return room

    def join_as_decode(self, room_id: int, pair: Pair) -> RoomRecord:
        """The decode's side of the rendezvous: opens the room OPEN, or adopts the prefill's.

        The room may come back ended (the caller reads its state); a live one is shown to be the pair's.
        """
        room = self._find(room_id)
        if room is None:
            return self._open(room_id, pair, OPEN, None)
        if not room.prefill_peer_id:
            return room  # a tombstone: ended before either member opened it
        self._require_pair(room, pair)
        return self._member("", room_id, pair.decode_peer_id, pair.decode_epoch, _ROLE_DECODE)[0]

    def begin_transfer(self, request_id: str, room_id: int, peer_id: str, epoch: int) -> RoomRecord:
        """The decode started reading: SOURCE_READY → TRANSFERRING (repeat calls are no-ops)."""
        room, _ = self._member(request_id, room_id, peer_id, epoch, _ROLE_DECODE)
        if room.seen(request_id) or room.state == TRANSFERRING:
            return room
        self._require_state(room, (SOURCE_READY,))
        room.remember(request_id, self.settings.request_ids_per_room)
        self._transition(room, TRANSFERRING)
        return room

    def source_endpoint(self, room: RoomRecord) -> types_pb2.TransferEndpoint:
        """The transfer endpoint of the room's prefill at the room's epoch (sent once per epoch)."""
        peer = self.peers.get(room.prefill_peer_id)
        if peer is None or peer.epoch != room.prefill_epoch or peer.endpoint is None:
            raise Unavailable(
                f"prefill {room.prefill_peer_id!r} of room {room.room_id} is gone",
                reason="PEER_UNAVAILABLE",
                peer_id=room.prefill_peer_id,
            )
        return peer.endpoint

    def complete_room(self, request_id: str, room_id: int, peer_id: str, epoch: int) -> RoomRecord:
        """The decode holds every page: SOURCE_READY / TRANSFERRING → COMPLETED; the handoff is over."""
        room, _ = self._member(request_id, room_id, peer_id, epoch, _ROLE_DECODE)
        if room.seen(request_id) or room.state == COMPLETED:
            return room
        self._require_state(room, (SOURCE_READY, TRANSFERRING))
        room.remember(request_id, self.settings.request_ids_per_room)
        self._end(room, COMPLETED, dpb.ROOM_END_CAUSE_UNSPECIFIED, "")
        return room

    def abort_room(
        self, request_id: str, room_id: int, cause: int, detail: str, peer_id: str, epoch: int
    ) -> RoomRecord:
        """Ends a live room (``peer_id`` empty: the router); an ended room stays as it is.

        An id nobody opened yet gets a tombstone. ``ROOM_END_CAUSE_DECODE_DECLINED`` from the room's
        decode records that it never posted a read (``read_declined``), even on a room that already
        ended, so the source can unpin without waiting for a park timeout.
        """
        check_request_id(request_id)
        check_text(detail, "detail", limit=1024)
        if cause == dpb.ROOM_END_CAUSE_UNSPECIFIED or cause not in dpb.RoomEndCause.values():
            raise InvalidArgument(f"cause {cause} is not a room end cause", field="cause")
        declined = cause == _DECLINED
        if declined and not peer_id:
            raise FailedPrecondition("only the room's decode can decline the read", reason="WRONG_ROLE")
        room = self._find(room_id)
        if room is None:
            return self._tombstone(room_id, cause, detail)
        if peer_id and room.prefill_peer_id:
            room, _ = self._member(request_id, room_id, peer_id, epoch, _ROLE_DECODE if declined else None)
        if room.state not in TERMINAL_STATES:
            room.remember(request_id, self.settings.request_ids_per_room)
            room.read_declined = room.read_declined or declined
            self._end(room, ABORTED, cause, detail or dpb.RoomEndCause.Name(cause))
        elif declined and room.prefill_peer_id and not room.read_declined and room.state != COMPLETED:
            # A tombstone (never opened) has no members to tell: only a room that had peers is marked.
            room.read_declined = True
            if self.listener is not None:
                self.listener(room)
        return room

    def peer_rooms(self, peer_id: str, epoch: int) -> list[RoomRecord]:
        """The live rooms of a registered peer at its current epoch."""
        check_peer_id(peer_id, "peer_id")
        peer = self.peers.current(peer_id, epoch, types_pb2.Role.values())
        return [self._room(r) for r in list(peer.rooms) if r in self._rooms]

    def get_room(self, room_id: int) -> RoomRecord:
        """The room (live, tombstone or recently ended), or ROOM_NOT_FOUND."""
        return self._room(room_id)

    def room_stats(self) -> RoomStats:
        """Counters; live states are current counts, terminal states totals since start."""
        by = dict(self._by_state)
        by.pop(dpb.ROOM_STATE_UNSPECIFIED, None)
        return RoomStats(len(self._rooms), by, self._opened, by[COMPLETED], by[ABORTED], by[EXPIRED])

    def next_deadline(self) -> float:
        """When the next room, tombstone or peer lease lapses, on ``clock`` (a sweep before is a no-op)."""
        room = self._expiry[0][0] if self._expiry else float("inf")
        return min(room, self.peers.next_expiry())

    def sweep(self) -> int:
        """Ends every room and peer whose lease lapsed and drops lapsed tombstones; returns rooms ended."""
        before = self._by_state[EXPIRED] + self._by_state[ABORTED]
        self.peers.sweep()
        now = self.clock()
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, room_id = heapq.heappop(heap)
            room = self._rooms.get(room_id)
            if room is not None and room.expires_at <= now:
                self._end(room, EXPIRED, dpb.ROOM_END_CAUSE_LEASE_EXPIRED, "room lease expired")
            else:
                self._drop_tombstone(room_id, now)
        if len(heap) > 2 * (len(self._rooms) + len(self._tombstones)) + 1024:
            # Lazy expiries leave stale entries behind; rebuild so the heap stays proportional.
            self.rebuild_expiry()
        return self._by_state[EXPIRED] + self._by_state[ABORTED] - before

    def rebuild_expiry(self) -> None:
        """The expiry heap from scratch: one entry per live room and tombstone."""
        live = (*self._rooms.values(), *self._tombstones.values())
        self._expiry = [(r.expires_at, r.room_id) for r in live]
        heapq.heapify(self._expiry)

    # --- internals ------------------------------------------------------------

    def _find(self, room_id: int) -> RoomRecord | None:
        check_room_id(room_id)
        room = self._rooms.get(room_id)
        if room is not None:
            if room.expires_at <= self.clock():
                self._end(room, EXPIRED, dpb.ROOM_END_CAUSE_LEASE_EXPIRED, "room lease expired")
            return room
        if room_id in self._tombstones:
            self._drop_tombstone(room_id, self.clock())
            tomb = self._tombstones.get(room_id)
            if tomb is not None:
                return tomb
        return self._ended.get(room_id)

    def _room(self, room_id: int) -> RoomRecord:
        room = self._find(room_id)
        if room is None:
            raise NotFound(f"room {room_id} not found", reason="ROOM_NOT_FOUND", room_id=room_id)
        return room

    def _open(self, room_id: int, pair: Pair, state: int, source: dpb.SourceDescriptor | None) -> RoomRecord:
        """A new room between two live peers of compatible layouts."""
        for name in ("prefill_peer_id", "decode_peer_id"):
            check_peer_id(getattr(pair, name), name)
        if pair.prefill_peer_id == pair.decode_peer_id:
            raise FailedPrecondition("prefill and decode peers must differ", reason="WRONG_ROLE")
        prefill = self.peers.current(pair.prefill_peer_id, pair.prefill_epoch, (_ROLE_PREFILL,))
        decode = self.peers.current(pair.decode_peer_id, pair.decode_epoch, (_ROLE_DECODE,))
        self.peers.require_compatible(prefill, decode)
        if len(self._rooms) >= self.settings.max_rooms:
            raise CapacityExhausted(f"{len(self._rooms)} rooms open", limit=self.settings.max_rooms)
        expires = self.clock() + self.settings.room_lease_seconds
        room = RoomRecord(
            room_id, state, pair.prefill_peer_id, pair.prefill_epoch, pair.decode_peer_id, pair.decode_epoch,
            expires, source=source,
        )  # fmt: skip
        self._rooms[room.room_id] = room
        prefill.rooms.add(room.room_id)
        decode.rooms.add(room.room_id)
        heapq.heappush(self._expiry, (expires, room.room_id))
        self._by_state[state] += 1
        self._opened += 1
        if self.listener is not None:
            self.listener(room)
        return room

    def _tombstone(self, room_id: int, cause: int, detail: str) -> RoomRecord:
        """An aborted room under an id nobody opened yet, kept one room lease (never counted)."""
        expires = self.clock() + self.settings.room_lease_seconds
        tomb = RoomRecord(room_id, ABORTED, "", 0, "", 0, expires)
        tomb.end_cause, tomb.end_detail = cause, detail or dpb.RoomEndCause.Name(cause)
        tomb.read_declined = cause == _DECLINED
        self._tombstones[room_id] = tomb
        heapq.heappush(self._expiry, (expires, room_id))
        while len(self._tombstones) > self.settings.max_rooms:
            self._tombstones.popitem(last=False)
        return tomb

    def _drop_tombstone(self, room_id: int, now: float) -> None:
        tomb = self._tombstones.get(room_id)
        if tomb is not None and tomb.expires_at <= now:
            del self._tombstones[room_id]

    def _check_source_peer(self, pair: Pair, source: dpb.SourceDescriptor) -> PeerRecord:
        check_peer_id(pair.prefill_peer_id, "prefill_peer_id")
        prefill = self.peers.current(pair.prefill_peer_id, pair.prefill_epoch, (_ROLE_PREFILL,))
        if source.contract_fingerprint and source.contract_fingerprint != prefill.fingerprint:
            raise FailedPrecondition(
                "source computed under another contract fingerprint",
                reason="LAYOUT_MISMATCH",
                fields="contract_fingerprint",
            )
        return prefill

    @staticmethod
    def _require_pair(room: RoomRecord, pair: Pair) -> None:
        have = (room.prefill_peer_id, room.prefill_epoch, room.decode_peer_id, room.decode_epoch)
        want = (pair.prefill_peer_id, pair.prefill_epoch, pair.decode_peer_id, pair.decode_epoch)
        if have != want:
            raise FailedPrecondition(
                f"room {room.room_id} was opened for {have[0]}@{have[1]} → {have[2]}@{have[3]}, "
                f"not {want[0][:128]}@{want[1]} → {want[2][:128]}@{want[3]}",
                reason="PAIR_MISMATCH",
                room_id=room.room_id,
            )

    def _member(
        self, request_id: str, room_id: int, peer_id: str, epoch: int, role: int | None
    ) -> tuple[RoomRecord, PeerRecord | None]:
        """The room, once ``peer_id`` is shown to hold ``role`` (None: either) in it at ``epoch``."""
        check_request_id(request_id)
        room = self._room(room_id)
        if role in (_ROLE_PREFILL, None) and peer_id == room.prefill_peer_id:
            room_epoch = room.prefill_epoch
        elif role in (_ROLE_DECODE, None) and peer_id == room.decode_peer_id:
            room_epoch = room.decode_epoch
        else:
            want = "a member" if role is None else types_pb2.Role.Name(role)
            raise FailedPrecondition(
                f"peer {peer_id[:128]!r} is not {want} of room {room_id}",
                reason="WRONG_ROLE",
                room_id=room_id,
            )
        peer = self.peers.get(peer_id)
        current = peer.epoch if peer is not None else room_epoch
        if epoch != room_epoch or epoch != current:
            raise FailedPrecondition(
                f"epoch {epoch} of peer {peer_id!r} is stale (room has {room_epoch}, peer has {current})",
                reason="STALE_EPOCH",
                peer_id=peer_id,
                epoch=epoch,
                current_epoch=current,
            )
        return room, peer

    def _require_state(self, room: RoomRecord, allowed: tuple[int, ...]) -> None:
        if room.state in allowed:
            return
        name = dpb.RoomState.Name(room.state)
        if room.state == EXPIRED:
            raise LeaseExpired(f"room {room.room_id} expired", room_id=room.room_id, state=name)
        raise FailedPrecondition(
            f"room {room.room_id} is {name}" + (f" ({room.end_detail})" if room.end_detail else ""),
            reason="WRONG_STATE",
            room_id=room.room_id,
            state=name,
        )

    def _transition(self, room: RoomRecord, state: int) -> None:
        self._by_state[room.state] -= 1
        self._by_state[state] += 1
        room.state = state
        if self.listener is not None:
            self.listener(room)

    def _end(self, room: RoomRecord, state: int, cause: int, detail: str) -> None:
        del self._rooms[room.room_id]
        for peer_id in (room.prefill_peer_id, room.decode_peer_id):
            peer = self.peers.get(peer_id)
            if peer is not None:
                peer.rooms.discard(room.room_id)
        room.end_cause, room.end_detail = cause, detail
        self._transition(room, state)
        if self.settings.ended_rooms_retained:
            # Ended rooms drop their page runs: late callers need the end state, not the pages.
            room.source = None
            self._ended[room.room_id] = room
            if len(self._ended) > self.settings.ended_rooms_retained:
                self._ended.popitem(last=False)

    def _peer_gone(self, peer: PeerRecord, why: str) -> int:
        """A peer epoch ended: abort its live rooms."""
        aborted = 0
        for room_id in list(peer.rooms):
            room = self._rooms.get(room_id)
            if room is None:
                continue
            aborted += 1
            self._end(room, ABORTED, dpb.ROOM_END_CAUSE_PEER_LOST, f"peer {peer.peer_id} {why}")
        peer.rooms.clear()
        return aborted
