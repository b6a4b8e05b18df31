"""The directory's commands: each change to its state is one frozen dataclass that applies itself.

A mutating RPC builds its command (`servicer.py`) and `DirectoryServicer._apply` runs
``command.apply(state)``; the etcd servicer logs the command first and every replica applies it in the
log's order (`etcd_store.py`; the stored form is `etcd_commands.py`). ``apply`` is deterministic given the
state and the replica's clock, which is what keeps replicas equal.

| command    | RPC                        | answer              |
|------------|----------------------------|---------------------|
| Register   | RegisterPeer               | the peer            |
| Heartbeat  | Heartbeat                  | the peer, or None   |
| Unregister | UnregisterPeer             | rooms aborted       |
| Publish    | PublishSource              | the room            |
| Join       | BeginTransfer (waiting)    | the live room       |
| Begin      | BeginTransfer              | the room            |
| Complete   | CompleteRoom               | the room            |
| Abort      | AbortRoom                  | the room            |
| Sweep      | (the sweeper, stats reads) | rooms ended         |
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_services.directory.records import PeerRecord, RoomRecord
from xavier_services.directory.state import DirectoryState, Pair

__all__ = [
    "Abort",
    "Begin",
    "Command",
    "Complete",
    "Heartbeat",
    "Join",
    "Publish",
    "Register",
    "Sweep",
    "Unregister",
]

R = TypeVar("R", covariant=True)


class Command(ABC, Generic[R]):
    """One change to the directory's state; ``R`` is what applying it answers."""

    __slots__ = ()
    op: ClassVar[str]
    """The command's name in the log."""
    live_reply: ClassVar[bool] = False
    """The answer is the live room (its caller waits on it), not a copy as the command left it."""

    @abstractmethod
    def apply(self, state: DirectoryState) -> R:
        """Applies the command to ``state`` and answers (or raises the state machine's typed error)."""


@dataclass(frozen=True, slots=True)
class Register(Command[PeerRecord]):
    """A peer registers (a new epoch); without ``peer_id`` it is named ``new_id``."""

    op: ClassVar[str] = "register"
    request_id: str
    peer_id: str
    role: int  # types_pb2.Role
    address: str
    layout: types_pb2.KvLayout | None
    endpoint: types_pb2.TransferEndpoint | None
    new_id: str = ""

    def apply(self, state: DirectoryState) -> PeerRecord:
        return state.peers.register(
            self.request_id, self.peer_id, self.role, self.address, self.layout, self.endpoint, self.new_id
        )


@dataclass(frozen=True, slots=True)
class Heartbeat(Command[PeerRecord | None]):
    """A peer renews its lease; None when the directory does not know that epoch (register again)."""

    op: ClassVar[str] = "heartbeat"
    request_id: str
    peer_id: str
    epoch: int
    load: dpb.PeerLoad | None

    def apply(self, state: DirectoryState) -> PeerRecord | None:
        return state.peers.heartbeat(self.request_id, self.peer_id, self.epoch, self.load)


@dataclass(frozen=True, slots=True)
class Unregister(Command[int]):
    """A peer leaves; its live rooms end (PEER_LOST) and their count is the answer."""

    op: ClassVar[str] = "unregister"
    peer_id: str
    epoch: int

    def apply(self, state: DirectoryState) -> int:
        return state.peers.unregister(self.peer_id, self.epoch)


@dataclass(frozen=True, slots=True)
class Publish(Command[RoomRecord]):
    """The prefill publishes its source pages (opening or adopting the room)."""

    op: ClassVar[str] = "publish"
    request_id: str
    room_id: int
    pair: Pair
    source: dpb.SourceDescriptor

    def apply(self, state: DirectoryState) -> RoomRecord:
        return state.publish_source(self.request_id, self.room_id, self.pair, self.source)


@dataclass(frozen=True, slots=True)
class Join(Command[RoomRecord]):
    """The decode opens or adopts the room before it waits for the source."""

    op: ClassVar[str] = "join"
    live_reply: ClassVar[bool] = True
    room_id: int
    pair: Pair

    def apply(self, state: DirectoryState) -> RoomRecord:
        return state.join_as_decode(self.room_id, self.pair)


@dataclass(frozen=True, slots=True)
class _DecodeStep(Command[RoomRecord]):
    """A step of the room's decode (``peer_id`` at ``epoch``)."""

    request_id: str
    room_id: int
    peer_id: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Begin(_DecodeStep):
    """The decode starts reading: the room moves to TRANSFERRING."""

    op: ClassVar[str] = "begin"

    def apply(self, state: DirectoryState) -> RoomRecord:
        return state.begin_transfer(self.request_id, self.room_id, self.peer_id, self.epoch)


@dataclass(frozen=True, slots=True)
class Complete(_DecodeStep):
    """The decode read every page: the room ends COMPLETED."""

    op: ClassVar[str] = "complete"

    def apply(self, state: DirectoryState) -> RoomRecord:
        return state.complete_room(self.request_id, self.room_id, self.peer_id, self.epoch)


@dataclass(frozen=True, slots=True)
class Abort(Command[RoomRecord]):
    """A room's peer (or the router, with ``peer_id`` empty) ends the room with a cause."""

    op: ClassVar[str] = "abort"
    request_id: str
    room_id: int
    cause: int  # dpb.RoomEndCause
    detail: str
    peer_id: str
    epoch: int

    def apply(self, state: DirectoryState) -> RoomRecord:
        return state.abort_room(
            self.request_id, self.room_id, self.cause, self.detail, self.peer_id, self.epoch
        )


@dataclass(frozen=True, slots=True)
class Sweep(Command[int]):
    """Ends every lapsed lease (rooms and peers); the answer is the rooms ended."""

    op: ClassVar[str] = "sweep"

    def apply(self, state: DirectoryState) -> int:
        return state.sweep()
