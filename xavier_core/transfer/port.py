"""The data plane as a service drives it (a prefill publishes a room's pages, a decode pulls them),
over the transfer layer's KV manager and one NIXL agent per process.

All NIXL calls of a process run on one dedicated thread (`NixlThread`): the agent is not shared across
threads, and no NIXL call ever blocks the asyncio loop. While any source is published or any read is live,
that thread also polls NIXL between calls, every `poll_interval`: notifications (which also drive progress
without a busy-spinning progress thread), the state of each published source and of each live read. It
hands results to the asyncio loop only when something ended, so a poll costs the loop nothing.

The port knows buffers (addresses, lengths, bytes per page, a device string), page ids and peer keys;
it speaks the contract's `SourceDescriptor` / `TransferEndpoint` on the wire, never an engine.

Transports (see `transport`): a VRAM port exports its pool through CUDA IPC in its endpoint; a reader on
the same host copies from the mapped pool with one fused kernel, issued and polled on the NIXL thread
like a READ, and tells the source the read ended (the NIXL notification a READ would carry) only once
the copy's CUDA event has completed, so the source's pages stay pinned until then (I1).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from xavier.v1 import directory_service_pb2, types_pb2

from xavier_core.runtime.errors import FailedPrecondition, LayoutMismatch, Unavailable
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer.buffers import KvBuffer
from xavier_core.transfer.errors import InvalidSourceError, TransferError
from xavier_core.transfer.kv_transfer import KvManager, KvPoll, KvReceiver, KvSender, done_notif, fail_notif
from xavier_core.transfer.nixl_backend import NixlAgent
from xavier_core.transfer.nixl_thread import NixlThread
from xavier_core.transfer.peers import split_peer_key
from xavier_core.transfer.runs import Mode, as_page_array
from xavier_core.transfer.source import SourceInfo, endpoint_proto
from xavier_core.transfer.transport import (
    TRANSPORTS,
    IpcPuller,
    RunLengths,
    Transport,
    TransportChoice,
    export_blob,
    is_vram,
)

if TYPE_CHECKING:
    from xavier_core.transfer.copy_plan import PoolView
    from xavier_core.transfer.cuda_copy import CopyHandle

T = TypeVar("T")
log = get_logger(__name__)

DEFAULT_POLL_INTERVAL_S = 0.0005
# A standalone notification (a decline, a failed read's "fail") leaves only when this side's NIXL worker
# progresses: the thread keeps polling this long after sending one, even with nothing else live.
NOTIF_FLUSH_S = 1.0
# Test-only fault injection: "1" makes this process's sources discard every reader "done" notification.
DROP_DONE_ENV = "XAVIER_FAULT_DROP_DONE_NOTIFICATIONS"


@dataclass
class TransferTotals:
    bytes: int = 0
    seconds: float = 0.0
    transfers: int = 0
    failures: int = 0

    def to_pb(self) -> types_pb2.TransferStats:
        return types_pb2.TransferStats(
            bytes=self.bytes, seconds=self.seconds, transfers=self.transfers, failures=self.failures
        )


@dataclass
class _IpcCopy:
    """A CUDA IPC copy in flight, owned by the NIXL thread until its event completes."""

    room: str
    token: str
    peer: str
    done: asyncio.Future[KvPoll]
    aborted: bool = False


@dataclass
class _Published:
    sender: KvSender
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: str = ""


class KvPort:
    """Publishes sources and pulls them into local pages, one NIXL agent per process.

    `buffers` are the process's KV buffers (registered with NIXL here), `page_size` the tokens per page
    (the manager's bookkeeping only). `device_lock`, when given, is held around every NIXL call: a caller
    that captures CUDA graphs on the same device passes its lock. Async methods run on one event loop.
    """

    def __init__(
        self,
        agent_name: str,
        buffers: Sequence[KvBuffer],
        page_size: int,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        mode: Mode = "coalesced",
        device_lock: threading.Lock | None = None,
        transport: TransportChoice = "auto",
    ) -> None:
        self._buffers = list(buffers)
        self._mode = mode
        self.transport = transport
        # Owned by the NIXL thread: sources not yet reported ended, and live reads with their futures.
        self._senders: dict[int, KvSender] = {}
        self._reads: dict[KvReceiver, asyncio.Future[KvPoll]] = {}
        self._copies: dict[CopyHandle, _IpcCopy] = {}
        self._flush_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = NixlThread(self._tick, self._busy, poll_interval, device_lock)
        self.agent: NixlAgent = self._thread.submit(NixlAgent, agent_name, self._buffers).result()
        self.manager = KvManager(self.agent, self._buffers, page_size)
        # Fault-injection hook for tests/faults (a lost NIXL "done" notification); see KvManager.
        self.manager.drop_done_notifications = os.environ.get(DROP_DONE_ENV, "") == "1"
        self._ipc: IpcPuller | None = None
        self._ipc_blob = b""
        if transport != "nixl" and is_vram(self._buffers):
            self._thread.submit(self._init_ipc).result()
        elif transport == "cuda_ipc":
            raise FailedPrecondition("transport cuda_ipc needs a VRAM KV pool", reason="FAILED_PRECONDITION")
        # Owned by the asyncio loop.
        self._published: dict[int, _Published] = {}
        self._endpoint: types_pb2.TransferEndpoint | None = None
        self.totals = TransferTotals()
        self.by_transport: dict[Transport, TransferTotals] = {t: TransferTotals() for t in TRANSPORTS}
        self.run_lengths = RunLengths()

    def _init_ipc(self) -> None:
        """On the NIXL thread: export this pool and get ready to import peers' (compiling the kernel)."""
        try:
            self._ipc_blob = export_blob(self._buffers)
            puller = IpcPuller(self._buffers)
            puller.warm_up()
        except (TransferError, ImportError, RuntimeError) as exc:
            if self.transport == "cuda_ipc":
                raise FailedPrecondition(
                    f"transport cuda_ipc is not available: {exc}", reason="FAILED_PRECONDITION"
                ) from exc
            log.info("CUDA IPC transport unavailable; NIXL only", error=str(exc))
            self._ipc_blob = b""
            return
        self._ipc = puller

    # -- plumbing -----------------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._thread.submit(fn, *args))

    def endpoint(self, host_id: str) -> types_pb2.TransferEndpoint:
        """This process's endpoint: built once (metadata is fixed after registration), then reused."""
        if self._endpoint is None or self._endpoint.host_id != host_id:
            self._endpoint = endpoint_proto(self.agent.name, self.agent.metadata(), self._buffers, host_id)
            self._endpoint.cuda_ipc_pool = self._ipc_blob
        return self._endpoint

    def _busy(self) -> bool:
        return bool(self._senders or self._reads or self._copies) or time.monotonic() < self._flush_until

    def _flush_notifs(self) -> None:
        """On the NIXL thread, after something may have sent a notification: keep polling a while."""
        self._flush_until = time.monotonic() + NOTIF_FLUSH_S

    def _tick(self) -> None:
        """On the NIXL thread: one NIXL poll, then what it ended, handed to the loop in one call."""
        self.manager.progress()
        ended: list[tuple[int, str]] = []
        for room_id, sender in list(self._senders.items()):
            state, in_flight = sender.peek()
            if not in_flight:
                ended.append((room_id, "done" if state == KvPoll.SUCCESS else "fail"))
                del self._senders[room_id]
        reads: list[tuple[asyncio.Future[KvPoll], KvPoll]] = []
        for receiver, fut in list(self._reads.items()):
            state = receiver.poll()
            if state in (KvPoll.SUCCESS, KvPoll.FAILED):
                reads.append((fut, state))
                del self._reads[receiver]
                if state == KvPoll.FAILED:
                    self._flush_notifs()  # the receiver may have told the source it failed
        reads.extend(self._finished_copies())
        if (ended or reads) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, ended, reads)

    def _finished_copies(self) -> list[tuple[asyncio.Future[KvPoll], KvPoll]]:
        """On the NIXL thread: copies whose CUDA event completed; only now is the source told (I1)."""
        out: list[tuple[asyncio.Future[KvPoll], KvPoll]] = []
        for handle, copy in list(self._copies.items()):
            if not handle.is_done():
                continue
            del self._copies[handle]
            make = fail_notif if copy.aborted else done_notif
            try:
                self.agent.send_notif(copy.peer, make(copy.room, copy.token))
            except TransferError as err:
                log.info("read-end notification not delivered", room=copy.room, error=str(err))
            self._flush_notifs()
            out.append((copy.done, KvPoll.FAILED if copy.aborted else KvPoll.SUCCESS))
        if self._ipc is not None:
            self._ipc.collect()
        return out

    def _deliver(
        self, ended: list[tuple[int, str]], reads: list[tuple[asyncio.Future[KvPoll], KvPoll]]
    ) -> None:
        for room_id, outcome in ended:
            pub = self._published.get(room_id)
            if pub is not None and not pub.ended.is_set():
                pub.outcome = outcome
                pub.ended.set()
        for fut, state in reads:
            if not fut.done():
                fut.set_result(state)

    # -- source side --------------------------------------------------------------------------------------

    async def publish(
        self, room_id: int, page_ids: Sequence[int], fingerprint: str
    ) -> directory_service_pb2.SourceDescriptor:
        """Registers a room's source pages; the returned descriptor goes into PublishSource. The reader
        must report the read's end (its NIXL notification) or `unpublish` ends the room.

        The descriptor leaves out this peer's endpoint: readers have it from the directory, once per epoch.
        """

        def _send() -> tuple[KvSender, SourceInfo]:
            sender = KvSender(self.manager, str(room_id))
            sender.init(len(page_ids))
            info = sender.send(list(page_ids))
            self._senders[room_id] = sender
            return sender, info

        sender, info = await self._run(_send)
        self._published[room_id] = _Published(sender)
        return info.to_proto(fingerprint)

    async def wait_read_end(self, room_id: int, timeout: float) -> str:
        """Waits until the reader of a room reports done or failed; "" on timeout or unknown room."""
        pub = self._published.get(room_id)
        if pub is None:
            return ""
        try:
            await asyncio.wait_for(pub.ended.wait(), timeout)
        except TimeoutError:
            return ""
        return pub.outcome

    def read_ended(self, room_id: int) -> bool:
        pub = self._published.get(room_id)
        return pub is None or pub.ended.is_set()

    async def unpublish(self, room_id: int, completed: bool) -> None:
        pub = self._published.pop(room_id, None)
        if pub is None:
            return
        if completed:
            self.totals.transfers += 1

        def _clear() -> None:
            self._senders.pop(room_id, None)
            if completed:
                pub.sender.mark_complete()
            else:
                pub.sender.abort()
            pub.sender.clear()

        await self._run(_clear)

    @property
    def published(self) -> int:
        return len(self._published)

    # -- reader side --------------------------------------------------------------------------------------

    async def pull(
        self,
        room_id: int,
        source: directory_service_pb2.SourceDescriptor,
        endpoint: types_pb2.TransferEndpoint,
        peer: str,
        dest_pages: Sequence[int],
        timeout: float,
        park_timeout: float,
    ) -> tuple[int, float]:
        """Reads the source pages (at `endpoint`) into `dest_pages`; returns (bytes, seconds). `peer` is the
        source's `peer_key(peer_id, epoch)`: a newer epoch of the same peer replaces the cached older one.

        The transport is CUDA IPC when this port's transport setting allows it and the endpoint offers a
        pool this GPU can map, NIXL otherwise. If cancelled or timed out while the read is in flight, this
        waits (bounded by `park_timeout`) until the NIXL READ or the copy can no longer touch the pages
        before returning, so the caller may free them (I1).
        """
        if source.num_pages != len(dest_pages):
            raise FailedPrecondition(
                f"source has {source.num_pages} pages, the reader reserved {len(dest_pages)}",
                reason="PAGE_COUNT_MISMATCH",
            )
        if len(endpoint.regions) != len(self._buffers):
            raise LayoutMismatch(
                f"source has {len(endpoint.regions)} KV buffers, the reader has {len(self._buffers)}",
                fields="num_buffers",
            )
        try:
            info = SourceInfo.from_proto(source, endpoint)
        except InvalidSourceError as err:
            raise FailedPrecondition(f"bad source descriptor: {err}", reason="INVALID_SOURCE") from None
        src_pages, dst_pages = info.page_ids(), as_page_array(dest_pages)
        try:
            transport, view = await self._run(self._choose, endpoint, peer)
        except Unavailable:
            await asyncio.shield(self.decline(room_id, info.token, endpoint, peer))
            raise
        started = time.perf_counter()
        try:
            if view is not None:
                await self._pull_ipc(
                    room_id, info, endpoint, peer, view, src_pages, dst_pages, timeout, park_timeout
                )
            else:
                await self._pull_nixl(
                    room_id, source, info, endpoint, peer, dest_pages, timeout, park_timeout
                )
        except Unavailable:
            self.totals.failures += 1
            self.by_transport[transport].failures += 1
            raise
        elapsed = time.perf_counter() - started
        nbytes = sum(b.bytes_per_page for b in self._buffers) * len(dest_pages)
        self.run_lengths.observe(src_pages, dst_pages)
        for totals in (self.totals, self.by_transport[transport]):
            totals.bytes += nbytes
            totals.seconds += elapsed
            totals.transfers += 1
        return nbytes, elapsed

    def _choose(self, endpoint: types_pb2.TransferEndpoint, peer: str) -> tuple[Transport, PoolView | None]:
        """On the NIXL thread: CUDA IPC when configured, offered and mappable, else NIXL."""
        if self.transport == "nixl" or self._ipc is None:
            return "nixl", None
        peer_id, epoch = split_peer_key(peer) or (peer, 0)
        view = self._ipc.view(peer_id, epoch, endpoint.cuda_ipc_pool)
        if view is not None:
            return "cuda_ipc", view
        if self.transport == "cuda_ipc":
            raise Unavailable(f"transport cuda_ipc cannot reach peer {peer_id}", reason="TRANSFER_FAILED")
        return "nixl", None

    async def _pull_ipc(
        self,
        room_id: int,
        info: SourceInfo,
        endpoint: types_pb2.TransferEndpoint,
        peer: str,
        view: PoolView,
        src_pages: Any,
        dst_pages: Any,
        timeout: float,
        park_timeout: float,
    ) -> None:
        """One fused copy from the mapped source pool. On cancel or timeout this waits (bounded by
        `park_timeout`) until the copy has finished, so neither side's pages are reused under it (I1);
        the engine loop never waits: the copy is polled on the NIXL thread."""
        ipc = self._ipc
        if ipc is None:
            raise Unavailable("CUDA IPC is not set up", reason="TRANSFER_FAILED")
        peer_id = (split_peer_key(peer) or (peer, 0))[0]
        copy = _IpcCopy(str(room_id), info.token, peer, asyncio.get_running_loop().create_future())
        posted = False

        def _start() -> None:
            nonlocal posted
            self.agent.add_peer(peer, endpoint.agent_metadata)  # the read-end notification goes over NIXL
            handle = ipc.start(peer_id, view, src_pages, dst_pages)
            self._copies[handle] = copy
            posted = True  # from here the copy's end tells the source (even if this task is cancelled)

        def _abort() -> None:
            copy.aborted = True  # its end is reported to the source as a failed read

        try:
            try:
                await self._run(_start)
            except TransferError as err:
                raise Unavailable(
                    f"KV copy of room {room_id} not started: {err}", reason="TRANSFER_FAILED"
                ) from None
            try:
                state = await asyncio.wait_for(asyncio.shield(copy.done), timeout)
            except TimeoutError:
                state = KvPoll.FAILED
            if state != KvPoll.SUCCESS:
                raise Unavailable(f"KV copy of room {room_id} failed", reason="TRANSFER_FAILED")
        except BaseException:
            if not posted:
                await asyncio.shield(self.decline(room_id, info.token, endpoint, peer))
            else:
                await asyncio.shield(self._run(_abort))
                try:
                    await asyncio.shield(asyncio.wait_for(asyncio.shield(copy.done), park_timeout))
                except TimeoutError:
                    log.error("KV copy still running after the park timeout", room=room_id)
            raise

    async def _pull_nixl(
        self,
        room_id: int,
        source: directory_service_pb2.SourceDescriptor,
        info: SourceInfo,
        endpoint: types_pb2.TransferEndpoint,
        peer: str,
        dest_pages: Sequence[int],
        timeout: float,
        park_timeout: float,
    ) -> None:
        receiver = KvReceiver(self.manager, str(room_id))
        done: asyncio.Future[KvPoll] = asyncio.get_running_loop().create_future()
        posted = False

        def _start() -> None:
            nonlocal posted
            receiver.init()
            receiver.send_metadata(list(dest_pages))
            receiver.start(info, peer, self._mode)
            posted = True  # from here the receiver tells the source how its read ended
            self._reads[receiver] = done

        def _forget() -> None:
            self._reads.pop(receiver, None)

        try:
            await self._run(_start)
            try:
                state = await asyncio.wait_for(asyncio.shield(done), timeout)
            except TimeoutError:
                state = KvPoll.FAILED
            if state != KvPoll.SUCCESS:
                raise Unavailable(
                    f"KV read of room {room_id} failed ({state.name})", reason="TRANSFER_FAILED"
                )
        except BaseException:
            await asyncio.shield(self._run(_forget))
            if not posted:
                await asyncio.shield(self.decline(room_id, source.read_token, endpoint, peer))
            await asyncio.shield(self._quiesce(receiver, park_timeout))
            raise
        await self._run(receiver.clear)

    def stats(self) -> dict[str, Any]:
        """Transfers by transport and the run-length histogram (for metrics and benchmarks)."""
        return {
            "transport": self.transport,
            "cuda_ipc_offered": bool(self._ipc_blob),
            "by_transport": {t: vars(v).copy() for t, v in self.by_transport.items()},
            "run_lengths": self.run_lengths.to_dict(),
        }

    async def decline(
        self, room_id: int, read_token: str, endpoint: types_pb2.TransferEndpoint, peer: str
    ) -> None:
        """Tells a room's source that no read will come (the room began, the read never started), so
        the source unpins at once instead of parking its pages until the park timeout."""

        def _send() -> None:
            try:
                self.agent.add_peer(peer, endpoint.agent_metadata)
                self.agent.send_notif(peer, fail_notif(str(room_id), read_token))
                self._flush_notifs()
            except TransferError as err:
                log.info("decline not delivered", room_id=room_id, error=str(err))

        await self._run(_send)

    async def _quiesce(self, receiver: KvReceiver, timeout: float) -> None:
        """Aborts a receiver and waits until its read can no longer touch the destination pages."""
        await self._run(receiver.abort)
        await self._run(self._flush_notifs)  # its "fail" leaves now or once the read ends
        deadline = time.monotonic() + timeout
        while not await self._run(receiver.wait_idle, 0.05):
            if time.monotonic() > deadline:
                log.error("KV read still in flight after the park timeout", room=receiver.room)
                return
        await self._run(receiver.clear)

    async def close(self) -> None:
        if self._ipc is not None:
            await self._run(self._ipc.close)
        await self._run(self.agent.close)
        await asyncio.to_thread(self._thread.stop)
