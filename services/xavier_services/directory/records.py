"""The directory's in-memory records and their wire form."""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf import timestamp_pb2
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.contract import KvLayout

__all__ = [
    "LIVE_STATES",
    "TERMINAL_STATES",
    "PeerRecord",
    "RoomRecord",
    "peer_to_proto",
    "room_to_proto",
    "timestamp",
]

OPEN = dpb.ROOM_STATE_OPEN
SOURCE_READY = dpb.ROOM_STATE_SOURCE_READY
TRANSFERRING = dpb.ROOM_STATE_TRANSFERRING
COMPLETED = dpb.ROOM_STATE_COMPLETED
ABORTED = dpb.ROOM_STATE_ABORTED
EXPIRED = dpb.ROOM_STATE_EXPIRED

LIVE_STATES = frozenset({OPEN, SOURCE_READY, TRANSFERRING})
"""States in which the handoff is still in progress (aborted when a peer dies)."""
TERMINAL_STATES = frozenset({COMPLETED, ABORTED, EXPIRED})
"""States a room never leaves."""


@dataclass(slots=True, eq=False)
class PeerRecord:
    """One registered peer (one epoch of it)."""

    peer_id: str
    epoch: int
    role: int
    address: str
    layout: types_pb2.KvLayout | None
    kv_layout: KvLayout | None
    fingerprint: str
    endpoint: types_pb2.TransferEndpoint | None
    expires_at: float
    load: types_pb2.PeerLoad | None = None
    rooms: set[int] = field(default_factory=set)
    """Ids of this peer's live rooms."""


@dataclass(slots=True, eq=False)
class RoomRecord:
    """One room (or the tombstone of an id aborted before anyone opened it: no members).

    ``expires_at`` is on the directory's monotonic clock.
    """

    room_id: int
    state: int
    prefill_peer_id: str
    prefill_epoch: int
    decode_peer_id: str
    decode_epoch: int
    expires_at: float
    source: dpb.SourceDescriptor | None = None
    end_cause: int = dpb.ROOM_END_CAUSE_UNSPECIFIED
    end_detail: str = ""
    read_declined: bool = False
    request_ids: dict[str, None] | None = None
    """Recent mutating request ids (insertion-ordered, bounded) for idempotent retries."""

    def remember(self, request_id: str, limit: int) -> None:
        """Records ``request_id`` (no-op when empty), dropping the oldest past ``limit``."""
        if not request_id:
            return
        ids = self.request_ids
        if ids is None:
            ids = self.request_ids = {}
        ids[request_id] = None
        if len(ids) > limit:
            del ids[next(iter(ids))]

    def seen(self, request_id: str) -> bool:
        """True when ``request_id`` was already applied to this room."""
        return bool(request_id) and self.request_ids is not None and request_id in self.request_ids


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    """A wall-clock float as a Timestamp."""
    whole = int(seconds // 1)
    return timestamp_pb2.Timestamp(seconds=whole, nanos=int((seconds - whole) * 1e9))


def room_to_proto(
    room: RoomRecord, wall_offset: float, with_source: bool = True, with_token: bool = False
) -> dpb.Room:
    """The wire form; ``wall_offset`` turns the monotonic expiry into wall-clock time.

    The source's read token goes only where ``with_token`` says (BeginTransfer, to the room's decode).
    """
    msg = dpb.Room(
        room_id=room.room_id,
        state=room.state,
        prefill_peer_id=room.prefill_peer_id,
        prefill_epoch=room.prefill_epoch,
        decode_peer_id=room.decode_peer_id,
        decode_epoch=room.decode_epoch,
        lease_expires_at=timestamp(room.expires_at + wall_offset),
        end_cause=room.end_cause,
        end_detail=room.end_detail,
        read_declined=room.read_declined,
    )
    if with_source and room.source is not None:
        msg.source.CopyFrom(room.source)
        if not with_token:
            msg.source.ClearField("read_token")
    return msg


def peer_to_proto(peer: PeerRecord, wall_offset: float) -> dpb.Peer:
    """The wire form of a peer."""
    msg = dpb.Peer(
        peer_id=peer.peer_id,
        epoch=peer.epoch,
        role=peer.role,
        address=peer.address,
        contract_fingerprint=peer.fingerprint,
        lease_expires_at=timestamp(peer.expires_at + wall_offset),
    )
    if peer.layout is not None:
        msg.layout.CopyFrom(peer.layout)
    if peer.endpoint is not None:
        msg.endpoint.CopyFrom(peer.endpoint)
    if peer.load is not None:
        msg.load.CopyFrom(peer.load)
    return msg
