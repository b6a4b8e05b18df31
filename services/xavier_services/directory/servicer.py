"""``xavier.v1.DirectoryService`` over the state machine.

Handlers are thin: convert the request, call :class:`DirectoryState`, convert the answer. Every change
goes through :meth:`DirectoryServicer._apply` as one of the directory's commands (`commands.py`), and
every read happens after :meth:`~DirectoryServicer._sync` and inside :meth:`~DirectoryServicer._reading`;
here they apply at once and read as is, and the etcd servicer logs the commands and catches up first.
Domain errors propagate as typed exceptions and the runtime interceptor turns them into rich statuses.
Peer feeds wait on a per-feed queue, and BeginTransfer calls waiting for a source on a future, that the
state machine's listener fills on every state change, so nothing polls.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import types_pb2

from xavier_core.runtime.durations import to_duration
from xavier_core.runtime.errors import CapacityExhausted, InvalidArgument, Unavailable
from xavier_core.runtime.identity import ROLE_NAMES, require
from xavier_core.runtime.tasks import cancel_and_wait
from xavier_services.directory.commands import (
    Abort,
    Begin,
    Command,
    Complete,
    Heartbeat,
    Join,
    Publish,
    Register,
    Unregister,
)
from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.records import (
    OPEN,
    TERMINAL_STATES,
    RoomRecord,
    peer_to_proto,
    room_to_proto,
    timestamp,
)
from xavier_services.directory.state import DirectoryState, Pair

__all__ = ["SERVICE_NAME", "DirectoryServicer"]

SERVICE_NAME = dpb.DESCRIPTOR.services_by_name["DirectoryService"].full_name
Ctx = Any  # grpc.aio.ServicerContext; typed loosely to keep handler signatures short


K = TypeVar("K")
V = TypeVar("V")
R = TypeVar("R")


def _opt(req: Message, field: str) -> Message | None:
    """The sub-message ``field`` when set, else None (how the state machine tells "absent")."""
    value: Message = getattr(req, field)
    return value if req.HasField(field) else None


@contextlib.contextmanager
def _subscribed(table: dict[K, list[V]], key: K, item: V, limit: int, owner: str, noun: str) -> Iterator[V]:
    """Adds `item` to `table[key]` (CAPACITY_EXHAUSTED once it holds `limit`), removes it on exit."""
    items = table.setdefault(key, [])
    if len(items) >= limit:
        raise CapacityExhausted(f"{owner} has {len(items)} {noun}", limit=limit)
    items.append(item)
    try:
        yield item
    finally:
        left = table.get(key)  # the listener may have taken the whole list already
        if left is not None and item in left:
            left.remove(item)
            if not left:
                del table[key]


class DirectoryServicer(dpb_grpc.DirectoryServiceServicer):  # type: ignore[misc]
    """The directory's RPCs plus its expiry sweeper (``start`` / ``stop``)."""

    def __init__(self, settings: DirectorySettings, state: DirectoryState | None = None) -> None:
        self.settings = settings
        self.state = state if state is not None else DirectoryState(settings)
        self.state.listener = self._changed
        self._offset = self.state.wall_offset
        # Per-peer feeds (WatchPeerRooms) and BeginTransfer calls waiting for a room to leave OPEN.
        # WatchPeerRooms feeds by (peer id, epoch): a restarted peer's new epoch has slots of its own, so
        # watches of its old epoch (a dead process's, not yet timed out) never keep it from watching.
        self._feeds: dict[tuple[str, int], list[asyncio.Queue[dpb.Room | None]]] = {}
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    # --- lifecycle ----------------------------------------------------------------

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        """Adds the servicer to ``server``; returns the service name for health and reflection."""
        dpb_grpc.add_DirectoryServiceServicer_to_server(self, server)
        return [SERVICE_NAME]

    async def start(self, _handle: object = None) -> None:
        """Starts the expiry sweeper."""
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="directory-sweeper")

    async def stop(self, _handle: object = None) -> None:
        """Stops the sweeper and ends every peer feed with UNAVAILABLE (SHUTTING_DOWN)."""
        await cancel_and_wait(self._sweeper)
        for queues in self._feeds.values():
            for queue in queues:
                queue.put_nowait(None)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_seconds)
            self.state.sweep()

    def _changed(self, room: RoomRecord) -> None:
        members = ((room.prefill_peer_id, room.prefill_epoch), (room.decode_peer_id, room.decode_epoch))
        feeds = [q for member in members for q in self._feeds.get(member, ())]
        if feeds:
            brief = room_to_proto(room, self._offset, with_source=False)
            for queue in feeds:
                queue.put_nowait(brief)
        for fut in self._waiters.pop(room.room_id, ()):
            if not fut.done():
                fut.set_result(None)

    async def _until_not_open(self, room: RoomRecord) -> None:
        """Waits until the room leaves OPEN (its lease bounds the wait; the call's deadline too)."""
        limit = self.settings.max_watchers_per_room
        while room.state == OPEN:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            with _subscribed(self._waiters, room.room_id, fut, limit, f"room {room.room_id}", "waiters"):
                await fut

    def _room(self, room: RoomRecord) -> dpb.Room:
        return room_to_proto(room, self._offset)

    async def _apply(self, command: Command[R]) -> R:
        """Applies one of the directory's commands and returns the state machine's answer."""
        return command.apply(self.state)

    async def _sync(self) -> None:
        """Before a read: nothing to catch up with here."""

    def _reading(self) -> contextlib.AbstractContextManager[None]:
        """Around a read (which must not await): here the state as it is."""
        return contextlib.nullcontext()

    # --- peers --------------------------------------------------------------------

    async def RegisterPeer(self, req: dpb.RegisterPeerRequest, ctx: Ctx) -> dpb.RegisterPeerResponse:
        require(ctx, "RegisterPeer", peer_id=req.peer_id, peer_role=ROLE_NAMES.get(req.role, "?"))
        layout, endpoint = _opt(req, "layout"), _opt(req, "endpoint")
        peer = await self._apply(
            Register(req.request_id, req.peer_id, req.role, req.address, layout, endpoint)
        )
        return dpb.RegisterPeerResponse(
            peer=peer_to_proto(peer, self._offset),
            lease=to_duration(self.settings.peer_lease_seconds),
            heartbeat_interval=to_duration(self.settings.heartbeat_interval_seconds),
        )

    async def Heartbeat(self, req: dpb.HeartbeatRequest, ctx: Ctx) -> dpb.HeartbeatResponse:
        require(ctx, "Heartbeat", peer_id=req.peer_id)
        peer = await self._apply(Heartbeat(req.request_id, req.peer_id, req.epoch, _opt(req, "load")))
        if peer is None:
            return dpb.HeartbeatResponse(must_register=True)
        return dpb.HeartbeatResponse(lease_expires_at=timestamp(peer.expires_at + self._offset))

    async def UnregisterPeer(self, req: dpb.UnregisterPeerRequest, ctx: Ctx) -> dpb.UnregisterPeerResponse:
        require(ctx, "UnregisterPeer", peer_id=req.peer_id)
        return dpb.UnregisterPeerResponse(rooms_aborted=await self._apply(Unregister(req.peer_id, req.epoch)))

    async def ListPeers(self, req: dpb.ListPeersRequest, ctx: Ctx) -> dpb.ListPeersResponse:
        s = self.settings
        size = min(req.page_size or s.list_page_size, s.max_list_page_size)
        after = ""
        if req.page_token:
            try:
                raw = req.page_token.encode("ascii")
                after = base64.b64decode(raw, altchars=b"-_", validate=True).decode("utf-8")
            except (ValueError, UnicodeError, binascii.Error):
                raise InvalidArgument("page_token is not valid", field="page_token") from None
        if req.role not in types_pb2.Role.values():
            raise InvalidArgument(f"role {req.role} unknown", field="role")
        await self._sync()
        with self._reading():
            peers, last = self.state.peers.page(size, after, req.role, req.contract_fingerprint)
        token = base64.urlsafe_b64encode(last.encode()).decode("ascii") if last else ""
        return dpb.ListPeersResponse(
            peers=[peer_to_proto(p, self._offset) for p in peers], next_page_token=token
        )

    # --- rooms --------------------------------------------------------------------

    async def PublishSource(self, req: dpb.PublishSourceRequest, ctx: Ctx) -> dpb.PublishSourceResponse:
        require(ctx, "PublishSource", peer_id=req.prefill_peer_id)
        room = await self._apply(Publish(req.request_id, req.room_id, Pair.of(req), req.source))
        return dpb.PublishSourceResponse(room=self._room(room))

    async def BeginTransfer(self, req: dpb.BeginTransferRequest, ctx: Ctx) -> dpb.BeginTransferResponse:
        require(ctx, "BeginTransfer", peer_id=req.decode_peer_id)
        if req.wait_for_source:
            # The live record: the wait ends when the room leaves OPEN.
            room: RoomRecord = await self._apply(Join(req.room_id, Pair.of(req)))
            await self._until_not_open(room)
            if room.state in TERMINAL_STATES:
                return dpb.BeginTransferResponse(room=self._room(room))
        room = await self._apply(Begin(req.request_id, req.room_id, req.decode_peer_id, req.decode_epoch))
        resp = dpb.BeginTransferResponse(room=room_to_proto(room, self._offset, with_token=True))
        if not req.source_endpoint_cached:
            with self._reading():
                resp.source_endpoint.CopyFrom(self.state.source_endpoint(room))
        return resp

    async def CompleteRoom(self, req: dpb.CompleteRoomRequest, ctx: Ctx) -> dpb.CompleteRoomResponse:
        require(ctx, "CompleteRoom", peer_id=req.peer_id)
        room = await self._apply(Complete(req.request_id, req.room_id, req.peer_id, req.epoch))
        return dpb.CompleteRoomResponse(room=self._room(room))

    async def AbortRoom(self, req: dpb.AbortRoomRequest, ctx: Ctx) -> dpb.AbortRoomResponse:
        # Empty peer_id: as the router (any room); else as that peer, which must be one of the room's.
        require(ctx, "AbortRoom", roles=("router",), peer_id=req.peer_id or None)
        room = await self._apply(
            Abort(req.request_id, req.room_id, req.cause, req.detail, req.peer_id, req.epoch)
        )
        return dpb.AbortRoomResponse(room=self._room(room))

    async def GetRoom(self, req: dpb.GetRoomRequest, ctx: Ctx) -> dpb.GetRoomResponse:
        await self._sync()
        with self._reading():
            return dpb.GetRoomResponse(room=self._room(self.state.get_room(req.room_id)))

    async def WatchPeerRooms(
        self, req: dpb.WatchPeerRoomsRequest, ctx: Ctx
    ) -> AsyncIterator[dpb.WatchPeerRoomsResponse]:
        require(ctx, "WatchPeerRooms", peer_id=req.peer_id)
        await self._sync()
        with self._reading():
            live = self.state.peer_rooms(req.peer_id, req.epoch)
        limit = self.settings.max_watchers_per_room
        # Registered in the same step as the snapshot (no await between): no change falls between the two.
        queue: asyncio.Queue[dpb.Room | None] = asyncio.Queue()
        owner = f"peer {req.peer_id} epoch {req.epoch}"
        with _subscribed(self._feeds, (req.peer_id, int(req.epoch)), queue, limit, owner, "feeds"):
            yield dpb.WatchPeerRoomsResponse(
                rooms=[room_to_proto(r, self._offset, with_source=False) for r in live]
            )
            window = self.settings.feed_batch_window_seconds
            while True:
                batch = [await queue.get()]
                if window:
                    await asyncio.sleep(window)  # lets changes of concurrent rooms share this message
                while not queue.empty() and len(batch) < self.settings.max_feed_batch:
                    batch.append(queue.get_nowait())
                if None in batch:
                    raise Unavailable("directory is shutting down", reason="SHUTTING_DOWN")
                yield dpb.WatchPeerRoomsResponse(rooms=batch)

    async def GetDirectoryStats(
        self, req: dpb.GetDirectoryStatsRequest, ctx: Ctx
    ) -> dpb.GetDirectoryStatsResponse:
        self.state.sweep()
        return self._stats()

    def _stats(self) -> dpb.GetDirectoryStatsResponse:
        stats = self.state.room_stats()
        return dpb.GetDirectoryStatsResponse(
            rooms_active=stats.active,
            rooms_by_state={dpb.RoomState.Name(k): v for k, v in stats.by_state.items()},
            rooms_opened=stats.opened,
            rooms_completed=stats.completed,
            rooms_aborted=stats.aborted,
            rooms_expired=stats.expired,
            peers_by_role={types_pb2.Role.Name(k): v for k, v in self.state.peers.by_role().items()},
        )
