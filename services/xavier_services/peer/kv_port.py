"""The P/D data plane as the prefill and decode servicers see it, over the engine-neutral transfer layer.

All NIXL calls of a process run on one dedicated thread: the agent is not shared across threads, and no
NIXL call ever blocks the asyncio loop. While any source is published or any read is live, a pump on that
thread polls NIXL notifications (which also drives progress without a busy-spinning progress thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
        # Held around every NIXL call when the engine captures CUDA graphs on the same device.
        self._device_lock = device_lock
        self._exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        self._buffers = list(buffers)
        self._poll_interval = poll_interval
        self._mode = mode
        self.agent: NixlAgent = self._exec.submit(NixlAgent, agent_name, self._buffers).result()
        self.manager = KvManager(self.agent, self._buffers, page_size)
        self._published: dict[int, _Published] = {}
        self._live_reads = 0
        self._pump_task: asyncio.Task[None] | None = None
        self._endpoint: types_pb2.TransferEndpoint | None = None
        self.totals = TransferTotals()

    # -- plumbing -----------------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._exec, self._locked, fn, *args)

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        if self._device_lock is None:
            return fn(*args)
        with self._device_lock:
            return fn(*args)

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

    def _ensure_pump(self) -> None:
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        """Drives NIXL progress while sources are published or reads are live; ends parked waits."""
        while self._published or self._live_reads:
            ended = await self._run(self._progress)
            for room_id, outcome in ended:
                pub = self._published.get(room_id)
                if pub is not None and not pub.ended.is_set():
                    pub.outcome = outcome
                    pub.ended.set()
            await asyncio.sleep(self._poll_interval)

    def _progress(self) -> list[tuple[int, str]]:
        # One NIXL poll for every published room, then each room's state as that poll left it.
        self.manager.progress()
        ended = []
        for room_id, pub in list(self._published.items()):
            state, in_flight = pub.sender.peek()
            if not pub.ended.is_set() and not in_flight:
                ended.append((room_id, "done" if state == KvPoll.SUCCESS else "fail"))
        return ended

    # -- prefill side ---------------------------------------------------------------------------------------

    async def publish(
        self, room_id: int, page_ids: Sequence[int], aux: bytes, fingerprint: str, host_id: str
    ) -> directory_service_pb2.SourceDescriptor:
        """Registers a room's source pages; the returned descriptor goes into PublishSource."""

        def _send() -> tuple[KvSender, SourceInfo]:
            sender = KvSender(self.manager, str(room_id))
            sender.init(len(page_ids), aux)
            return sender, sender.send(list(page_ids))

        sender, info = await self._run(_send)
        self._published[room_id] = _Published(sender)
        self._ensure_pump()
        return directory_service_pb2.SourceDescriptor(
            endpoint=self.endpoint(host_id),
            page_runs=[types_pb2.PageRun(first_page=r.first, count=r.count) for r in info.runs],
            num_pages=len(page_ids),
            contract_fingerprint=fingerprint,
            aux=aux,
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
        peer_key: str,
        dest_pages: Sequence[int],
        timeout: float,
        park_timeout: float,
    ) -> tuple[int, float]:
        """Reads the source pages into `dest_pages`; returns (bytes, seconds).

        If cancelled or timed out while the read is in flight, this waits (bounded by `timeout`) until the
        NIXL handle is no longer in progress before returning, so the caller may free the pages (I1).
        """
        if source.num_pages != len(dest_pages):
            raise FailedPrecondition(
                f"source has {source.num_pages} pages, decode reserved {len(dest_pages)}",
                reason="PAGE_COUNT_MISMATCH",
            )
        ep = source.endpoint
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
                    "aux": source.aux,
                }
            )
        except InvalidSourceError as err:
            raise FailedPrecondition(f"bad source descriptor: {err}", reason="INVALID_SOURCE") from None
        receiver = KvReceiver(self.manager, str(room_id))

        def _start() -> None:
            receiver.init()
            receiver.send_metadata(list(dest_pages))
            receiver.start(info, peer_key, self._mode)  # type: ignore[arg-type]

        started = time.perf_counter()
        self._live_reads += 1
        self._ensure_pump()
        try:
            await self._run(_start)
            state = await self._poll_receiver(receiver, timeout)
            if state != KvPoll.SUCCESS:
                self.totals.failures += 1
                raise Unavailable(
                    f"KV read of room {room_id} failed ({state.name})", reason="TRANSFER_FAILED"
                )
        except BaseException:
            await asyncio.shield(self._quiesce(receiver, park_timeout))
            raise
        finally:
            self._live_reads -= 1
        elapsed = time.perf_counter() - started
        nbytes = sum(b.bytes_per_page for b in self._buffers) * len(dest_pages)
        self.totals.bytes += nbytes
        self.totals.seconds += elapsed
        self.totals.transfers += 1
        await self._run(receiver.clear)
        return nbytes, elapsed

    async def _poll_receiver(self, receiver: KvReceiver, timeout: float) -> KvPoll:
        deadline = time.monotonic() + timeout
        while True:
            state = await self._run(receiver.poll)
            if state in (KvPoll.SUCCESS, KvPoll.FAILED):
                return state
            if time.monotonic() > deadline:
                return KvPoll.FAILED
            await asyncio.sleep(self._poll_interval)

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
        self._exec.shutdown(wait=True)
