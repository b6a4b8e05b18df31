"""``DirectoryService`` with its state in etcd: the in-memory servicer whose writes go through the log.

Each mutating RPC proposes its call to :class:`~xavier_services.directory.etcd_store.EtcdLog` and answers
with what the local replica computed; each read first catches the replica up with etcd. Everything else
(feeds, waiters, wire forms, limits) is the in-memory servicer's, driven by the replica's listener, so
a room change proposed through any directory process reaches the feeds and waiting calls of all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import astuple

from google.protobuf.message import Message
from xavier.v1 import directory_service_pb2 as dpb

from xavier_core.runtime.durations import to_duration
from xavier_core.runtime.errors import XavierError
from xavier_core.runtime.logging import get_logger
from xavier_services.directory.config import DirectorySettings
from xavier_services.directory.etcd_store import EtcdLog
from xavier_services.directory.records import (
    TERMINAL_STATES,
    RoomRecord,
    peer_to_proto,
    room_to_proto,
    timestamp,
)
from xavier_services.directory.servicer import Ctx, DirectoryServicer
from xavier_services.directory.state import Pair

__all__ = ["EtcdDirectoryServicer"]

_log = get_logger("xavier.directory.etcd")


def _opt(req: Message, field: str) -> Message | None:
    """The sub-message ``field`` when set, else None (how the state machine tells "absent")."""
    value: Message = getattr(req, field)
    return value if req.HasField(field) else None


class EtcdDirectoryServicer(DirectoryServicer):
    """The directory RPCs over a replica of the etcd command log.

    Reads go through the base handlers inside :meth:`EtcdLog.reading`, which relies on those handlers
    not awaiting before they have read what they answer with.
    """

    def __init__(self, settings: DirectorySettings, log: EtcdLog | None = None) -> None:
        self.log = log if log is not None else EtcdLog(settings)
        super().__init__(settings, self.log.state)

    async def start(self, _handle: object = None) -> None:
        """Catches up with the log, then starts the sweeper."""
        await self.log.start()
        await super().start(_handle)

    async def stop(self, _handle: object = None) -> None:
        await super().stop(_handle)
        await self.log.stop()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_seconds)
            if self.state.next_deadline() <= self.log.wall():
                try:
                    await self.log.propose("sweep")
                except XavierError as exc:
                    _log.warning("directory sweep not logged", error=str(exc))

    # --- peers --------------------------------------------------------------------

    async def RegisterPeer(self, req: dpb.RegisterPeerRequest, ctx: Ctx) -> dpb.RegisterPeerResponse:
        peer = await self.log.register_peer(
            req.request_id, req.peer_id, req.role, req.address, _opt(req, "layout"), _opt(req, "endpoint")
        )
        return dpb.RegisterPeerResponse(
            peer=peer_to_proto(peer, self._offset),
            lease=to_duration(self.settings.peer_lease_seconds),
            heartbeat_interval=to_duration(self.settings.heartbeat_interval_seconds),
        )

    async def Heartbeat(self, req: dpb.HeartbeatRequest, ctx: Ctx) -> dpb.HeartbeatResponse:
        load = _opt(req, "load")
        peer = await self.log.propose("heartbeat", req.request_id, req.peer_id, req.epoch, load)
        if peer is None:
            return dpb.HeartbeatResponse(must_register=True)
        return dpb.HeartbeatResponse(lease_expires_at=timestamp(peer.expires_at + self._offset))

    async def UnregisterPeer(self, req: dpb.UnregisterPeerRequest, ctx: Ctx) -> dpb.UnregisterPeerResponse:
        aborted = await self.log.propose("unregister", req.peer_id, req.epoch)
        return dpb.UnregisterPeerResponse(rooms_aborted=aborted)

    async def ListPeers(self, req: dpb.ListPeersRequest, ctx: Ctx) -> dpb.ListPeersResponse:
        await self.log.sync()
        with self.log.reading():  # the base handler does not await: nothing is applied meanwhile
            return await super().ListPeers(req, ctx)

    # --- rooms --------------------------------------------------------------------

    async def PublishSource(self, req: dpb.PublishSourceRequest, ctx: Ctx) -> dpb.PublishSourceResponse:
        room = await self.log.propose(
            "publish", req.request_id, req.room_id, *astuple(Pair.of(req)), req.source
        )
        return dpb.PublishSourceResponse(room=self._room(room))

    async def BeginTransfer(self, req: dpb.BeginTransferRequest, ctx: Ctx) -> dpb.BeginTransferResponse:
        if req.wait_for_source:
            room: RoomRecord = await self.log.propose("join", req.room_id, *astuple(Pair.of(req)))
            await self._until_not_open(room)
            if room.state in TERMINAL_STATES:
                return dpb.BeginTransferResponse(room=self._room(room))
        room = await self.log.propose(
            "begin", req.request_id, req.room_id, req.decode_peer_id, req.decode_epoch
        )
        resp = dpb.BeginTransferResponse(room=room_to_proto(room, self._offset, with_token=True))
        if not req.source_endpoint_cached:
            with self.log.reading():
                resp.source_endpoint.CopyFrom(self.state.source_endpoint(room))
        return resp

    async def CompleteRoom(self, req: dpb.CompleteRoomRequest, ctx: Ctx) -> dpb.CompleteRoomResponse:
        room = await self.log.propose("complete", req.request_id, req.room_id, req.peer_id, req.epoch)
        return dpb.CompleteRoomResponse(room=self._room(room))

    async def AbortRoom(self, req: dpb.AbortRoomRequest, ctx: Ctx) -> dpb.AbortRoomResponse:
        room = await self.log.propose(
            "abort", req.request_id, req.room_id, req.cause, req.detail, req.peer_id, req.epoch
        )
        return dpb.AbortRoomResponse(room=self._room(room))

    async def GetRoom(self, req: dpb.GetRoomRequest, ctx: Ctx) -> dpb.GetRoomResponse:
        await self.log.sync()
        with self.log.reading():
            return await super().GetRoom(req, ctx)

    async def WatchPeerRooms(
        self, req: dpb.WatchPeerRoomsRequest, ctx: Ctx
    ) -> AsyncIterator[dpb.WatchPeerRoomsResponse]:
        await self.log.sync()
        feed = super().WatchPeerRooms(req, ctx)
        with self.log.reading():  # the snapshot and the subscription, in one step (no await before it)
            first = await anext(feed)
        yield first
        async for msg in feed:
            yield msg

    async def GetDirectoryStats(
        self, req: dpb.GetDirectoryStatsRequest, ctx: Ctx
    ) -> dpb.GetDirectoryStatsResponse:
        # As the in-memory handler sweeps first, but a sweep is logged only when something is due.
        if self.state.next_deadline() <= self.log.wall():
            await self.log.propose("sweep")
        else:
            await self.log.sync()
        return self._stats()
