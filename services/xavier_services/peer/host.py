"""PeerHost: the engine, its KV contract, its NIXL port and its membership in the directory.

Shared by the prefill, decode and unified services. Registration gets an epoch; heartbeats renew the lease
and re-register (new epoch) when the directory lost us, e.g. after a directory restart (invariant I6).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc, types_pb2

from xavier_core.contract import KvLayout, layout_from_model_dir
from xavier_core.engine.api import Engine
from xavier_core.runtime.errors import (
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    XavierError,
    from_rpc_error,
)
from xavier_core.runtime.logging import get_logger
from xavier_services.peer.config import PeerServiceConfig
from xavier_services.peer.kv_port import KvPort

log = get_logger(__name__)

ROLE_NAMES = {
    types_pb2.ROLE_PREFILL: "prefill",
    types_pb2.ROLE_DECODE: "decode",
    types_pb2.ROLE_UNIFIED: "unified",
}


def _version() -> str:
    try:
        return importlib.metadata.version("xavier")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def load_engine(config: PeerServiceConfig) -> Any:
    """Loads the reference engine named by the config (blocking; call off the event loop)."""
    from xavier_core.engine.reference import ReferenceEngine

    e = config.engine
    if e.model is None:
        raise InvalidArgument(
            "engine.model is required (a local Hugging Face checkpoint directory)", key="engine.model"
        )
    return ReferenceEngine.load(
        e.model,
        device=e.device,
        dtype=e.dtype,
        page_size=e.page_size,
        num_pages=e.num_pages,
        max_running=e.max_running,
        chunk_tokens=e.chunk_tokens,
    )


class PeerHost:
    """Everything a prefill/decode/unified servicer needs besides its own request logic."""

    def __init__(self, config: PeerServiceConfig, role: types_pb2.Role.ValueType, engine: Any) -> None:
        self.config = config
        self.role = role
        self.engine: Engine = engine
        self.vocab_size: int = engine.config.vocab_size
        e = config.engine
        assert e.model is not None
        self.layout: KvLayout = layout_from_model_dir(
            e.model,
            engine="reference",
            engine_version=_version(),
            dtype=engine.dtype_name,
            page_size=engine.page_size,
        )
        self.fingerprint = self.layout.fingerprint
        self.host_id = socket.gethostname()
        self.peer_id = config.peer.peer_id
        self.epoch = 0
        self.address = ""
        self.kv: KvPort | None = None  # type: ignore[assignment]
        self._channel: grpc.aio.Channel | None = None
        self._stub: directory_service_pb2_grpc.DirectoryServiceStub | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._registered = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self, port: int) -> dict[str, Any]:
        cfg = self.config
        self.address = f"{cfg.peer.advertise_host}:{port}"
        if not self.peer_id:
            self.peer_id = f"{ROLE_NAMES[self.role]}-{self.host_id}-{port}"
        if self.role in (types_pb2.ROLE_PREFILL, types_pb2.ROLE_DECODE):
            name = f"{self.peer_id}-{uuid.uuid4().hex[:8]}"
            self.kv = KvPort(
                name,
                self.engine.kv_buffers(),
                self.engine.page_size,
                cfg.handoff.poll_interval_seconds,
                cfg.handoff.transfer_mode,
            )
        self._channel = grpc.aio.insecure_channel(cfg.peer.directory)
        self._stub = directory_service_pb2_grpc.DirectoryServiceStub(self._channel)
        await self._register()
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        return {"peer_id": self.peer_id, "epoch": self.epoch, "fingerprint": self.fingerprint}

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        with contextlib.suppress(Exception):
            await self.directory_call(
                "UnregisterPeer",
                dpb.UnregisterPeerRequest(
                    request_id=uuid.uuid4().hex, peer_id=self.peer_id, epoch=self.epoch
                ),
            )
        if self._channel is not None:
            await self._channel.close()
        if self.kv is not None:
            await self.kv.close()
        await self.engine.close()

    async def _register(self) -> None:
        req = dpb.RegisterPeerRequest(
            request_id=uuid.uuid4().hex,
            peer_id=self.peer_id,
            role=self.role,
            address=self.address,
            layout=self.layout.to_proto(),
        )
        if self.kv is not None:
            req.endpoint.CopyFrom(self.kv.endpoint(self.host_id))
        resp = await self.directory_call("RegisterPeer", req, retries=20)
        self.epoch = resp.peer.epoch
        self._hb_interval = max(0.05, resp.heartbeat_interval.ToTimedelta().total_seconds() or 1.0)
        log.info("registered", peer_id=self.peer_id, epoch=self.epoch)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._hb_interval)
            try:
                resp = await self.directory_call(
                    "Heartbeat",
                    dpb.HeartbeatRequest(peer_id=self.peer_id, epoch=self.epoch, load=self.load()),
                )
                if resp.must_register:
                    await self._register()
            except XavierError as err:
                if err.reason in ("PEER_NOT_FOUND", "STALE_EPOCH", "NOT_FOUND"):
                    with contextlib.suppress(XavierError):
                        await self._register()
                else:
                    log.warning("heartbeat failed", error=str(err))

    def load(self) -> dpb.PeerLoad:
        s = self.engine.stats()
        return dpb.PeerLoad(
            outstanding_requests=s.running + s.waiting, pages_free=s.pages_free, pages_total=s.pages_total
        )

    # -- directory calls ------------------------------------------------------------------------------------

    async def directory_call(self, method: str, request: Any, *, retries: int = 0) -> Any:
        """One directory RPC with the configured deadline; retries only UNAVAILABLE, bounded (I7)."""
        if self._stub is None:
            raise Unavailable("not connected to the directory", reason="DIRECTORY_UNAVAILABLE")
        fn = getattr(self._stub, method)
        for attempt in range(retries + 1):
            try:
                return await fn(request, timeout=self.config.peer.rpc_timeout_seconds)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE and attempt < retries:
                    await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
                    continue
                raise from_rpc_error(err) from None
        raise Unavailable("directory unavailable", reason="DIRECTORY_UNAVAILABLE")

    async def watch_room(self, room_id: int, timeout: float) -> AsyncIterator[dpb.Room]:
        """Streams a room's states (server stream, no polling) until a terminal state or `timeout`."""
        assert self._stub is not None
        call = self._stub.WatchRoom(dpb.WatchRoomRequest(room_id=room_id), timeout=timeout)
        try:
            async for msg in call:
                yield msg.room
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def wait_room_message(self, room_id: int, states: Sequence[int], timeout: float) -> dpb.Room:
        """Watches a room until it reaches one of `states`."""
        async for room in self.watch_room(room_id, timeout):
            if room.state in states:
                return room
        raise FailedPrecondition(f"room {room_id} watch ended early", reason="WATCH_ENDED")

    async def wait_room(self, room_id: int, states: Sequence[int], timeout: float) -> int:
        return (await self.wait_room_message(room_id, states, timeout)).state

    async def abort_room(self, room_id: int, reason: str) -> None:
        with contextlib.suppress(XavierError):
            await self.directory_call(
                "AbortRoom",
                dpb.AbortRoomRequest(
                    request_id=f"abort-{room_id}-{self.peer_id}",
                    room_id=room_id,
                    reason=reason,
                    peer_id=self.peer_id,
                    epoch=self.epoch,
                ),
            )

    async def release_room(self, room_id: int, role: types_pb2.Role.ValueType) -> None:
        with contextlib.suppress(XavierError):
            await self.directory_call(
                "ReleaseRoom",
                dpb.ReleaseRoomRequest(
                    request_id=f"release-{room_id}-{role}",
                    room_id=room_id,
                    role=role,
                    peer_id=self.peer_id,
                    epoch=self.epoch,
                ),
            )

    def engine_stats_pb(self, pages_parked: int) -> types_pb2.EngineStats:
        s = self.engine.stats()
        return types_pb2.EngineStats(
            pages_total=s.pages_total,
            pages_free=s.pages_free,
            pages_pinned=s.pages_pinned,
            pages_parked=pages_parked,
            running=s.running,
            waiting=s.waiting,
            prompt_tokens_computed=s.prompt_tokens_computed,
            prompt_tokens_cached=s.prompt_tokens_cached,
        )
