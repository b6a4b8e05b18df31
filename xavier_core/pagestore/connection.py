"""One client's connection to one page store: its gRPC channel, its NIXL agent and the store's endpoint.

`PageStoreClient` decides what to ask and what a failure means; this module only talks to the store:
one typed method per RPC, each with a deadline and its error mapped to `XavierError`; the store's NIXL
endpoint is loaded once per store instance (a restarted store answers with a new instance, and its old
agent is dropped); a NIXL READ or WRITE is posted and waited for, and one that ends otherwise raises
`PeerError`, or `TransferStuck` when NIXL refused to cancel it. The gRPC channel reconnects by itself.

A store on this host says where its arena lies in its memory with its endpoint; unless `same_host_reads`
is off the connection checks it can read it with the endpoint (`direct`), and a READ posted for that store
instance is then a read straight out of the store's memory, posted and waited for the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from xavier.v1 import page_store_service_pb2 as pb
from xavier.v1 import page_store_service_pb2_grpc as pb_grpc

from xavier_core.pagestore.direct import DirectArena, DirectCopy, open_direct_arena
from xavier_core.pagestore.metrics import client_metrics
from xavier_core.pagestore.nixl import (
    CLIENT_UCX_ENV,
    TCP_SEGMENT_BYTES,
    UCX_DEFAULT_SEGMENT_BYTES,
    Op,
    PageAgent,
    wait,
)
from xavier_core.runtime.channels import open_channel
from xavier_core.runtime.errors import from_rpc_error
from xavier_core.transfer.common.buffers import KvBuffer
from xavier_core.transfer.common.errors import PeerError
from xavier_core.transfer.nixl.xfer import Transfer

__all__ = ["HolderStuck", "Posted", "StoreConnection", "StorePeer", "TransferStuck"]

log = logging.getLogger(__name__)
_R = TypeVar("_R")

_KEYS_PER_CALL = 1024
"""Keys per call until the store has said its own limit (and when it says none)."""


@dataclass(frozen=True)
class StorePeer:
    """One instance of the store as a NIXL peer: reloaded when the store restarts."""

    instance: str
    agent_name: str
    max_keys: int
    arena: DirectArena | None = None
    """The store's arena read straight out of its memory (a store on this host): its READs."""


Posted = Transfer | DirectCopy
"""A READ or WRITE under way: a NIXL transfer, or a read straight out of a same-host store's memory."""


class TransferStuck(PeerError):
    """A timed-out NIXL transfer that could not be cancelled: its local pages may still change, until
    `ended()` (asked in a worker thread) says it has ended; for good without it.

    `released`, once set (`PageStoreClient` sets it from `ended`), completes when it has."""

    def __init__(
        self,
        message: str,
        ended: Callable[[], bool] | None = None,
        released: asyncio.Future[None] | None = None,
    ) -> None:
        super().__init__(message)
        self.ended = ended
        self.released = released


class HolderStuck(TransferStuck):
    """A copy from the pages' holder (`from_holder`) still running after it failed: it lands in the fetch's
    pool pages themselves (never in staging slots), so those may still change; until `released`
    completes (the copy has ended), or for good without it."""

    def __init__(self, message: str, released: asyncio.Future[None] | None = None) -> None:
        super().__init__(message, released=released)


class _StoreChanged(Exception):
    """The store restarted between two calls of one operation; the operation ends as a miss."""


class StoreConnection:
    """The channel, stub and NIXL agent one client uses to reach one store at `address`.

    `buffers` are what NIXL registers (a pool, or its pinned host mirror); descriptor rows posted through
    `move` address them.
    """

    def __init__(
        self,
        address: str,
        buffers: Sequence[KvBuffer],
        *,
        name: str,
        rpc_timeout_s: float,
        transfer_timeout_s: float,
        same_host_reads: bool = True,
    ) -> None:
        self.address = address
        self.same_host_reads = same_host_reads
        self.agent = PageAgent(name, buffers, CLIENT_UCX_ENV)
        self._rpc_timeout_s = rpc_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._metrics = client_metrics()
        self._channel: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.PageStoreServiceStub | None = None
        self._store: StorePeer | None = None
        self._store_lock: asyncio.Lock | None = None

    def loaded_store(self) -> StorePeer | None:
        """The store instance loaded now (its endpoint fetched), if any; `ensure_store` loads one."""
        return self._store

    def keys_per_call(self) -> int:
        """The store's batch limit, once its endpoint is loaded."""
        return self._store.max_keys if self._store is not None else _KEYS_PER_CALL

    # -- RPCs: each with the RPC deadline; a gRPC error is raised as `XavierError` ------------------------

    async def exists_pages(self, request: pb.ExistsPagesRequest) -> pb.ExistsPagesResponse:
        """How long a prefix of the keys is stored (no lease)."""
        return await self._call(self._stub.ExistsPages, request)

    async def get_pages(self, request: pb.GetPagesRequest) -> pb.GetPagesResponse:
        """The stored prefix of the keys, leased for a READ."""
        return await self._call(self._stub.GetPages, request)

    async def put_pages(self, request: pb.PutPagesRequest) -> pb.PutPagesResponse:
        """Reserves store pages for the keys not stored yet, leased for a WRITE."""
        return await self._call(self._stub.PutPages, request)

    async def commit_put(self, request: pb.CommitPutRequest) -> pb.CommitPutResponse:
        """Commits written pages against their checksums."""
        return await self._call(self._stub.CommitPut, request)

    async def release_lease(self, request: pb.ReleaseLeaseRequest) -> pb.ReleaseLeaseResponse:
        """Ends a lease early (naming pages that failed their checksum)."""
        return await self._call(self._stub.ReleaseLease, request)

    async def get_stats(self) -> pb.GetPageStoreStatsResponse:
        """The store's stats."""
        return await self._call(self._stub.GetPageStoreStats, pb.GetPageStoreStatsRequest())

    @property
    def _stub(self) -> pb_grpc.PageStoreServiceStub:
        if self._stub_ is None:
            self._channel = open_channel(self.address)
            self._stub_ = pb_grpc.PageStoreServiceStub(self._channel)
        return self._stub_

    async def _call(self, method: Callable[..., Awaitable[_R]], request: Any) -> _R:
        try:
            return await method(request, timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None

    async def ensure_store(self, instance: str) -> StorePeer:
        """The store's NIXL peer for `instance`, loading its endpoint once per store instance."""
        if self._store_lock is None:
            self._store_lock = asyncio.Lock()
        async with self._store_lock:
            if self._store is not None and self._store.instance == instance:
                return self._store
            if self._store is not None:
                self.forget_store(self._store)
            resp = await self._call(
                self._stub.GetStoreEndpoint,
                pb.GetStoreEndpointRequest(tcp_receive_segment_bytes=TCP_SEGMENT_BYTES),
            )
            if resp.store_instance != instance:
                raise _StoreChanged(f"store restarted ({instance} -> {resp.store_instance})")
            if (sends := resp.tcp_segment_bytes or UCX_DEFAULT_SEGMENT_BYTES) > TCP_SEGMENT_BYTES:
                # A READ of segments larger than this agent receives would abort this process.
                raise PeerError(
                    f"the page store sends UCX TCP segments of {sends} bytes, this client takes "
                    f"{TCP_SEGMENT_BYTES}"
                )
            name = await asyncio.to_thread(self.agent.add_remote, resp.endpoint.agent_metadata)
            arena = await asyncio.to_thread(self._direct_arena, resp) if self.same_host_reads else None
            self._store = StorePeer(instance, name, int(resp.max_keys_per_call) or _KEYS_PER_CALL, arena)
            log.info(
                "page store endpoint loaded: instance %s agent %s, reads %s",
                instance,
                name,
                "straight out of its memory" if arena is not None else "over NIXL",
            )
            return self._store

    @staticmethod
    def _direct_arena(resp: pb.GetStoreEndpointResponse) -> DirectArena | None:
        """The arena of a store on this host, read straight out of its memory; None (its READs go over
        NIXL) where the store offers none or it cannot be read, logged once per store instance."""
        if not resp.HasField("direct_arena") or len(resp.endpoint.regions) != 1:
            return None
        region, instance = resp.endpoint.regions[0], resp.store_instance
        try:
            return open_direct_arena(resp.direct_arena, instance, region.base_address, region.length)
        except (OSError, PeerError, ValueError) as exc:
            log.info("page store %s: read over NIXL, not out of its memory: %s", instance, exc)
            return None

    def forget_store(self, store: StorePeer) -> None:
        """Drops `store`'s NIXL agent and its arena; the next transfer reloads the endpoint."""
        if self._store is store:
            self._store = None
        if store.arena is not None:
            store.arena.close()  # no later READ of this store instance reads its memory
        try:
            with self.agent.lock:
                self.agent.remove_remote(store.agent_name)
        except Exception as exc:  # the agent may already be gone with its process
            log.debug("removing the store's NIXL agent failed: %s", exc)

    def move(self, op: Op, store: StorePeer, rows: npt.NDArray[np.uint64], pages: int) -> None:
        """Posts one NIXL transfer and waits for it (a worker thread); raises `PeerError` unless DONE."""
        self.settle(op, self.post(op, store, rows), rows, pages)

    def post(self, op: Op, store: StorePeer, rows: npt.NDArray[np.uint64]) -> Posted:
        """Posts one transfer of `rows`: a READ of a same-host store reads its memory, anything else is a
        NIXL transfer with the transfer deadline; `settle` waits for its end."""
        if op == "READ" and store.arena is not None:
            return store.arena.copy(rows)
        return self.agent.post(op, rows, store.agent_name, self._transfer_timeout_s)

    def read_checked(self, store: StorePeer, pages: npt.NDArray[np.uint64]) -> list[bytes]:
        """A same-host store's READ of `pages` ((pages, segments, 3) words: arena address, local address,
        nbytes) with each page's checksum taken as it lands (`DirectArena.read_checked`); raises
        `PeerError`."""
        if store.arena is None:
            raise PeerError("the store's memory is not read on this host")
        sums = store.arena.read_checked(pages)
        self._metrics.transfer_bytes.labels("read").inc(int(pages[:, :, 2].sum()))
        self._metrics.transfer_descriptors.labels("read").inc(pages.shape[0] * pages.shape[1])
        return sums

    def settle(self, op: Op, xfer: Posted, rows: npt.NDArray[np.uint64], pages: int) -> None:
        """Waits for a posted transfer to end (a NIXL one's own deadline bounds the wait, a copy has none
        and needs none); raises `PeerError` unless it ended DONE, `TransferStuck` when NIXL refused to
        cancel it."""
        if isinstance(xfer, DirectCopy):
            if xfer.wait() != "DONE":
                raise PeerError(f"reading {pages} pages out of the store's memory: {xfer.error()}")
        elif (state := wait(xfer)) != "DONE":
            if xfer.in_flight:  # NIXL refused to cancel: the pages may still change under the caller
                log.error("page store: a timed-out NIXL %s could not be cancelled", op)
                # Asked again later (`TransferStuck.ended`): NIXL lets go of a transfer that has ended.
                raise TransferStuck(
                    f"NIXL {op} of {pages} pages ended {state}, still in flight", xfer.release
                )
            raise PeerError(f"NIXL {op} of {pages} pages ended {state}")
        self._metrics.transfer_bytes.labels(op.lower()).inc(int(rows[:, 2].sum()))
        self._metrics.transfer_descriptors.labels(op.lower()).inc(rows.shape[0])

    async def off_loop(self, store: StorePeer, fn: Callable[[], _R]) -> _R:
        """Runs `fn` (NIXL and hashing) in a worker thread; a failed transfer forgets the store's agent."""
        try:
            return await asyncio.to_thread(fn)
        except PeerError:
            self.forget_store(store)
            raise

    async def close(self) -> None:
        """Closes the channel, the store's arena and the NIXL agent."""
        if self._store is not None and self._store.arena is not None:
            self._store.arena.close()
        if self._channel is not None:
            await self._channel.close()
        await asyncio.to_thread(self.agent.close)
