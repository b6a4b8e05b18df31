"""The data plane as a service drives it (a prefill publishes a room's pages, a decode pulls them),
over the transfer layer's KV manager and one NIXL agent per process.

The port knows buffers (addresses, lengths, bytes per page, a device string), page ids and peer keys;
it speaks the contract's `SourceDescriptor` / `TransferEndpoint` on the wire, never an engine. Its NIXL
thread and the live work on it are `port.core`; how each transport pulls is `port.pulls`.

Transports (see `port.transport`): a VRAM port exports its pool through CUDA IPC in its endpoint, and a reader
on the same host copies from the mapped pool with one fused kernel. A port whose transport is staged (or
auto on a VRAM pool) owns a staging slab, registered with its agent and named in its endpoint: as a
source it gathers a room into slab chunks when it publishes (`staged.slab`), as a reader it pulls staged
rooms chunk by chunk (`staged.read`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from xavier.v1 import directory_service_pb2, types_pb2

from xavier_core.runtime.errors import FailedPrecondition, LayoutMismatch, Unavailable
from xavier_core.runtime.logging import get_logger
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import InvalidSourceError, TransferError
from xavier_core.transfer.common.peers import split_peer_key
from xavier_core.transfer.common.runs import Mode, as_page_array
from xavier_core.transfer.common.slab_layout import SlabLayout
from xavier_core.transfer.common.source import MAX_METADATA_BYTES, SourceInfo, endpoint_proto
from xavier_core.transfer.nixl.rooms import KvSender
from xavier_core.transfer.port import pulls
from xavier_core.transfer.port.core import (
    DEFAULT_POLL_INTERVAL_S,
    DROP_DONE_ENV,
    STUCK_READS_ENV,
    PortCore,
    Published,
    ReadEnd,
    TransferTotals,
)
from xavier_core.transfer.port.transport import (
    TRANSPORTS,
    IpcPeers,
    RunLengths,
    Transport,
    TransportChoice,
    export_blob,
    is_vram,
)
from xavier_core.transfer.staged.port_slab import PortSlab

if TYPE_CHECKING:
    from xavier_core.transfer.cuda.copy_plan import PoolView

__all__ = [
    "DEFAULT_POLL_INTERVAL_S",
    "DROP_DONE_ENV",
    "STUCK_READS_ENV",
    "KvPort",
    "ReadEnd",
    "TransferTotals",
]

log = get_logger(__name__)

DEFAULT_SLAB_BYTES = 256 << 20
DEFAULT_CHUNK_BYTES = 4 << 20


class KvPort(PortCore):
    """Publishes sources and pulls them into local pages, one NIXL agent per process.

    `buffers` are the process's KV buffers (registered with NIXL here), `page_size` the tokens per page
    (the manager's bookkeeping only). `device_lock`, when given, is held around every NIXL call: a caller
    that captures CUDA graphs on the same device passes its lock. `read_end_agent`: tell sources a read
    ended through a second agent (`NixlAgent`), so READs carry no notification. Async methods run on one
    event loop.
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
        *,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        read_end_agent: bool = True,
    ) -> None:
        super().__init__(agent_name, buffers, page_size, poll_interval, device_lock, read_end_agent)
        self._mode = mode
        self.transport = transport
        self._ipc_blob = b""
        if transport not in ("nixl", "staged") and is_vram(self._buffers):
            self._thread.submit(self._init_ipc).result()
        elif transport == "cuda_ipc":
            raise FailedPrecondition("transport cuda_ipc needs a VRAM KV pool", reason="FAILED_PRECONDITION")
        self._slab: PortSlab | None = None
        if transport == "staged" or (transport == "auto" and is_vram(self._buffers)):
            layout = SlabLayout.plan(self._buffers, chunk_bytes, slab_bytes)
            try:
                self._slab = self._thread.submit(PortSlab, self.agent, self._buffers, layout).result()
            except Exception as exc:  # out of device memory, a registration NIXL refused: optional under auto
                if transport == "staged":
                    raise FailedPrecondition(
                        f"transport staged: no staging slab: {exc}", reason="FAILED_PRECONDITION"
                    ) from exc
                log.warning("no staging slab; pulls that would be staged read page runs", error=str(exc))
        self._host_id = ""
        self._endpoint: types_pb2.TransferEndpoint | None = None
        self.totals = TransferTotals()
        self.by_transport: dict[Transport, TransferTotals] = {t: TransferTotals() for t in TRANSPORTS}
        self.run_lengths = RunLengths()
        self.peers_warmed = 0

    def _init_ipc(self) -> None:
        """On the NIXL thread: export this pool and get ready to import peers' (compiling the kernel)."""
        try:
            self._ipc_blob = export_blob(self._buffers)
            ipc = IpcPeers(self._buffers)
            ipc.warm_up()
        except (TransferError, ImportError, RuntimeError) as exc:
            if self.transport == "cuda_ipc":
                raise FailedPrecondition(
                    f"transport cuda_ipc is not available: {exc}", reason="FAILED_PRECONDITION"
                ) from exc
            log.info("CUDA IPC transport unavailable; NIXL only", error=str(exc))
            self._ipc_blob = b""
            return
        self._ipc = ipc

    def endpoint(self, host_id: str) -> types_pb2.TransferEndpoint:
        """This process's endpoint: built once (metadata is fixed after registration), then reused."""
        if self._endpoint is None or self._endpoint.host_id != host_id:
            slab = self._slab.slab.buffer if self._slab is not None else None
            self._host_id = host_id
            self._endpoint = endpoint_proto(
                self.agent.name, self.agent.metadata(), self._buffers, host_id, slab
            )
            self._endpoint.cuda_ipc_pool = self._ipc_blob
        return self._endpoint

    # -- source side --------------------------------------------------------------------------------------

    def stages_for(self, reader_host: str | None) -> bool:
        """Whether a room for a reader on `reader_host` (None: unknown) is gathered into the slab:
        always when staged is forced; under auto (a VRAM pool) unless the reader shares this host,
        where it copies over CUDA IPC."""
        if self._slab is None:
            return False
        return self.transport == "staged" or reader_host is None or reader_host != self._host_id

    @property
    def needs_reader_host(self) -> bool:
        """Whether `publish` decides by the reader's host (auto with a slab): else the caller may skip
        looking it up."""
        return self._slab is not None and self.transport == "auto"

    async def publish(
        self, room_id: int, page_ids: Sequence[int], fingerprint: str, *, reader_host: str | None = None
    ) -> directory_service_pb2.SourceDescriptor:
        """Registers a room's source pages; the returned descriptor goes into PublishSource. The reader
        must report the read's end (its NIXL notification) or `unpublish` ends the room. With a slab
        and a reader that needs it (`stages_for`), the pages are gathered into slab chunks first.

        The descriptor leaves out this peer's endpoint: readers have it from the directory, once per epoch.
        A room published (or being published) here already is refused: ROOM_BUSY.
        """
        if room_id in self._published or room_id in self._publishing:
            # Refused before anything is registered: the failure path below would drop the live room.
            raise FailedPrecondition(f"room {room_id} is already published here", reason="ROOM_BUSY")
        self._publishing.add(room_id)
        try:
            return await self._publish(room_id, page_ids, fingerprint, self.stages_for(reader_host))
        finally:
            self._publishing.discard(room_id)

    async def _publish(
        self, room_id: int, page_ids: Sequence[int], fingerprint: str, stage: bool
    ) -> directory_service_pb2.SourceDescriptor:

        def _send() -> tuple[KvSender, SourceInfo]:
            sender = KvSender(self.manager, str(room_id))
            try:
                sender.init(len(page_ids))
                info = sender.send(list(page_ids))
                if self._slab is not None and stage:
                    auto = self.transport == "auto"
                    info = self._slab.stage(room_id, info, page_ids, only_if_fewer=auto)
            except BaseException:
                sender.clear()
                raise
            self._senders[room_id] = sender
            return sender, info

        try:
            sender, info = await self.run(_send)
        except BaseException:
            # Queued behind `_send`: whatever it registered goes (no descriptor left this process).
            await asyncio.shield(self.run(self._drop_source, room_id))
            raise
        self._published[room_id] = Published(sender)
        return info.to_proto(fingerprint)

    def _drop_source(self, room_id: int) -> None:
        """On the NIXL thread: forgets a room whose publication failed, and frees its slab chunks."""
        sender = self._senders.pop(room_id, None)
        if sender is not None:
            sender.abort()
            sender.clear()
        if self._slab is not None:
            self._slab.release(room_id)

    async def wait_read_end(self, room_id: int, timeout: float) -> ReadEnd:
        """Waits until the reader of a room reports done or failed; `ReadEnd.NONE` (falsy) on timeout or
        an unknown room."""
        pub = self._published.get(room_id)
        if pub is None:
            return ReadEnd.NONE
        if not pub.ended.is_set():  # a timer on this task, not a task per wait
            try:
                async with asyncio.timeout(timeout):
                    await pub.ended.wait()
            except TimeoutError:
                return ReadEnd.NONE
        return pub.outcome

    def read_ended(self, room_id: int) -> bool:
        pub = self._published.get(room_id)
        return pub is None or pub.ended.is_set()

    def _stages(self, room_id: int) -> bool:
        return self._slab is not None and self._slab.holds(room_id)

    async def unpublish(self, room_id: int, completed: bool) -> None:
        """Ends a room's source: the caller knows no read can touch its pages any more (the room is
        terminal and the read ended or was parked out), so its slab chunks are free again too."""
        pub = self._published.pop(room_id, None)
        if pub is None:
            return
        if completed:
            self.totals.transfers += 1
        if pub.cleared:  # forgotten on the NIXL thread when the reader's word came: nothing left there
            return

        heard = pub.ended.is_set()

        def _clear() -> None:
            self._senders.pop(room_id, None)
            if not heard:
                # Ended by the room's word, not the reader's: its "done" may be on the way still, and
                # would otherwise wait in NIXL's queue for the next room's polling. Take it in now (it is
                # counted as late: `xavier_transfer_notifications_ignored{why="unknown_room"}`).
                self.flush_notifs()
            if completed:
                pub.sender.mark_complete()
            else:
                pub.sender.abort()
            pub.sender.clear()
            if self._slab is not None:
                self._slab.release(room_id)

        await self.run(_clear)

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
        *,
        silent: bool = False,
    ) -> tuple[int, float]:
        """Reads the source pages (at `endpoint`) into `dest_pages`; returns (bytes, seconds). `peer` is the
        source's `peer_key(peer_id, epoch)`: a newer epoch of the same peer replaces the cached older one.
        `silent`: the source is told nothing of the read (pages that stand in its pool for a while, for
        any reader, `PrefixSharing`; such a source names no staging chunks, so it is never read staged).

        The transport: CUDA IPC when allowed and the endpoint offers a pool this GPU can map; else
        staged when allowed, the source staged the room and the slabs match; else NIXL page runs. If
        cancelled or timed out while the read is in flight, this waits (bounded by `park_timeout`) until
        nothing can touch the pages before returning, so the caller may free them (I1); if the read is
        still running then, it raises `ReadStuck` (or stays cancelled) and `take_stuck(room_id)` says so:
        the caller must keep the pages out of use.
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
            if self._ipc is None:  # no pool to map: choosing touches nothing of the NIXL thread's
                transport, view = self._choose(endpoint, peer, info)
            else:
                transport, view = await self.run(self._choose, endpoint, peer, info)
        except Unavailable:
            if not silent:
                await asyncio.shield(pulls.decline(self, room_id, info.token, endpoint, peer))
            raise
        started = time.perf_counter()
        args = (room_id, info, endpoint, peer)
        try:
            if view is not None and self._ipc is not None:
                pages = (src_pages, dst_pages)
                await pulls.pull_ipc(self, self._ipc, *args, view, pages, timeout, park_timeout, silent)
            elif transport == "staged" and self._slab is not None:
                slab, pool = self._slab.slab, self._slab.pool
                staged = pulls.pull_staged(self, slab, pool, *args, dst_pages, timeout, park_timeout)
                if not await staged:
                    transport = "nixl"  # no free chunk here: the page runs, as coalesced NIXL
            if transport == "nixl":
                await pulls.pull_nixl(self, self._mode, *args, dest_pages, timeout, park_timeout, silent)
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

    def _choose(
        self, endpoint: types_pb2.TransferEndpoint, peer: str, info: SourceInfo
    ) -> tuple[Transport, PoolView | None]:
        """CUDA IPC when configured, offered and mappable; else staged when the source staged the room
        and this port may; else NIXL. On the NIXL thread when this port has CUDA IPC (mapping a pool
        is the thread's), on the loop otherwise (the rest reads only the source and the slab's layout)."""
        if self.transport in ("auto", "cuda_ipc") and self._ipc is not None:
            peer_id, epoch = split_peer_key(peer) or (peer, 0)
            view = self._ipc.view(peer_id, epoch, endpoint.cuda_ipc_pool)
            if view is not None:
                return "cuda_ipc", view
        if self.transport == "cuda_ipc":
            raise Unavailable(f"transport cuda_ipc cannot reach peer {peer}", reason="TRANSFER_FAILED")
        if self.transport in ("auto", "staged") and info.staging_runs and self._slab is not None:
            if self._slab.matches(info):
                return "staged", None
            log.warning("staging chunk sizes differ from the source's; reading page runs", peer=peer)
        return "nixl", None

    def take_stuck(self, room_id: int) -> asyncio.Future[None] | None:
        """Whether `room_id`'s pull ended (failed or cancelled) with its read still running at the park
        timeout, forgetting it: if so, a future that completes once that read has ended. Until then the
        pages it read into may still change and must not be used; None for any other room."""
        return self.stuck_rooms.pop(room_id, None)

    async def warm(self, peer: str, endpoint: types_pb2.TransferEndpoint) -> bool:
        """Connects to a peer before its first transfer: its agent loaded (and the read-end agent's
        connection made), its pool mapped where CUDA IPC reaches it, so that the first pull from it moves
        pages instead of setting all that up (33.6 ms of a first pull on a CPU box, 4.5 ms warmed).
        `peer` is its `peer_key(peer_id, epoch)`, as pulls name it. Best effort: False, logged, when it
        could not (an older epoch than one loaded, metadata NIXL refuses); a pull then does it as it
        always did."""
        if not endpoint.agent_metadata or len(endpoint.agent_metadata) > MAX_METADATA_BYTES:
            return False

        def _warm() -> None:
            self.agent.add_peer(peer, endpoint.agent_metadata)
            if self._ipc is not None and self.transport in ("auto", "cuda_ipc"):
                peer_id, epoch = split_peer_key(peer) or (peer, 0)
                self._ipc.view(peer_id, epoch, endpoint.cuda_ipc_pool)  # None (and logged) if unreachable

        try:
            await self.run(_warm)
        except TransferError as err:
            log.info("peer not connected ahead of its first transfer", peer=peer, error=str(err))
            return False
        self.peers_warmed += 1
        return True

    def stats(self) -> dict[str, Any]:
        """Transfers by transport, the staging slab, the run-length histogram and the notifications this
        port ignored (metrics, benchmarks)."""
        manager = self.manager.stats()
        return {
            "notifications_ignored": {
                "unknown_room": manager["notifications_dropped"],
                "bad_token": manager["notifications_rejected"],
                "injected": manager["notifications_lost"],
            },
            "transport": self.transport,
            "peers_warmed": self.peers_warmed,
            "cuda_ipc_offered": bool(self._ipc_blob),
            "by_transport": {t: vars(v).copy() for t, v in self.by_transport.items()},
            "run_lengths": self.run_lengths.to_dict(),
            "staging": self._slab.stats() if self._slab is not None else None,
        }

    @property
    def staging_bytes_in_use(self) -> int:
        return self._slab.slab.bytes_in_use if self._slab is not None else 0

    def transfer_stats_pb(self) -> types_pb2.TransferStats:
        """The totals and the staging counters, as the stats RPCs answer them."""
        pb = self.totals.to_pb()
        pb.staged_transfers = self.by_transport["staged"].transfers
        if self._slab is not None:
            pb.staging_bytes_in_use = self._slab.slab.bytes_in_use
            pb.staged_transfers += self._slab.staged_sources
            pb.staging_fallbacks = self._slab.fallbacks
        return pb

    async def decline(
        self, room_id: int, read_token: str, endpoint: types_pb2.TransferEndpoint, peer: str
    ) -> None:
        """Tells a room's source that no read will come (the room began, the read never started), so
        the source unpins at once instead of parking its pages until the park timeout."""
        await pulls.decline(self, room_id, read_token, endpoint, peer)

    async def close(self) -> None:
        await self.stop_reaping()
        if self._ipc is not None:
            await self.run(self._ipc.close)
        await self.run(self.agent.close)
        await asyncio.to_thread(self._thread.stop)
