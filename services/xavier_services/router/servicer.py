"""The gRPC `RouterService` over the shared `Router`."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from xavier.v1 import decode_service_pb2 as decpb
from xavier.v1 import decode_service_pb2_grpc as decpb_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pfpb
from xavier.v1 import prefill_service_pb2_grpc as pfpb_grpc
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import router_service_pb2_grpc as rpb_grpc
from xavier.v1 import types_pb2

from xavier_core.runtime import InvalidArgument, XavierError, abort_with, from_rpc_error
from xavier_services.router.core import Router
from xavier_services.router.health import peer_key
from xavier_services.router.workers import Siblings

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class RouterServicer(rpb_grpc.RouterServiceServicer):  # type: ignore[misc]
    """Generate, Abort, ListModels and GetClusterStatus. With `siblings` (a router of several processes)
    an Abort of a request this process does not serve is asked of the others, and the status counts
    every process's requests."""

    def __init__(self, router: Router, siblings: Siblings | None = None) -> None:
        self.router = router
        self.siblings = siblings

    async def Generate(
        self, request: rpb.GenerateRequest, context: Context
    ) -> AsyncIterator[rpb.GenerateResponse]:
        prep = await self.router.prepare_async(request)
        async for resp in self.router.generate(prep):
            yield resp

    async def Abort(self, request: rpb.AbortRequest, context: Context) -> rpb.AbortResponse:
        if not request.request_id:
            raise InvalidArgument("request_id is required", reason="MISSING_REQUEST_ID")
        found = self.router.abort(request.request_id)
        if not found and self.siblings is not None:
            found = any(await self.siblings.others({"op": "abort", "id": request.request_id}))
        return rpb.AbortResponse(found=found)

    async def ListModels(self, request: rpb.ListModelsRequest, context: Context) -> rpb.ListModelsResponse:
        if request.page_token:  # one model per router: there is never a second page
            raise InvalidArgument("unknown page_token", reason="INVALID_PAGE_TOKEN")
        return rpb.ListModelsResponse(models=[await model_entry(self.router)])

    async def GetClusterStatus(
        self, request: rpb.GetClusterStatusRequest, context: Context
    ) -> rpb.GetClusterStatusResponse:
        status = await cluster_status(self.router)
        if self.siblings is not None:
            status.requests_active += sum(await self.siblings.others({"op": "active"}))
        return status


async def model_entry(router: Router) -> rpb.Model:
    """The served model with the layout of its peers and the modes that can serve it now."""
    layout = None
    for peer in await _peers_or_empty(router):
        if peer.HasField("layout"):
            layout = peer.layout
            break
    return rpb.Model(
        id=router.model.name,
        layout=layout,
        max_context=router.model.max_context,
        modes=await router.available_modes(),
    )


async def _peers_or_empty(router: Router) -> list[dpb.Peer]:
    try:
        return await router.pool.peers()
    except XavierError:
        return []


def cluster_peer(peer: dpb.Peer) -> rpb.ClusterPeer:
    """The public view of a directory peer: identity, model and load, never its transfer endpoint."""
    return rpb.ClusterPeer(
        peer_id=peer.peer_id,
        role=peer.role,
        epoch=peer.epoch,
        address=peer.address,
        model_name=peer.layout.model_name,
        contract_fingerprint=peer.contract_fingerprint,
        outstanding_requests=peer.load.outstanding_requests,
    )


def cluster_rooms(stats: dpb.GetDirectoryStatsResponse) -> rpb.ClusterRooms:
    """The directory's room counters, without its per-state and per-role maps."""
    return rpb.ClusterRooms(
        active=stats.rooms_active,
        opened=stats.rooms_opened,
        completed=stats.rooms_completed,
        aborted=stats.rooms_aborted,
        expired=stats.rooms_expired,
    )


async def _peer_status(router: Router, peer: dpb.Peer) -> rpb.ClusterPeer:
    # Each peer gets its own short deadline and all are asked at once: a stalled peer shows as an error
    # in its entry and never holds up the answer.
    timeout = router.config.status_peer_timeout_seconds
    status = cluster_peer(peer)
    if not router.pool.health.is_up(peer):
        status.error = f"out of selection: {router.pool.health.down.get(peer_key(peer), 'unhealthy')}"
    try:
        ch = router.pool.channel(peer.address)
        if peer.role == types_pb2.ROLE_PREFILL:
            p = await pfpb_grpc.PrefillServiceStub(ch).GetPrefillStats(
                pfpb.GetPrefillStatsRequest(), timeout=timeout
            )
            status.engine.CopyFrom(p.engine)
            status.rooms_active = p.rooms_active
        elif peer.role in (types_pb2.ROLE_DECODE, types_pb2.ROLE_UNIFIED):
            d = await decpb_grpc.DecodeServiceStub(ch).GetDecodeStats(
                decpb.GetDecodeStatsRequest(), timeout=timeout
            )
            status.engine.CopyFrom(d.engine)
            status.rooms_active = d.rooms_active
    except grpc.aio.AioRpcError as exc:
        err = from_rpc_error(exc)
        # The transport's text names internal addresses; the entry already says which peer it is.
        status.error = f"{err.code.name}: stats call failed" if err.reason == err.code.name else str(err)
    return status


async def cluster_status(router: Router) -> rpb.GetClusterStatusResponse:
    """Every peer's stats (fetched concurrently, each with a deadline) and the directory's room counters."""
    resp = rpb.GetClusterStatusResponse(requests_active=router.active)
    peers = await _peers_or_empty(router)
    statuses = await asyncio.gather(*(_peer_status(router, p) for p in peers))
    resp.peers.extend(statuses)
    if router.pool.directory is not None:
        try:
            resp.rooms.CopyFrom(cluster_rooms(await router.pool.directory.get_stats()))
        except XavierError:
            pass  # rooms stays unset: the contract's sign that the directory could not be read
    try:
        resp.default_mode = await router.default_mode()
    except XavierError:
        resp.default_mode = rpb.ROUTING_MODE_UNSPECIFIED
    return resp


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Requires `authorization: Bearer <token>` on RouterService calls (health and reflection stay open)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not details.method.startswith("/xavier.v1.RouterService/"):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return await continuation(details)
        return _deny(await continuation(details))


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    err = XavierError("missing or wrong bearer token", reason="UNAUTHENTICATED")
    err.code = grpc.StatusCode.UNAUTHENTICATED

    async def unary(request: Any, context: Context) -> Any:
        await abort_with(context, err)

    async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
        await abort_with(context, err)
        yield  # pragma: no cover

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        unary, handler.request_deserializer, handler.response_serializer
    )
