"""Async client of ``xavier.v1.DirectoryService`` for peers and the router.

:class:`DirectoryClient` wraps each RPC with a deadline, bounded retries of UNAVAILABLE (mutating calls
carry a request id, so a retry is idempotent) and typed errors (``from_rpc_error``).
:class:`PeerSession` keeps one peer registered: it registers with retry, heartbeats, and registers again
(new epoch) when the directory says ``must_register`` or no longer knows the peer, e.g. after a directory
restart. The channel reconnects quickly (backoff capped at one second) so that happens within about one
heartbeat interval of the directory coming back.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import types_pb2

from xavier_core.runtime.errors import NotFound, Unavailable, XavierError, from_rpc_error
from xavier_core.runtime.logging import get_logger

__all__ = [
    "CHANNEL_OPTIONS",
    "TERMINAL_ROOM_STATES",
    "DirectoryClient",
    "PeerSession",
    "Registration",
    "register_all",
]

T = TypeVar("T")
_log = get_logger("xavier.directory_client")

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Reconnect fast: a restarted directory must see its peers again within one heartbeat interval."""

TERMINAL_ROOM_STATES = frozenset({dpb.ROOM_STATE_COMPLETED, dpb.ROOM_STATE_ABORTED, dpb.ROOM_STATE_EXPIRED})


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))


def _seconds(msg: duration_pb2.Duration) -> float:
    return msg.seconds + msg.nanos / 1e9


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
        watch_timeout: float = 600.0,
    ) -> None:
        if channel is None and not target:
            raise ValueError("DirectoryClient needs a target or a channel")
        self._own_channel = channel is None
        if channel is None:
            channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.channel = channel
        self.stub = dpb_grpc.DirectoryServiceStub(self.channel)
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff = retry_backoff
        self.watch_timeout = watch_timeout

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
        attempts = 1 + (self.retries if retries is None else retries)
        delay = self.retry_backoff
        for attempt in range(attempts):
            try:
                return await method(request, timeout=timeout or self.timeout)
            except grpc.aio.AioRpcError as rpc_err:
                err = from_rpc_error(rpc_err)
            if not isinstance(err, Unavailable) or attempt + 1 == attempts:
                raise err
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")  # the loop always returns or raises

    # --- peers --------------------------------------------------------------------

    async def register_peer(self, request: dpb.RegisterPeerRequest, *, attempts: int = 5) -> Registration:
        """Registers (request id filled in when empty, reused by every retry of UNAVAILABLE)."""
        req = dpb.RegisterPeerRequest()
        req.CopyFrom(request)
        req.request_id = req.request_id or uuid.uuid4().hex
        resp: dpb.RegisterPeerResponse = await self._call(self.stub.RegisterPeer, req, retries=attempts - 1)
        return Registration(resp.peer, _seconds(resp.lease), _seconds(resp.heartbeat_interval))

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
            transfer_duration=_duration(transfer_seconds),
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


OnRegistered = Callable[[Registration], Awaitable[None] | None]


class PeerSession:
    """Keeps one peer registered with the directory.

    ``start()`` registers (retrying UNAVAILABLE, bounded) and starts the heartbeat loop. Each heartbeat
    reports ``load()``; when the directory answers ``must_register`` or NOT_FOUND (it restarted, or the
    peer's lease lapsed), the session registers again and gets a new epoch; ``on_registered`` runs after
    every registration so the service can drop work tied to the old epoch. A heartbeat that fails with
    UNAVAILABLE is simply tried again at the next tick. STALE_EPOCH (another process registered the same
    peer id) is logged and not fought over.
    """

    def __init__(
        self,
        client: DirectoryClient,
        request: dpb.RegisterPeerRequest,
        *,
        load: Callable[[], dpb.PeerLoad] | None = None,
        on_registered: OnRegistered | None = None,
        heartbeat_interval: float | None = None,
        register_attempts: int = 5,
    ) -> None:
        self.client = client
        self._template = dpb.RegisterPeerRequest()
        self._template.CopyFrom(request)
        self._template.request_id = ""
        self._load = load
        self._on_registered = on_registered
        self._interval_override = heartbeat_interval
        self._attempts = register_attempts
        self._registration: Registration | None = None
        self._registered = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self.registrations = 0
        """How many times this session registered (1 after ``start``; more after re-registrations)."""

    @property
    def registration(self) -> Registration:
        """The current registration (``start`` must have returned)."""
        if self._registration is None:
            raise RuntimeError("PeerSession is not registered; call start() first")
        return self._registration

    @property
    def interval(self) -> float:
        """Seconds between heartbeats."""
        if self._interval_override is not None:
            return self._interval_override
        return self._registration.heartbeat_interval if self._registration is not None else 1.0

    async def start(self) -> Registration:
        """Registers and starts heartbeating; returns the registration."""
        registration = await self._register()
        self._task = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{registration.peer_id}")
        return registration

    async def stop(self, *, unregister: bool = True) -> None:
        """Stops heartbeating and (by default) unregisters, best effort."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if unregister and self._registration is not None:
            with contextlib.suppress(XavierError):
                reg = self._registration
                await self.client.unregister_peer(reg.peer_id, reg.epoch)

    async def wait_registered(self, newer_than: int = 0, *, timeout: float) -> Registration:
        """The first registration with an epoch above ``newer_than``; TimeoutError after ``timeout``."""

        def ready() -> bool:
            return self._registration is not None and self._registration.epoch > newer_than

        async with asyncio.timeout(timeout), self._registered:
            await self._registered.wait_for(ready)
        return self.registration

    async def _register(self) -> Registration:
        req = dpb.RegisterPeerRequest()
        req.CopyFrom(self._template)
        if self._registration is not None:
            req.peer_id = self._registration.peer_id  # keep a directory-assigned id across re-registrations
        registration = await self.client.register_peer(req, attempts=self._attempts)
        self._registration = registration
        self.registrations += 1
        _log.info("registered", peer_id=registration.peer_id, epoch=registration.epoch)
        if self._on_registered is not None:
            result = self._on_registered(registration)
            if inspect.isawaitable(result):
                await result
        async with self._registered:
            self._registered.notify_all()
        return registration

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            reg = self.registration
            try:
                load = self._load() if self._load is not None else None
                resp = await self.client.heartbeat(reg.peer_id, reg.epoch, load)
                if resp.must_register:
                    await self._try_register()
            except NotFound:
                await self._try_register()
            except XavierError as err:
                if err.reason == "STALE_EPOCH":
                    _log.error("peer id registered elsewhere", peer_id=reg.peer_id, epoch=reg.epoch)
                else:
                    _log.debug("heartbeat failed", peer_id=reg.peer_id, reason=err.reason)

    async def _try_register(self) -> None:
        with contextlib.suppress(XavierError):
            await self._register()


async def register_all(sessions: Sequence[PeerSession]) -> list[Registration]:
    """Starts several sessions concurrently (tests and ``xavier up`` start a mesh at once)."""
    return list(await asyncio.gather(*(s.start() for s in sessions)))
