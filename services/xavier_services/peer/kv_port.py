"""The P/D data plane as the prefill and decode servicers see it, over the engine-neutral transfer layer.

All NIXL calls of a process run on one dedicated thread: the agent is not shared across threads, and no
NIXL call ever blocks the asyncio loop. While any source is published or any read is live, that thread
also polls NIXL between calls, every `poll_interval`: notifications (which also drive progress without a
busy-spinning progress thread), the state of each published source and of each live read. It hands results
to the asyncio loop only when something ended, so a poll costs the loop nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from xavier.v1 import directory_service_pb2, types_pb2

from xavier_core.engine.api import KvBuffer
from xavier_core.runtime.errors import FailedPrecondition, LayoutMismatch, Unavailable
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer import (
    InvalidSourceError,
    KvManager,
    KvPoll,
    KvReceiver,
    KvSender,
    NixlAgent,
    SourceInfo,
    TransferError,
    fail_notif,
)

T = TypeVar("T")
log = get_logger(__name__)


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
class _Published:
    sender: KvSender
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: str = ""


_Job = tuple[Callable[..., Any], tuple[Any, ...], "concurrent.futures.Future[Any]"]


class _NixlThread:
    """Runs submitted calls in order on one thread; polls with `tick` between them while `busy()`."""

    def __init__(
        self,
        tick: Callable[[], None],
        busy: Callable[[], bool],
        poll_interval: float,
        lock: threading.Lock | None,
    ) -> None:
        self._tick, self._busy, self._poll, self._lock = tick, busy, poll_interval, lock
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="xavier-nixl", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, args, fut))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        if self._lock is None:
            return fn(*args)
        with self._lock:
            return fn(*args)

    def _main(self) -> None:
        last = time.monotonic()
        while True:
            busy = self._busy()
            try:
                job = self._jobs.get(timeout=max(0.0, last + self._poll - time.monotonic()) if busy else None)
            except queue.Empty:
                pass  # time to poll
            else:
                if job is None:
                    return
                fn, args, fut = job
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(self._locked(fn, *args))
                    except BaseException as err:  # handed to the caller
                        fut.set_exception(err)
            if self._busy() and time.monotonic() - last >= self._poll:
                last = time.monotonic()
                try:
                    self._locked(self._tick)
                except Exception:
                    log.exception("NIXL poll failed")


class KvPort:
    """Publishes prefill sources and pulls them into decode pages, one NIXL agent per process."""

    def __init__(
        self,
        agent_name: str,
        buffers: Sequence[KvBuffer],
        page_size: int,
        poll_interval: float,
        mode: str = "coalesced",
        device_lock: threading.Lock | None = None,
    ) -> None:
        self._buffers = list(buffers)
        self._mode = mode
        # Owned by the NIXL thread: sources not yet reported ended, and live reads with their futures.
        self._senders: dict[int, KvSender] = {}
        self._reads: dict[KvReceiver, asyncio.Future[KvPoll]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Held around every NIXL call when the engine captures CUDA graphs on the same device.
        self._thread = _NixlThread(self._tick, self._busy, poll_interval, device_lock)
        self.agent: NixlAgent = self._thread.submit(NixlAgent, agent_name, self._buffers).result()
        self.manager = KvManager(self.agent, self._buffers, page_size)
        # Owned by the asyncio loop.
        self._published: dict[int, _Published] = {}
        self._endpoint: types_pb2.TransferEndpoint | None = None
        self.totals = TransferTotals()

    # -- plumbing -----------------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return await asyncio.wrap_future(self._thread.submit(fn, *args))

    def endpoint(self, host_id: str) -> types_pb2.TransferEndpoint:
        """This process's endpoint: built once (metadata is fixed after registration), then reused."""
        if self._endpoint is None or self._endpoint.host_id != host_id:
            self._endpoint = self._make_endpoint(host_id)
        return self._endpoint

    def _make_endpoint(self, host_id: str) -> types_pb2.TransferEndpoint:
        regions = [
            types_pb2.MemoryRegion(
                base_address=b.addr, length=b.nbytes, device=b.device, bytes_per_page=b.bytes_per_page
            )
            for b in self._buffers
        ]
        return types_pb2.TransferEndpoint(
            kind=types_pb2.TRANSPORT_KIND_NIXL,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(),
            regions=regions,
            host_id=host_id,
        )

    def _busy(self) -> bool:
        return bool(self._senders or self._reads)

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
        if (ended or reads) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, ended, reads)

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

    # -- prefill side ---------------------------------------------------------------------------------------

    async def publish(
        self, room_id: int, page_ids: Sequence[int], fingerprint: str
    ) -> directory_service_pb2.SourceDescriptor:
        """Registers a room's source pages; the returned descriptor goes into PublishSource.

        The descriptor leaves out this peer's endpoint: readers have it from the directory, once per epoch.
        """

        def _send() -> tuple[KvSender, SourceInfo]:
            sender = KvSender(self.manager, str(room_id))
            sender.init(len(page_ids), b"")
            info = sender.send(list(page_ids))
            self._senders[room_id] = sender
            return sender, info

        sender, info = await self._run(_send)
        self._published[room_id] = _Published(sender)
        return directory_service_pb2.SourceDescriptor(
            page_runs=[types_pb2.PageRun(first_page=r.first, count=r.count) for r in info.runs],
            num_pages=len(page_ids),
            contract_fingerprint=fingerprint,
            read_token=info.token,
        )

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

    # -- decode side ----------------------------------------------------------------------------------------

    async def pull(
        self,
        room_id: int,
        source: directory_service_pb2.SourceDescriptor,
        ep: types_pb2.TransferEndpoint,
        peer_key: str,
        dest_pages: Sequence[int],
        timeout: float,
        park_timeout: float,
    ) -> tuple[int, float]:
        """Reads the source pages (at endpoint `ep`) into `dest_pages`; returns (bytes, seconds).

        If cancelled or timed out while the read is in flight, this waits (bounded by `timeout`) until the
        NIXL handle is no longer in progress before returning, so the caller may free the pages (I1).
        """
        if source.num_pages != len(dest_pages):
            raise FailedPrecondition(
                f"source has {source.num_pages} pages, decode reserved {len(dest_pages)}",
                reason="PAGE_COUNT_MISMATCH",
            )
        if len(ep.regions) != len(self._buffers):
            raise LayoutMismatch(
                f"source has {len(ep.regions)} KV buffers, decode has {len(self._buffers)}",
                fields="num_buffers",
            )
        try:
            info = SourceInfo.from_fields(
                {
                    "agent_name": ep.agent_name,
                    "metadata": ep.agent_metadata,
                    "regions": [(r.base_address, r.length, r.bytes_per_page, r.device) for r in ep.regions],
                    "runs": [(r.first_page, r.count) for r in source.page_runs],
                    "aux": b"",
                    "token": source.read_token,
                }
            )
        except InvalidSourceError as err:
            raise FailedPrecondition(f"bad source descriptor: {err}", reason="INVALID_SOURCE") from None
        receiver = KvReceiver(self.manager, str(room_id))
        done: asyncio.Future[KvPoll] = asyncio.get_running_loop().create_future()
        posted = False

        def _start() -> None:
            nonlocal posted
            receiver.init()
            receiver.send_metadata(list(dest_pages))
            receiver.start(info, peer_key, self._mode)  # type: ignore[arg-type]
            posted = True  # from here the receiver tells the source how its read ended
            self._reads[receiver] = done

        def _forget() -> None:
            self._reads.pop(receiver, None)

        started = time.perf_counter()
        try:
            await self._run(_start)
            try:
                state = await asyncio.wait_for(asyncio.shield(done), timeout)
            except TimeoutError:
                state = KvPoll.FAILED
            if state != KvPoll.SUCCESS:
                self.totals.failures += 1
                raise Unavailable(
                    f"KV read of room {room_id} failed ({state.name})", reason="TRANSFER_FAILED"
                )
        except BaseException:
            await asyncio.shield(self._run(_forget))
            if not posted:
                await asyncio.shield(self.decline(room_id, source.read_token, ep, peer_key))
            await asyncio.shield(self._quiesce(receiver, park_timeout))
            raise
        elapsed = time.perf_counter() - started
        nbytes = sum(b.bytes_per_page for b in self._buffers) * len(dest_pages)
        self.totals.bytes += nbytes
        self.totals.seconds += elapsed
        self.totals.transfers += 1
        await self._run(receiver.clear)
        return nbytes, elapsed

    async def decline(
        self, room_id: int, read_token: str, ep: types_pb2.TransferEndpoint, peer_key: str
    ) -> None:
        """Tells a room's source that no read will come (the room began, the read never started), so
        the prefill unpins at once instead of parking its pages until the park timeout."""

        def _send() -> None:
            try:
                self.agent.add_peer(peer_key, ep.agent_metadata)
                self.agent.send_notif(peer_key, fail_notif(str(room_id), read_token))
            except TransferError as err:
                log.info("decline not delivered", room_id=room_id, error=str(err))

        await self._run(_send)

    async def _quiesce(self, receiver: KvReceiver, timeout: float) -> None:
        """Aborts a receiver and waits until its read can no longer touch the destination pages."""
        await self._run(receiver.abort)
        deadline = time.monotonic() + timeout
        while not await self._run(receiver.wait_idle, 0.05):
            if time.monotonic() > deadline:
                log.error("KV read still in flight after the park timeout", room=receiver.room)
                return
        await self._run(receiver.clear)

    async def close(self) -> None:
        await self._run(self.agent.close)
        await asyncio.to_thread(self._thread.stop)
