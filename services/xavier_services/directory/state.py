"""The directory's state machine: peers with epochs and leases, rooms with their lifecycle.

Pure and synchronous (the servicer drives it from one event loop; tests drive it with a fake clock).

Rooms: OPEN → SOURCE_READY → (TRANSFERRING →) COMPLETED → RELEASED, or ABORTED / EXPIRED from any state
before RELEASED. Terminal states (RELEASED, ABORTED, EXPIRED) never change. Rules:

* A role that releases a room before it completed gives up on the handoff: the room is ABORTED.
  Releasing a completed room marks that role released; the room is RELEASED once both did.
* A lapsed lease ends the room: live rooms and completed rooms alike become EXPIRED (a completed room
  reaching its retention lease means someone never released it). Leases are checked lazily on every
  access and by :meth:`DirectoryState.sweep`, so an expiry never waits for the sweeper.
* A peer that dies (lease lapsed), leaves (unregister) or restarts (registers again: new epoch) aborts
  its rooms still in the handoff and counts as having released its completed rooms.
* Calls carrying an epoch other than the room's or the peer's current one get STALE_EPOCH.
* Mutating calls are idempotent by request id: a retry of an applied request returns the room as it is.

Every change of a room's state is reported to ``listener`` (the servicer wakes the room's watchers).
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.runtime.errors import CapacityExhausted, FailedPrecondition, LeaseExpired, NotFound
from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.peers import PeerTable
from xavier_services.directory.records import (
    ABORTED,
    COMPLETED,
    EXPIRED,
    LIVE_STATES,
    OPEN,
    RELEASED,
    SOURCE_READY,
    TERMINAL_STATES,
    TRANSFERRING,
    PeerRecord,
    RoomRecord,
)
from xavier_services.directory.validate import (
    check_fingerprint,
    check_lease,
    check_peer_id,
    check_request_id,
    check_room_id,
    check_source,
    check_text,
)

__all__ = ["DirectoryState", "RoomStats"]

_ROLE_PREFILL = types_pb2.ROLE_PREFILL
_ROLE_DECODE = types_pb2.ROLE_DECODE


@dataclass(frozen=True, slots=True)
class RoomStats:
    """Room counters; ``opened == active + released + aborted + expired`` always holds."""

    active: int
    by_state: dict[int, int]
    opened: int
    completed: int
    released: int
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
        room_ids: Callable[[], int] | None = None,
        listener: Callable[[RoomRecord], None] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.wall_offset = wall() - clock()
        self.listener = listener
        self._new_room_id = room_ids or (lambda: secrets.randbits(63))
        self.peers = PeerTable(settings, clock, wall, self._peer_gone)
        self._rooms: dict[int, RoomRecord] = {}
        self._ended: OrderedDict[int, RoomRecord] = OrderedDict()
        self._expiry: list[tuple[float, int]] = []
        self._open_ids: OrderedDict[str, tuple[int, tuple[str, str, bytes]]] = OrderedDict()
        self._by_state = dict.fromkeys(dpb.RoomState.values(), 0)
        self._opened = 0
        self._completed = 0

    # --- rooms ----------------------------------------------------------------

    def open_room(
        self,
        request_id: str,
        prefill_peer_id: str,
        prefill_epoch: int,
        decode_peer_id: str,
        decode_epoch: int,
        prompt_fingerprint: bytes,
        num_tokens: int,
        lease: float | None,
        room_id: int = 0,
    ) -> RoomRecord:
        """Opens a room between two live peers of compatible layouts; idempotent by ``request_id``.

        ``room_id`` non-zero asks for that id (the caller already told the prefill): ROOM_EXISTS if taken.
        """
        check_request_id(request_id)
        check_peer_id(prefill_peer_id, "prefill_peer_id")
        check_peer_id(decode_peer_id, "decode_peer_id")
        check_fingerprint(prompt_fingerprint)
        check_lease(lease, self.settings.max_room_lease_seconds)
        key = (prefill_peer_id, decode_peer_id, prompt_fingerprint)
        if request_id and request_id in self._open_ids:
            room_id, seen_key = self._open_ids[request_id]
            if seen_key != key:
                raise FailedPrecondition(
                    "request_id was used for another room", reason="REQUEST_ID_REUSED", request_id=request_id
                )
            return self.get_room(room_id)
        if prefill_peer_id == decode_peer_id:
            raise FailedPrecondition("prefill and decode peers must differ", reason="WRONG_ROLE")
        prefill = self.peers.current(prefill_peer_id, prefill_epoch, (_ROLE_PREFILL, types_pb2.ROLE_UNIFIED))
        decode = self.peers.current(decode_peer_id, decode_epoch, (_ROLE_DECODE, types_pb2.ROLE_UNIFIED))
        self.peers.require_compatible(prefill, decode)
        if len(self._rooms) >= self.settings.max_rooms:
            raise CapacityExhausted(f"{len(self._rooms)} rooms open", limit=self.settings.max_rooms)
        if room_id:
            check_room_id(room_id)
            if room_id in self._rooms or room_id in self._ended:
                raise FailedPrecondition(f"room {room_id} exists", reason="ROOM_EXISTS", room_id=room_id)
        else:
            room_id = self._new_room_id()
            while room_id == 0 or room_id in self._rooms or room_id in self._ended:
                room_id = self._new_room_id()
        expires = self.clock() + (lease if lease is not None else self.settings.room_lease_seconds)
        room = RoomRecord(
            room_id, OPEN, prefill.peer_id, prefill.epoch, decode.peer_id, decode.epoch,
            prompt_fingerprint, num_tokens, expires,
        )  # fmt: skip
        self._rooms[room_id] = room
        prefill.rooms.add(room_id)
        decode.rooms.add(room_id)
        heapq.heappush(self._expiry, (expires, room_id))
        self._by_state[OPEN] += 1
        self._opened += 1
        if request_id:
            self._open_ids[request_id] = (room_id, key)
            if len(self._open_ids) > self.settings.idempotency_entries:
                self._open_ids.popitem(last=False)
        return room

    def publish_source(
        self, request_id: str, room_id: int, peer_id: str, epoch: int, source: dpb.SourceDescriptor
    ) -> RoomRecord:
        """Records the prefill's source pages: OPEN → SOURCE_READY."""
        check_source(source, self.settings)
        room, peer = self._member(request_id, room_id, peer_id, epoch, _ROLE_PREFILL)
        if room.seen(request_id):
            return room
        self._require_state(room, (OPEN,))
        if (
            source.contract_fingerprint
            and peer is not None
            and source.contract_fingerprint != peer.fingerprint
        ):
            raise FailedPrecondition(
                "source computed under another contract fingerprint",
                reason="LAYOUT_MISMATCH",
                fields="contract_fingerprint",
            )
        room.source = source
        room.remember(request_id, self.settings.request_ids_per_room)
        self._transition(room, SOURCE_READY)
        return room

    def begin_transfer(self, request_id: str, room_id: int, peer_id: str, epoch: int) -> RoomRecord:
        """The decode started reading: SOURCE_READY → TRANSFERRING (repeat calls are no-ops)."""
        room, _ = self._member(request_id, room_id, peer_id, epoch, _ROLE_DECODE)
        if room.seen(request_id) or room.state == TRANSFERRING:
            return room
        self._require_state(room, (SOURCE_READY,))
        room.remember(request_id, self.settings.request_ids_per_room)
        self._transition(room, TRANSFERRING)
        return room

    def complete_room(
        self, request_id: str, room_id: int, peer_id: str, epoch: int, release: bool = False
    ) -> RoomRecord:
        """The decode holds every page: SOURCE_READY / TRANSFERRING → COMPLETED, retention lease starts.

        With ``release`` the handoff also ends: the reader is done with the source and with the room, so
        both roles count as released and the room goes on to RELEASED at once.
        """
        room, _ = self._member(request_id, room_id, peer_id, epoch, _ROLE_DECODE)
        if room.seen(request_id) or room.state in (COMPLETED, RELEASED):
            return room
        self._require_state(room, (SOURCE_READY, TRANSFERRING))
        room.remember(request_id, self.settings.request_ids_per_room)
        self._set_lease(room, self.settings.completed_retention_seconds)
        self._completed += 1
        self._transition(room, COMPLETED)
        if release:
            room.prefill_released = room.decode_released = True
            self._end(room, RELEASED, "")
        return room

    def member_room(self, room_id: int, peer_id: str, epoch: int, role: int | None) -> RoomRecord:
        """The room, once ``peer_id`` is shown to hold ``role`` (None: either) in it at ``epoch``."""
        return self._member("", room_id, peer_id, epoch, role)[0]

    def peer_rooms(self, peer_id: str, epoch: int) -> list[RoomRecord]:
        """The live rooms of a registered peer at its current epoch."""
        check_peer_id(peer_id, "peer_id")
        peer = self.peers.current(peer_id, epoch, types_pb2.Role.values())
        return [self._room(r) for r in list(peer.rooms) if r in self._rooms]

    def renew_lease(self, room_id: int, peer_id: str, epoch: int, lease: float | None) -> RoomRecord:
        """Extends a live or completed room's lease from now (default: the state's default lease)."""
        check_lease(lease, self.settings.max_room_lease_seconds)
        room, _ = self._member("", room_id, peer_id, epoch, None)
        self._require_state(room, (OPEN, SOURCE_READY, TRANSFERRING, COMPLETED))
        if lease is None:
            s = self.settings
            lease = s.completed_retention_seconds if room.state == COMPLETED else s.room_lease_seconds
        self._set_lease(room, lease)
        return room

    def release_room(self, request_id: str, room_id: int, role: int, peer_id: str, epoch: int) -> RoomRecord:
        """Releases one role's hold (before completion this aborts the room)."""
        if role not in (_ROLE_PREFILL, _ROLE_DECODE):
            raise FailedPrecondition("role must be ROLE_PREFILL or ROLE_DECODE", reason="WRONG_ROLE")
        room, _ = self._member(request_id, room_id, peer_id, epoch, role)
        if room.seen(request_id):
            return room
        room.remember(request_id, self.settings.request_ids_per_room)
        self._mark_released(room, role, f"released by {types_pb2.Role.Name(role)} before completion")
        return room

    def abort_room(
        self, request_id: str, room_id: int, reason: str, peer_id: str, epoch: int, no_read: bool = False
    ) -> RoomRecord:
        """Ends a room that is not terminal (``peer_id`` empty: the router); an ended room stays as it is.

        ``no_read`` from the room's decode records that it never posted a read (``read_declined``), even
        on a room that already ended, so the source can unpin without waiting for a park timeout.
        """
        check_text(reason, "reason", limit=1024)
        if peer_id:
            room, _ = self._member(request_id, room_id, peer_id, epoch, _ROLE_DECODE if no_read else None)
        else:
            if no_read:
                raise FailedPrecondition("only the room's decode can decline the read", reason="WRONG_ROLE")
            check_request_id(request_id)
            room = self._room(room_id)
        if room.state not in TERMINAL_STATES:
            room.remember(request_id, self.settings.request_ids_per_room)
            room.read_declined = room.read_declined or no_read
            self._end(room, ABORTED, reason or "aborted")
        elif no_read and not room.read_declined and room.state != RELEASED:
            room.read_declined = True
            if self.listener is not None:
                self.listener(room)
        return room

    def get_room(self, room_id: int) -> RoomRecord:
        """The room (live or recently ended), or ROOM_NOT_FOUND."""
        return self._room(room_id)

    def room_stats(self) -> RoomStats:
        """Counters; live states are current counts, terminal states totals since start."""
        by = dict(self._by_state)
        by.pop(dpb.ROOM_STATE_UNSPECIFIED, None)
        return RoomStats(
            len(self._rooms), by, self._opened, self._completed, by[RELEASED], by[ABORTED], by[EXPIRED]
        )

    def sweep(self) -> int:
        """Ends every room and peer whose lease lapsed; returns how many rooms ended."""
        before = self._by_state[EXPIRED] + self._by_state[ABORTED]
        self.peers.sweep()
        now = self.clock()
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, room_id = heapq.heappop(heap)
            room = self._rooms.get(room_id)
            if room is not None and room.expires_at <= now:
                self._end(room, EXPIRED, "lease expired")
        if len(heap) > 2 * len(self._rooms) + 1024:
            # Renewals leave stale entries behind; rebuild so the heap stays proportional to live rooms.
            self._expiry = [(r.expires_at, r.room_id) for r in self._rooms.values()]
            heapq.heapify(self._expiry)
        return self._by_state[EXPIRED] + self._by_state[ABORTED] - before

    # --- internals ------------------------------------------------------------

    def _room(self, room_id: int) -> RoomRecord:
        check_room_id(room_id)
        room = self._rooms.get(room_id)
        if room is not None:
            if room.expires_at <= self.clock():
                self._end(room, EXPIRED, "lease expired")
            return room
        ended = self._ended.get(room_id)
        if ended is None:
            raise NotFound(f"room {room_id} not found", reason="ROOM_NOT_FOUND", room_id=room_id)
        return ended

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
            f"room {room.room_id} is {name}" + (f" ({room.end_reason})" if room.end_reason else ""),
            reason="WRONG_STATE",
            room_id=room.room_id,
            state=name,
        )

    def _set_lease(self, room: RoomRecord, seconds: float) -> None:
        room.expires_at = self.clock() + seconds
        heapq.heappush(self._expiry, (room.expires_at, room.room_id))

    def _transition(self, room: RoomRecord, state: int) -> None:
        self._by_state[room.state] -= 1
        self._by_state[state] += 1
        room.state = state
        if self.listener is not None:
            self.listener(room)

    def _mark_released(self, room: RoomRecord, role: int, reason: str) -> None:
        if role == _ROLE_PREFILL:
            room.prefill_released = True
        else:
            room.decode_released = True
        if room.state in LIVE_STATES:
            self._end(room, ABORTED, reason)
        elif room.state == COMPLETED and room.prefill_released and room.decode_released:
            self._end(room, RELEASED, "")

    def _end(self, room: RoomRecord, state: int, reason: str) -> None:
        del self._rooms[room.room_id]
        for peer_id in (room.prefill_peer_id, room.decode_peer_id):
            peer = self.peers.get(peer_id)
            if peer is not None:
                peer.rooms.discard(room.room_id)
        room.end_reason = reason
        self._transition(room, state)
        if self.settings.ended_rooms_retained:
            # Ended rooms drop their page runs: late callers need the end state, not the pages.
            room.source = None
            self._ended[room.room_id] = room
            if len(self._ended) > self.settings.ended_rooms_retained:
                self._ended.popitem(last=False)

    def _peer_gone(self, peer: PeerRecord, why: str) -> int:
        """A peer epoch ended: abort its rooms in the handoff, release its completed ones."""
        aborted = 0
        role_of = {True: _ROLE_PREFILL, False: _ROLE_DECODE}
        for room_id in list(peer.rooms):
            room = self._rooms.get(room_id)
            if room is None:
                continue
            is_prefill = room.prefill_peer_id == peer.peer_id and room.prefill_epoch == peer.epoch
            if room.state in LIVE_STATES:
                aborted += 1
            self._mark_released(room, role_of[is_prefill], f"peer {peer.peer_id} {why}")
        peer.rooms.clear()
        return aborted
