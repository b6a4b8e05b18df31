"""``xavier.v1.PageStoreService``: thin handlers over :class:`PageStore`, plus the lease sweeper.

Handlers run on the event loop and own the store's state; the one slow step, hashing freshly written pages
at commit, runs in a thread while the lease is marked committing (the sweeper leaves it alone).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import message, timestamp_pb2
from xavier.v1 import page_store_service_pb2 as pb
from xavier.v1 import page_store_service_pb2_grpc as pb_grpc
from xavier.v1 import types_pb2

from xavier_core.pagestore.layout import range_checksums
from xavier_core.pagestore.nixl import UCX_DEFAULT_SEGMENT_BYTES
from xavier_core.runtime.errors import FailedPrecondition, InvalidArgument, LeaseExpired, Unavailable
from xavier_core.runtime.tasks import cancel_and_wait
from xavier_core.transfer.common.source import page_runs_proto
from xavier_services.pagestore import validate
from xavier_services.pagestore.arena import Arena
from xavier_services.pagestore.config import PageStoreSettings
from xavier_services.pagestore.metrics import StoreCollector
from xavier_services.pagestore.store import Lease, Page, PageStore

__all__ = ["SERVICE_NAME", "PageStoreServicer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PageStoreService"].full_name
Ctx = Any  # grpc.aio.ServicerContext


def _timestamp(wall: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(wall * 1e9))
    return ts


def _spans(store: PageStore, pages: Sequence[Page]) -> list[pb.PageSpan]:
    return [
        pb.PageSpan(
            chunk_address=s.chunk_address, chunk_slots=s.chunk_slots, first_slot=s.first_slot, count=s.count
        )
        for s in store.spans(pages)
    ]


class PageStoreServicer(pb_grpc.PageStoreServiceServicer):  # type: ignore[misc]
    """The store's RPCs; ``start`` / ``stop`` run the sweeper and the NIXL progress thread."""

    def __init__(self, settings: PageStoreSettings) -> None:
        self.settings = settings
        self.arena = Arena(settings.arena_bytes, settings.chunk_bytes, settings.progress_interval_seconds)
        self.store = PageStore(settings, self.arena)
        self.collector = StoreCollector(self.store)
        self._done: OrderedDict[tuple[str, str], message.Message] = OrderedDict()
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False

    def register(self, server: grpc.aio.Server) -> Sequence[str]:
        pb_grpc.add_PageStoreServiceServicer_to_server(self, server)
        return [SERVICE_NAME]

    async def start(self, _handle: object = None) -> dict[str, Any]:
        self.arena.start(lambda: self.store.live_leases() > 0)
        self.collector.register()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="pagestore-sweeper")
        return {"store_instance": self.arena.instance, "arena_bytes": self.arena.capacity_bytes}

    async def stop(self, _handle: object = None) -> None:
        self._stopping = True
        await cancel_and_wait(self._sweeper)
        self.collector.unregister()
        await asyncio.to_thread(self.arena.close)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_seconds)
            self.store.sweep()

    def _check_running(self) -> None:
        if self._stopping:
            raise Unavailable("the page store is shutting down", reason="SHUTTING_DOWN")

    def _remembered(self, method: str, request_id: str) -> message.Message | None:
        return self._done.get((method, validate.request_id(request_id)))

    def _remember(self, method: str, request_id: str, response: message.Message) -> None:
        self._done[(method, request_id)] = response
        while len(self._done) > self.settings.idempotency_entries:
            self._done.popitem(last=False)

    # --- RPCs -------------------------------------------------------------------------------------------

    async def GetStoreEndpoint(
        self, request: pb.GetStoreEndpointRequest, context: Ctx
    ) -> pb.GetStoreEndpointResponse:
        self._check_running()
        takes = request.tcp_receive_segment_bytes or UCX_DEFAULT_SEGMENT_BYTES
        if takes < self.arena.tcp_segment_bytes:
            raise FailedPrecondition(
                f"this client's NIXL agent receives UCX TCP segments of {takes} bytes and the store sends "
                f"{self.arena.tcp_segment_bytes}: a READ would abort the client; upgrade it",
                reason="TCP_SEGMENT_TOO_SMALL",
                client_segment_bytes=takes,
                store_segment_bytes=self.arena.tcp_segment_bytes,
            )
        region = types_pb2.MemoryRegion(
            base_address=self.arena.base, length=self.arena.capacity_bytes, device="cpu", bytes_per_page=0
        )
        endpoint = types_pb2.TransferEndpoint(
            kind=types_pb2.TRANSPORT_KIND_NIXL,
            agent_name=self.arena.agent.name,
            agent_metadata=self.arena.agent.metadata(),
            regions=[region],
        )
        return pb.GetStoreEndpointResponse(
            endpoint=endpoint,
            store_instance=self.arena.instance,
            chunk_bytes=self.arena.chunk_bytes,
            max_keys_per_call=self.settings.max_keys_per_call,
            tcp_segment_bytes=self.arena.tcp_segment_bytes,
            direct_arena=self.arena.direct(),
        )

    async def ExistsPages(self, request: pb.ExistsPagesRequest, context: Ctx) -> pb.ExistsPagesResponse:
        key = validate.namespace_key(request.namespace)
        keys = validate.keys(request.keys, self.settings)
        ns = self.store.find(key)
        return pb.ExistsPagesResponse(hit_count=len(self.store.hit_prefix(ns, keys)) if ns else 0)

    async def GetPages(self, request: pb.GetPagesRequest, context: Ctx) -> pb.GetPagesResponse:
        self._check_running()
        if (seen := self._remembered("get", request.request_id)) is not None:
            return seen
        key = validate.namespace_key(request.namespace)
        keys = validate.keys(request.keys, self.settings)
        lease_s = validate.lease_seconds(request.lease_seconds, self.settings)
        response = pb.GetPagesResponse(store_instance=self.arena.instance)
        ns = self.store.find(key)
        if ns is not None:
            if request.segment_bytes:
                validate.same_geometry(ns, request.segment_bytes)
            hits, lease = self.store.get(ns, keys, lease_s)
            if lease is not None:
                response.hit_count = len(hits)
                response.spans.extend(_spans(self.store, hits))
                response.checksums.extend(p.checksum for p in hits)
                response.lease_id = lease.id
                response.lease_expire_time.CopyFrom(_timestamp(lease.expire_wall))
                holder, run = self.store.holder_run(hits)
                if holder is not None:
                    response.holder.CopyFrom(pb.PageHolder(peer_id=holder[0], epoch=holder[1]))
                    response.holder_pages = run
                    ids, left = self.store.standing_run(hits[:run])
                    if ids:
                        response.holder_page_runs.extend(page_runs_proto(ids))
                        response.holder_standing_ms = int(left * 1e3)
        self._remember("get", request.request_id, response)
        return response

    async def PutPages(self, request: pb.PutPagesRequest, context: Ctx) -> pb.PutPagesResponse:
        self._check_running()
        if (seen := self._remembered("put", request.request_id)) is not None:
            return seen
        key = validate.namespace_key(request.namespace)
        keys = validate.keys(request.keys, self.settings, distinct=True)
        geo = validate.geometry(request.segment_bytes, self.settings, self.arena.chunk_bytes)
        lease_s = validate.lease_seconds(request.lease_seconds, self.settings)
        holder = validate.holder(request.holder) if request.HasField("holder") else None
        standing = validate.standing(request)
        ns = self.store.find(key)
        if ns is None:
            ns = self.store.create(key, geo)
        else:
            validate.same_geometry(ns, request.segment_bytes)
        indices, pages, evicted = self.store.put(ns, keys, lease_s)
        response = pb.PutPagesResponse(store_instance=self.arena.instance, evicted=evicted)
        if pages:
            stands = validate.standing_of(standing, indices, request.holder_standing_seconds)
            lease = self.store.write_lease(ns, pages, lease_s, holder=holder, standing=stands)
            response.reserved_indices.extend(indices)
            response.spans.extend(_spans(self.store, pages))
            response.lease_id = lease.id
            response.lease_expire_time.CopyFrom(_timestamp(lease.expire_wall))
        self._remember("put", request.request_id, response)
        return response

    async def CommitPut(self, request: pb.CommitPutRequest, context: Ctx) -> pb.CommitPutResponse:
        if (seen := self._remembered("commit", request.request_id)) is not None:
            return seen
        lease = self.store.begin_commit(validate.lease_id(request.lease_id))
        try:
            sums = validate.checksums(request.checksums, len(lease.pages))
            good = await asyncio.to_thread(self._verify, lease, sums)
        except BaseException:
            lease.committing = False
            raise
        if time.monotonic() > lease.expires:
            lease.committing = False  # a late commit must not publish pages whose slots may be reused
            self.store.sweep()
            raise LeaseExpired(f"lease {lease.id} expired during its commit", lease_id=lease.id)
        committed, failed = self.store.finish_commit(lease, good)
        response = pb.CommitPutResponse(committed=committed, checksum_failures=failed)
        self._remember("commit", request.request_id, response)
        return response

    def _verify(self, lease: Lease, sums: Sequence[bytes]) -> list[bool]:
        for page, want in zip(lease.pages, sums, strict=True):
            page.checksum = want
        geometry = lease.ns.geometry
        got = range_checksums(self.arena.page_ranges(geometry, [(p.chunk, p.slot) for p in lease.pages]))
        return [a == b for a, b in zip(got, sums, strict=True)]

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Ctx) -> pb.ReleaseLeaseResponse:
        if (seen := self._remembered("release", request.request_id)) is not None:
            return seen
        if len(request.corrupt_indices) > self.settings.max_keys_per_call:
            raise InvalidArgument("too many corrupt_indices", field="corrupt_indices")
        released = self.store.release(validate.lease_id(request.lease_id), request.corrupt_indices)
        response = pb.ReleaseLeaseResponse(released=released)
        self._remember("release", request.request_id, response)
        return response

    async def GetPageStoreStats(
        self, request: pb.GetPageStoreStatsRequest, context: Ctx
    ) -> pb.GetPageStoreStatsResponse:
        self.store.sweep()
        out = pb.GetPageStoreStatsResponse(
            capacity_bytes=self.arena.capacity_bytes,
            allocated_bytes=(len(self.arena.chunks) - len(self.arena.free_chunks)) * self.arena.chunk_bytes,
            pages=sum(ns.committed for ns in self.store.namespaces.values()),
            leases=self.store.live_leases(),
            store_instance=self.arena.instance,
        )
        for key in sorted(self.store.namespaces):
            ns = self.store.namespaces[key]
            c = ns.counters
            out.namespaces.append(
                pb.NamespaceStats(
                    contract_fingerprint=key[0],
                    salt_digest=key[1][:8].hex(),
                    rank=key[2],
                    page_bytes=ns.geometry.page_bytes,
                    pages=ns.committed,
                    bytes=ns.committed * ns.geometry.page_bytes,
                    hits=c.hits,
                    misses=c.misses,
                    evictions=c.evictions,
                    leases=ns.leases,
                    checksum_failures=c.checksum_failures,
                    leases_expired=c.leases_expired,
                    reservations_dropped=c.reservations_dropped,
                    reserved_pages=ns.reserved,
                    pinned_pages=ns.pinned,
                )
            )
        return out
