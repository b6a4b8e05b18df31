"""Async client of ``xavier.v1.DirectoryService`` for peers and the router.

:class:`DirectoryClient` has one typed method per RPC. Each call has a deadline, UNAVAILABLE is retried
a bounded number of times (mutating calls carry a request id, so a retry is idempotent) and errors come
back typed (``from_rpc_error``). The channel comes from ``open_channel``: it reconnects quickly, so a
restarted directory is reached again within about one heartbeat interval.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import types_pb2

from xavier_core.runtime.channels import open_channel
from xavier_core.runtime.durations import to_duration, to_seconds
from xavier_core.runtime.errors import from_rpc_error
from xavier_core.runtime.retry import retry_unavailable

__all__ = ["TERMINAL_ROOM_STATES", "DirectoryClient", "Registration"]

T = TypeVar("T")
_MAX_RETRY_BACKOFF = 2.0
_LIST_PAGE_SIZE = 500

TERMINAL_ROOM_STATES = frozenset({dpb.ROOM_STATE_COMPLETED, dpb.ROOM_STATE_ABORTED, dpb.ROOM_STATE_EXPIRED})


def _rid(request_id: str | None) -> str:
    return request_id if request_id is not None else uuid.uuid4().hex


@dataclass(frozen=True)
class Registration:
    """One registration of a peer: its record (with the epoch), lease and suggested heartbeat interval."""

    peer: dpb.Peer
    lease: float
    heartbeat_interval: float

    @property
    def peer_id(self) -> str:
        return str(self.peer.peer_id)

    @property
    def epoch(self) -> int:
        return int(self.peer.epoch)


class DirectoryClient:
    """Typed, deadline-bound calls to the directory at ``target`` (or over ``channel``)."""

    def __init__(
        self,
        target: str = "",
        *,
        channel: grpc.aio.Channel | None = None,
        timeout: float = 5.0,
        retries: int = 2,
        retry_backoff: float = 0.1,
    ) -> None:
        if channel is None and not target:
            raise ValueError("DirectoryClient needs a target or a channel")
        self._own_channel = channel is None
        if channel is None:
            channel = open_channel(target)
        self.channel = channel
        self.stub = dpb_grpc.DirectoryServiceStub(self.channel)
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff = retry_backoff

    async def close(self) -> None:
        """Closes the channel if this client created it."""
        if self._own_channel:
            await self.channel.close()

    async def __aenter__(self) -> DirectoryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: Callable[..., Awaitable[T]],
        request: Any,
        *,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> T:
        deadline = timeout or self.timeout
        return await retry_unavailable(
            lambda: method(request, timeout=deadline),
            attempts=1 + (self.retries if retries is None else retries),
            base_delay=self.retry_backoff,
            max_delay=_MAX_RETRY_BACKOFF,
        )

    # --- peers --------------------------------------------------------------------

    async def register_peer(self, request: dpb.RegisterPeerRequest, *, attempts: int = 5) -> Registration:
        """Registers (request id filled in when empty, reused by every retry of UNAVAILABLE)."""
        req = dpb.RegisterPeerRequest()
        req.CopyFrom(request)
        req.request_id = req.request_id or uuid.uuid4().hex
        resp: dpb.RegisterPeerResponse = await self._call(self.stub.RegisterPeer, req, retries=attempts - 1)
        return Registration(resp.peer, to_seconds(resp.lease), to_seconds(resp.heartbeat_interval))

    async def heartbeat(
        self, peer_id: str, epoch: int, load: dpb.PeerLoad | None = None
    ) -> dpb.HeartbeatResponse:
        """Renews the peer's lease; ``must_register`` in the answer means register again."""
        req = dpb.HeartbeatRequest(request_id=uuid.uuid4().hex, peer_id=peer_id, epoch=epoch, load=load)
        return await self._call(self.stub.Heartbeat, req, retries=0)

    async def unregister_peer(self, peer_id: str, epoch: int, *, request_id: str | None = None) -> int:
        """Removes the peer; returns how many of its live rooms were aborted."""
        req = dpb.UnregisterPeerRequest(request_id=_rid(request_id), peer_id=peer_id, epoch=epoch)
        resp: dpb.UnregisterPeerResponse = await self._call(self.stub.UnregisterPeer, req)
        return int(resp.rooms_aborted)

    async def list_peers(
        self,
        role: types_pb2.Role.ValueType = types_pb2.ROLE_UNSPECIFIED,
        contract_fingerprint: str = "",
        *,
        max_pages: int = 100,
    ) -> list[dpb.Peer]:
        """Every live peer matching the filters, following at most ``max_pages`` pages."""
        peers: list[dpb.Peer] = []
        token = ""
        for _ in range(max_pages):
            req = dpb.ListPeersRequest(
                page_size=_LIST_PAGE_SIZE,
                page_token=token,
                role=role,
                contract_fingerprint=contract_fingerprint,
            )
            resp: dpb.ListPeersResponse = await self._call(self.stub.ListPeers, req)
            peers.extend(resp.peers)
            token = resp.next_page_token
            if not token:
                break
        return peers

    # --- rooms --------------------------------------------------------------------

    async def publish_source(
        self,
        room_id: int,
        prefill: tuple[str, int],
        decode: tuple[str, int],
        source: dpb.SourceDescriptor,
        *,
        request_id: str | None = None,
    ) -> dpb.Room:
        """Prefill: the source pages are ready; opens the room for the (peer id, epoch) pair or adopts it.

        A room that already ended comes back as it ended (check ``state``): nobody will read the source.
        """
        req = dpb.PublishSourceRequest(
            request_id=_rid(request_id),
            room_id=room_id,
            prefill_peer_id=prefill[0],
            prefill_epoch=prefill[1],
            decode_peer_id=decode[0],
            decode_epoch=decode[1],
            source=source,
        )
        resp: dpb.PublishSourceResponse = await self._call(self.stub.PublishSource, req)
        return resp.room

    async def begin_transfer(
        self,
        room_id: int,
        prefill: tuple[str, int],
        decode: tuple[str, int],
        *,
        request_id: str | None = None,
        wait_for_source: float | None = None,
        source_endpoint_cached: bool = False,
    ) -> dpb.BeginTransferResponse:
        """Decode: the read starts (SOURCE_READY → TRANSFERRING).

        With ``wait_for_source`` (seconds) the room is opened for the pair when the prefill has not yet,
        and waited on, in the directory, until the prefill publishes or the room ends; an ended room
        comes back as it ended (check ``room.state``). The answer carries the prefill's transfer endpoint
        unless ``source_endpoint_cached``.
        """
        req = dpb.BeginTransferRequest(
            request_id=_rid(request_id),
            room_id=room_id,
            prefill_peer_id=prefill[0],
            prefill_epoch=prefill[1],
            decode_peer_id=decode[0],
            decode_epoch=decode[1],
            wait_for_source=wait_for_source is not None,
            source_endpoint_cached=source_endpoint_cached,
        )
        resp: dpb.BeginTransferResponse = await self._call(
            self.stub.BeginTransfer, req, timeout=wait_for_source
        )
        return resp

    async def complete_room(
        self,
        room_id: int,
        peer_id: str,
        epoch: int,
        *,
        bytes_transferred: int = 0,
        transfer_seconds: float = 0.0,
        request_id: str | None = None,
    ) -> dpb.Room:
        """Decode: every page arrived; the room ends COMPLETED."""
        req = dpb.CompleteRoomRequest(
            request_id=_rid(request_id),
            room_id=room_id,
            peer_id=peer_id,
            epoch=epoch,
            bytes_transferred=bytes_transferred,
            transfer_duration=to_duration(transfer_seconds),
        )
        resp: dpb.CompleteRoomResponse = await self._call(self.stub.CompleteRoom, req)
        return resp.room

    async def abort_room(
        self,
        room_id: int,
        cause: dpb.RoomEndCause.ValueType,
        detail: str = "",
        peer_id: str = "",
        epoch: int = 0,
        *,
        request_id: str | None = None,
    ) -> dpb.Room:
        """Ends a room (``peer_id`` empty: as the router); an id not yet opened is recorded as aborted."""
        req = dpb.AbortRoomRequest(
            request_id=_rid(request_id),
            room_id=room_id,
            cause=cause,
            detail=detail,
            peer_id=peer_id,
            epoch=epoch,
        )
        resp: dpb.AbortRoomResponse = await self._call(self.stub.AbortRoom, req)
        return resp.room

    async def get_room(self, room_id: int) -> dpb.Room:
        """The room's current state."""
        resp: dpb.GetRoomResponse = await self._call(self.stub.GetRoom, dpb.GetRoomRequest(room_id=room_id))
        return resp.room

    async def get_stats(self) -> dpb.GetDirectoryStatsResponse:
        """Room and peer counters."""
        return await self._call(self.stub.GetDirectoryStats, dpb.GetDirectoryStatsRequest())

    async def watch_peer_rooms(
        self, peer_id: str, epoch: int, *, timeout: float | None = None
    ) -> AsyncIterator[list[dpb.Room]]:
        """Yields batches of room changes for every room of the peer: first its live rooms, then changes."""
        req = dpb.WatchPeerRoomsRequest(peer_id=peer_id, epoch=epoch)
        call = self.stub.WatchPeerRooms(req, timeout=timeout)
        async for msg in _typed_stream(call):
            yield list(msg.rooms)


async def _typed_stream(call: Any) -> AsyncIterator[Any]:
    """The messages of a server stream; its errors as typed `XavierError`s; the call cancelled on exit."""
    try:
        async for msg in call:
            yield msg
    except grpc.aio.AioRpcError as rpc_err:
        raise from_rpc_error(rpc_err) from None
    finally:
        call.cancel()
