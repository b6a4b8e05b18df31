"""One per SGLang process: the NIXL agent over SGLang's buffers, the directory session, the pair's peers
and the routing of the pair protocol's notifications (`wire`) to rooms.

SGLang's scheduler is synchronous and polls. Nothing on a request's path leaves the process but NIXL
notifications and WRITEs: the directory is asked only about peers, once per peer epoch and about once a
second while rooms are live (to learn that a counterpart is gone), so its load grows with peers, not with
requests. The hub's event loop (a daemon thread) keeps the registration alive (`PeerSession`), answers
those peer questions, and reaps rooms SGLang cleared while a WRITE was still in flight. NIXL's own
progress thread (on by default, `XavierSettings.progress_thread`) moves the bytes; the scheduler's polls
call `pump()`, which reads the notifications that arrived at most once per `_PUMP_INTERVAL_S` however
many rooms are polled in one scheduler iteration.

Chunks go to a decode on this host through CUDA IPC when both pools are on GPUs and
`XavierSettings.cuda_ipc` is on: the decode's directory record carries its pool's IPC handles, the
prefill maps them once per decode epoch (`load_peer`) and `write` runs one fused copy per chunk
(`push`). A pool that cannot be shared or mapped leaves that pair on NIXL WRITEs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_core.contract import KvLayout
from xavier_core.directory import DirectoryClient, PeerSession
from xavier_core.directory.client import Registration
from xavier_core.runtime.channels import use_client_tls
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import TransferError
from xavier_core.transfer.common.peers import peer_key
from xavier_core.transfer.common.runs import as_page_array
from xavier_core.transfer.common.source import buffers_from_regions, endpoint_proto
from xavier_core.transfer.cuda.copy_plan import PoolView
from xavier_core.transfer.nixl.agent import NixlAgent
from xavier_core.transfer.port.transport import IpcPeers, export_blob, is_vram

from . import wire
from .config import PoolShape, XavierSettings
from .features import declare
from .loop import LoopThread
from .push import IpcNotifier, IpcWrite, Write

__all__ = ["Hub", "PairPeer", "RoomEnd"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_PUMP_INTERVAL_S = 0.0002
_WATCH_INTERVAL_S = 1.0
_REAP_INTERVAL_S = 0.02
_LOOKUP_RETRY_S = 0.5
_PENDING_JOINS = 4096
_JOINS_PER_ROOM = 4
_START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PairPeer:
    """The other side of this process's rooms, loaded once per epoch from its directory record."""

    peer_id: str
    epoch: int
    key: str
    """The NIXL peer key (`peer_key(peer_id, epoch)`)."""
    agent: str
    """Its NIXL agent name: notifications from it carry this name."""
    kv: tuple[KvBuffer, ...]
    view: PoolView | None = None
    """Its KV pool mapped here through CUDA IPC (a decode on this host), or None: NIXL WRITEs."""


class RoomEnd(Protocol):
    """What the hub calls on a room: a message of the room, its peer gone, a reap once SGLang cleared it."""

    def on_message(self, who: str, msg: wire.Message) -> None: ...

    def on_peer_lost(self, peer: PairPeer) -> None: ...

    def counterpart(self) -> PairPeer | None: ...

    def reap(self) -> bool: ...


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
        # Only the KV pool is registered: the aux slot (host memory) travels inside a notification.
        # No read-end agent: the prefill WRITEs and the decode posts no READ whose end it would tell.
        self.agent = NixlAgent(
            name,
            pool.kv,
            settings.progress_thread,
            transfer_timeout_s=settings.transfer_timeout_s,
            read_end_agent=False,
        )
        self._lock = threading.Lock()  # the tables below
        self._pump_lock = threading.Lock()
        self._last_pump = 0.0
        self._rooms: dict[int, RoomEnd] = {}
        self._parked: list[RoomEnd] = []
        # Joins that came before SGLang created the room's sender: room -> ({agent: JOIN}, arrival).
        self._pending: OrderedDict[int, tuple[dict[str, wire.Message], float]] = OrderedDict()
        # Rooms a decode cancelled before SGLang created their sender: a late sender fails at once.
        self._cancelled: OrderedDict[int, float] = OrderedDict()
        self._by_agent: dict[str, PairPeer] = {}
        self._lookup: concurrent.futures.Future[list[dpb.Peer]] | None = None
        self._lookup_lock = threading.Lock()
        self._looked_up = float("-inf")
        # FAILED messages owed to decodes not loaded yet: (agent, message).
        self._owed: list[tuple[str, bytes]] = []
        self.counters = {"dropped": 0, "rejected": 0, "ipc_writes": 0, "nixl_writes": 0}
        self._ipc: IpcPeers | None = None  # the prefill's CUDA IPC mappings of decodes' pools
        self._notifier: IpcNotifier | None = None
        self._ipc_lock = threading.Lock()
        self._ipc_blob = b""  # the decode's pool as CUDA IPC handles, in its directory record
        if settings.cuda_ipc and is_vram(pool.kv):
            self._init_ipc()
        self._closed = False
        self._loop = LoopThread("xavier-sglang")
        try:
            self.submit(self._start()).result(_START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _init_ipc(self) -> None:
        """A decode exports its pool; a prefill gets ready to map decodes' pools (compiling the copy
        kernel now, not inside the first request). Either failing leaves NIXL WRITEs."""
        try:
            if self.role == types_pb2.ROLE_DECODE:
                self._ipc_blob = export_blob(self.pool.kv)
            else:
                ipc = IpcPeers(self.pool.kv)
                ipc.warm_up()
                self._ipc, self._notifier = ipc, IpcNotifier()
        except (TransferError, ImportError, RuntimeError, TimeoutError) as exc:
            log.info("CUDA IPC unavailable, KV moves by NIXL WRITEs: %s", exc)

    # --- the synchronous face -------------------------------------------------------------

    @property
    def peer(self) -> tuple[str, int]:
        """(peer id, epoch) of the current registration (the session's, renewed on every re-registration)."""
        reg = self.session.registration
        return reg.peer_id, reg.epoch

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Runs `coro` on the hub's loop; the caller polls the future."""
        return self._loop.submit(coro)

    def load_peer(self, peer: dpb.Peer) -> PairPeer:
        """Loads a counterpart's NIXL agent from its directory record (once per epoch); `TransferError`
        for a record whose endpoint this process cannot use."""
        key = peer_key(peer.peer_id, int(peer.epoch))
        with self._lock:
            known = self._by_agent.get(peer.endpoint.agent_name)
            if known is not None and known.key == key:
                return known
        endpoint = peer.endpoint
        kv = buffers_from_regions(endpoint.regions, "endpoint.regions")
        agent = self.agent.add_peer(key, endpoint.agent_metadata)
        view = None
        if self._ipc is not None and endpoint.cuda_ipc_pool:
            with self._ipc_lock:
                view = self._ipc.view(str(peer.peer_id), int(peer.epoch), endpoint.cuda_ipc_pool)
        loaded = PairPeer(str(peer.peer_id), int(peer.epoch), key, agent, kv, view)
        with self._lock:
            self._by_agent[agent] = loaded
        return loaded

    def decode_peer(self, agent: str) -> PairPeer | None:
        """The registered decode whose NIXL agent is `agent` (the sender of a JOIN), or None while it is
        not known yet: the first call for an unknown agent asks the directory (once per retry interval)."""
        with self._lock:
            peer = self._by_agent.get(agent)
        if peer is not None:
            return peer
        with self._lookup_lock:
            fut = self._lookup
            if fut is not None and fut.done():
                self._lookup = None
                if fut.exception() is None:
                    for p in fut.result():
                        if p.endpoint.agent_name and p.contract_fingerprint == self.fingerprint:
                            with contextlib.suppress(TransferError):
                                self.load_peer(p)
                with self._lock:
                    peer = self._by_agent.get(agent)
                if peer is not None:
                    return peer
            now = time.monotonic()
            if self._lookup is None and now - self._looked_up >= _LOOKUP_RETRY_S:
                self._looked_up = now
                self._lookup = self.submit(self.client.list_peers(types_pb2.ROLE_DECODE))
        return None

    def forget_peer(self, peer: PairPeer) -> None:
        """Drops a counterpart whose epoch ended (its NIXL agent is unloaded)."""
        with self._lock:
            if self._by_agent.get(peer.agent) == peer:
                del self._by_agent[peer.agent]
        self.agent.drop_peer(peer.key)
        if self._ipc is not None and peer.view is not None:
            with self._ipc_lock:
                self._ipc.drop(peer.peer_id, peer.epoch)

    def write(
        self, peer: PairPeer, src: npt.NDArray[np.integer], dst: npt.NDArray[np.integer], note: bytes
    ) -> Write:
        """WRITEs local pages `src[i]` into the peer's `dst[i]`, every KV buffer; `note` reaches the
        peer after the bytes. Through CUDA IPC when the peer's pool is mapped here, else NIXL.
        `InvalidPagesError`/`LayoutError` for pages or pools that do not line up, `TransferError` when
        the copy cannot be issued."""
        src_pages, dst_pages = as_page_array(src), as_page_array(dst)
        if peer.view is None or self._ipc is None or self._notifier is None:
            self.counters["nixl_writes"] += 1
            return self.agent.write(peer.key, peer.kv, src_pages, dst_pages, note)
        with self._ipc_lock:
            if self._ipc.mapped(peer.peer_id) != peer.epoch:
                # The decode registered again and its new epoch is mapped: this room's pool is gone.
                raise TransferError(f"decode {peer.key} is no longer mapped (it registered again)")
            try:
                copy = self._ipc.push(peer.peer_id, peer.view, src_pages, dst_pages)
            except RuntimeError as exc:  # CUDA or Triton refused the launch
                raise TransferError(f"CUDA IPC copy to {peer.key} failed: {exc}") from exc
        self.counters["ipc_writes"] += 1
        return self._notifier.submit(IpcWrite(copy, lambda: self.send(peer, note)))

    def read_aux_slot(self, slot: int) -> bytes:
        """The bytes of one aux slot, buffer after buffer (host memory: SGLang's metadata buffers)."""
        return b"".join(
            ctypes.string_at(b.addr + _slot_offset(b, slot), b.bytes_per_page) for b in self.pool.aux
        )

    def write_aux_slot(self, slot: int, data: bytes) -> None:
        """Copies a peer's aux slot (as its `read_aux_slot` gave it) into one of ours; `ValueError` for a
        slot outside the buffers or bytes of another geometry."""
        want = sum(b.bytes_per_page for b in self.pool.aux)
        if len(data) != want:
            raise ValueError(f"{len(data)} bytes for a slot of {want}")
        offsets = [_slot_offset(b, slot) for b in self.pool.aux]  # all checked before any byte moves
        at = 0
        for b, off in zip(self.pool.aux, offsets, strict=True):
            ctypes.memmove(b.addr + off, data[at : at + b.bytes_per_page], b.bytes_per_page)
            at += b.bytes_per_page

    def add_room(self, room_id: int, room: RoomEnd) -> bool:
        """Routes the room's notifications to `room`; False if another live room has the id."""
        with self._lock:
            if room_id in self._rooms:
                return False
            self._rooms[room_id] = room
            return True

    def remove_room(self, room_id: int, room: RoomEnd) -> None:
        with self._lock:
            if self._rooms.get(room_id) is room:
                del self._rooms[room_id]

    def park(self, room: RoomEnd) -> None:
        """Keeps a room SGLang cleared while a transfer of it may still be in flight, until `reap()`."""
        with self._lock:
            self._parked.append(room)

    def cancelled(self, room_id: int) -> bool:
        """Whether the room's decode cancelled it before SGLang created the room's sender."""
        with self._lock:
            return room_id in self._cancelled

    def take_joins(self, room_id: int) -> dict[str, wire.Message]:
        """The JOINs that arrived before SGLang created the room's sender (the decode was first), by
        the NIXL agent that sent each (only a registered decode's will be used)."""
        with self._lock:
            got = self._pending.pop(room_id, None)
        return {} if got is None else got[0]

    def send(self, peer: PairPeer, msg: bytes) -> bool:
        """A notification to `peer`; False if NIXL could not send it (the peer is gone)."""
        try:
            self.agent.send_notif(peer.key, msg)
        except TransferError as exc:
            log.info("notification to %s not sent: %s", peer.key, exc)
            return False
        return True

    def pump(self, *, force: bool = False) -> None:
        """Routes the notifications that arrived to their rooms. Called by every poll, it reads NIXL at
        most once per `_PUMP_INTERVAL_S`; callers hold no room lock (handlers take the room's)."""
        now = time.monotonic()
        if not force and now - self._last_pump < _PUMP_INTERVAL_S:
            return
        if not self._pump_lock.acquire(blocking=False):
            return  # another thread is routing right now
        try:
            self._last_pump = now
            for who, raw in self.agent.notifications():
                msg = wire.parse(raw)
                if msg is None:
                    self.counters["dropped"] += 1
                    continue
                self._route(who, msg, now)
            if self._owed:
                self._pay_owed()
        finally:
            self._pump_lock.release()

    def _route(self, who: str, msg: wire.Message, now: float) -> None:
        with self._lock:
            room = self._rooms.get(msg.room)
            if room is None and msg.kind == wire.Kind.JOIN:
                # The decode was first: the prefill's sender for this room does not exist yet.
                joins, _ = self._pending.setdefault(msg.room, ({}, now))
                if len(joins) < _JOINS_PER_ROOM:
                    joins.setdefault(who, msg)
                limit = now - self.settings.bootstrap_timeout_s
                while self._pending and (
                    len(self._pending) > _PENDING_JOINS or next(iter(self._pending.values()))[1] < limit
                ):
                    self._pending.popitem(last=False)
                return
            if room is None and msg.kind == wire.Kind.CANCEL:
                pending = self._pending.get(msg.room)
                join = pending[0].get(who) if pending is not None else None
                if pending is not None and join is not None and join.token == msg.token:
                    del pending[0][who]
                    if not pending[0]:
                        del self._pending[msg.room]
                    self._cancelled[msg.room] = now
                    while len(self._cancelled) > _PENDING_JOINS:
                        self._cancelled.popitem(last=False)
        if room is not None:
            room.on_message(who, msg)
        elif msg.kind == wire.Kind.CANCEL and self.role == types_pb2.ROLE_PREFILL:
            # No room here (never created, or done and cleared): nothing of ours is in flight for it,
            # so the decode may reuse its pages.
            self.tell_failed(
                who, wire.failed(msg.room, msg.token, "ROOM_END_CAUSE_DECODE_FAILED", "cancelled")
            )
        else:
            self.counters["dropped"] += 1

    def tell_failed(self, agent: str, msg: bytes) -> None:
        """Sends a FAILED to the decode behind `agent` now, or once it is loaded (it was not yet)."""
        peer = self.decode_peer(agent)
        if peer is not None:
            self.send(peer, msg)
        elif len(self._owed) < _PENDING_JOINS:
            self._owed.append((agent, msg))

    def _pay_owed(self) -> None:
        owed, self._owed = self._owed, []
        for agent, msg in owed:
            self.tell_failed(agent, msg)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "rooms": len(self._rooms),
                "parked": len(self._parked),
                "pending_joins": len(self._pending),
                "cancelled": len(self._cancelled),
                "peers": len(self._by_agent),
                "live_transfers": self.agent.live_transfers(),
                **self.counters,
            }

    def close(self) -> None:
        """Unregisters, stops the loop and releases NIXL (every transfer cancelled). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop.running:
            with contextlib.suppress(Exception):
                self.submit(self._stop()).result(10.0)
            self._loop.stop()
        if self._notifier is not None:
            self._notifier.close()
        if self._ipc is not None:
            with self._ipc_lock:
                self._ipc.close()  # waits for copies still running, then unmaps
        self.agent.close()

    # --- the loop side --------------------------------------------------------------------

    async def _start(self) -> Registration:
        if self.settings.tls is not None:
            use_client_tls(self.settings.tls)  # this process dials the directory with its service's identity
        self.client = DirectoryClient(self.settings.directory)
        endpoint = endpoint_proto(self.agent.name, self.agent.metadata(), self.pool.kv)
        endpoint.cuda_ipc_pool = self._ipc_blob
        request = dpb.RegisterPeerRequest(
            peer_id=self.settings.peer_id,
            role=self.role,
            address=self.settings.advertise,
            layout=declare(self.layout.to_proto(), self.role, self.settings.call_sessions),
            endpoint=endpoint,
        )
        self.session = PeerSession(self.client, request)
        registration = await self.session.start()
        self._tasks = [
            asyncio.create_task(self._watch(), name="xavier-sglang-watch"),
            asyncio.create_task(self._reap(), name="xavier-sglang-reap"),
        ]
        return registration

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.session.stop()
        await self.client.close()

    async def _watch(self) -> None:
        """About once a second while rooms are live: rooms whose counterpart's epoch left the directory
        end (a dead peer writes nothing, and will never answer). A directory that does not answer ends
        nothing: a blip of the control plane is not a failed transfer."""
        other = types_pb2.ROLE_DECODE if self.role == types_pb2.ROLE_PREFILL else types_pb2.ROLE_PREFILL
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            with self._lock:
                rooms = list(self._rooms.values()) + list(self._parked)
            peers = {p for p in (r.counterpart() for r in rooms) if p is not None}
            if not peers:
                continue
            try:
                live = {(p.peer_id, int(p.epoch)) for p in await self.client.list_peers(other)}
            except Exception as exc:  # the directory is down or slow: try again next time
                log.debug("peer watch: %s", exc)
                continue
            for lost in [p for p in peers if (p.peer_id, p.epoch) not in live]:
                log.info("peer %s left the directory: its rooms end", lost.key)
                for room in rooms:
                    if room.counterpart() == lost:
                        room.on_peer_lost(lost)
                self.forget_peer(lost)

    async def _reap(self) -> None:
        """Every `_REAP_INTERVAL_S`: notifications that came while SGLang polls no room (a JOIN before
        the request, a CANCEL of a room never seen) are routed, and parked rooms that may end, end."""
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            self.pump()
            if self._ipc is not None:
                with self._ipc_lock:
                    self._ipc.collect()  # unmaps retired decodes' pools once their copies are done
            with self._lock:
                parked = list(self._parked)
            if not parked:
                continue
            done = [r for r in parked if r.reap()]
            if done:
                with self._lock:
                    self._parked = [r for r in self._parked if r not in done]
                    for room_id in [k for k, v in self._rooms.items() if v in done]:
                        del self._rooms[room_id]


def _slot_offset(buffer: KvBuffer, slot: int) -> int:
    if not 0 <= slot < buffer.num_pages:
        raise ValueError(f"aux slot {slot} is outside the {buffer.num_pages} slots")
    return slot * buffer.bytes_per_page
