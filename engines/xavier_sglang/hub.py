"""One per SGLang process: the NIXL agent over SGLang's buffers, the directory session, and the room feed.

SGLang's scheduler is synchronous and polls; Xavier's directory client is asyncio. The hub runs one
event loop in a daemon thread and hands the synchronous side futures (`submit`), so no scheduler call
ever blocks on the network. The loop also:

- keeps the process registered (`PeerSession`: register, heartbeat, re-register with a new epoch);
- follows this peer's rooms with a `RoomFeed` (one `WatchPeerRooms` stream) into `room()`, so a sender
  learns that its decode joined, that the room completed, or that it ended, without one RPC per poll;
- drives NIXL progress (`KvManager.progress`) every few milliseconds while a source is published, since
  agents run without NIXL's spinning progress thread;
- reclaims, once their READs have ended, receivers that SGLang already cleared (deferred reclamation).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, TypeVar

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.contract import KvLayout
from xavier_core.directory import DirectoryClient, PeerSession
from xavier_core.directory.client import Registration
from xavier_core.directory.room_feed import RoomFeed
from xavier_core.transfer.aux_slots import AuxNixlAgent
from xavier_core.transfer.kv_transfer import KvManager, KvReceiver
from xavier_core.transfer.source import endpoint_proto, regions_proto

from .config import PoolShape, XavierSettings
from .loop import LoopThread

__all__ = ["Hub"]

T = TypeVar("T")

_PROGRESS_INTERVAL_S = 0.002
_IDLE_INTERVAL_S = 0.02
_ENDPOINTS = 256
_START_TIMEOUT_S = 30.0


class Hub:
    """The process-wide Xavier state behind SGLang's KV manager (see the module docstring)."""

    def __init__(
        self,
        role: types_pb2.Role.ValueType,
        pool: PoolShape,
        layout: KvLayout,
        settings: XavierSettings,
        *,
        agent_name: str | None = None,
    ) -> None:
        self.role = role
        self.pool = pool
        self.page_bytes = sum(b.bytes_per_page for b in pool.kv)  # one page across every KV buffer
        self.layout = layout
        self.fingerprint = layout.fingerprint
        self.settings = settings
        name = agent_name or f"xavier-sglang-{uuid.uuid4().hex[:12]}"
        self.agent = AuxNixlAgent(name, pool.kv, pool.aux, transfer_timeout_s=settings.transfer_timeout_s)
        self.kv = KvManager(self.agent, pool.kv, pool.page_size)
        self._lock = threading.Lock()
        self._endpoints: OrderedDict[tuple[str, int], types_pb2.TransferEndpoint] = OrderedDict()
        self._parked: list[KvReceiver] = []
        self._publishing = 0
        self._closed = False
        self._loop = LoopThread("xavier-sglang")
        try:
            self.submit(self._start()).result(_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    # --- the synchronous face -------------------------------------------------------------

    @property
    def peer(self) -> tuple[str, int]:
        """(peer id, epoch) of the current registration (the session's, renewed on every re-registration)."""
        reg = self.session.registration
        return reg.peer_id, reg.epoch

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Runs `coro` on the hub's loop; the caller polls the future."""
        return self._loop.submit(coro)

    def room(self, room_id: int) -> dpb.Room | None:
        """The latest view of one of this peer's rooms (from the feed), or None if none was seen."""
        return self.rooms.latest(room_id)

    def submit_room(self, coro: Coroutine[Any, Any, dpb.Room]) -> concurrent.futures.Future[dpb.Room]:
        """Runs an RPC that answers with a room; the answer is in `room()` once the future is done (the
        feed's stream may lag behind it, and never carries a room that ended before anyone opened it)."""

        async def noted() -> dpb.Room:
            room = await coro
            self.rooms.apply(room)
            return room

        return self.submit(noted())

    def forget_room(self, room_id: int) -> None:
        self._loop.loop.call_soon_threadsafe(self.rooms.forget, room_id)

    def endpoint(self, prefill: tuple[str, int]) -> types_pb2.TransferEndpoint | None:
        with self._lock:
            return self._endpoints.get(prefill)

    def cache_endpoint(self, prefill: tuple[str, int], endpoint: types_pb2.TransferEndpoint) -> None:
        with self._lock:
            self._endpoints[prefill] = endpoint
            while len(self._endpoints) > _ENDPOINTS:
                self._endpoints.popitem(last=False)

    def forget_endpoint(self, prefill: tuple[str, int]) -> None:
        with self._lock:
            self._endpoints.pop(prefill, None)

    def publishing(self, delta: int) -> None:
        """Counts published sources: NIXL progress runs fast only while there is one."""
        with self._lock:
            self._publishing += delta

    def park(self, receiver: KvReceiver) -> None:
        """Keeps a receiver whose READ may still write its pages until the READ ends, then forgets it."""
        with self._lock:
            self._parked.append(receiver)

    def parked(self) -> int:
        with self._lock:
            return len(self._parked)

    def close(self) -> None:
        """Unregisters, stops the loop and releases NIXL (every READ cancelled). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop.running:
            with contextlib.suppress(Exception):
                self.submit(self._stop()).result(10.0)
            self._loop.stop()
        self.agent.close()

    # --- the loop side --------------------------------------------------------------------

    async def _start(self) -> Registration:
        self.client = DirectoryClient(self.settings.directory)
        endpoint = endpoint_proto(self.agent.name, self.agent.metadata(), self.pool.kv)
        endpoint.aux_regions.extend(regions_proto(self.pool.aux))
        request = dpb.RegisterPeerRequest(
            peer_id=self.settings.peer_id,
            role=self.role,
            address=self.settings.advertise,
            layout=self.layout.to_proto(),
            endpoint=endpoint,
        )
        self.session = PeerSession(self.client, request)
        registration = await self.session.start()
        self.rooms = RoomFeed(self.client, lambda: self.peer)
        self.rooms.start()
        self._tasks = [asyncio.create_task(self._progress(), name="xavier-sglang-progress")]
        return registration

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.rooms.stop()
        await self.session.stop()
        await self.client.close()

    async def _progress(self) -> None:
        while True:
            with self._lock:
                busy = self._publishing > 0 or bool(self._parked)
                parked = list(self._parked)
            if busy:
                self.kv.progress()
                done = [r for r in parked if not r.in_flight()]
                for receiver in done:
                    receiver.clear()
                if done:
                    with self._lock:
                        self._parked = [r for r in self._parked if r not in done]
            await asyncio.sleep(_PROGRESS_INTERVAL_S if busy else _IDLE_INTERVAL_S)
