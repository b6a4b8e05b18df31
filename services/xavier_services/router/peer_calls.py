"""The router's calls to prefill and decode peers: on the peer's call session when it declares one
(SERVICE_FEATURE_CALL_SESSIONS) and the router allows them (`peer_sessions`), else one RPC each.

Either way the flows get a call with grpc.aio's surface (awaited, or read to `grpc.aio.EOF`;
`cancel()`, `wait_for_connection()`) that fails with a `grpc.aio.AioRpcError` of the same status and
ErrorInfo, so their failure handling (`flows.peer_failures`), failover and migration do not tell the
two apart. A session per peer address and service lives as long as the channel (`PeerPool.session`).
"""

from __future__ import annotations

from typing import Any

from xavier.v1 import decode_service_pb2 as decpb
from xavier.v1 import decode_service_pb2_grpc as decpb_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pfpb
from xavier.v1 import prefill_service_pb2_grpc as pfpb_grpc
from xavier.v1 import types_pb2

from xavier_core.runtime.session_client import CallSession
from xavier_services.router.peers import PeerPool


def _declares_sessions(peer: dpb.Peer) -> bool:
    return types_pb2.SERVICE_FEATURE_CALL_SESSIONS in peer.layout.service_features


def _session(pool: PeerPool, peer: dpb.Peer, service: str) -> CallSession | None:
    if not pool.peer_sessions or not _declares_sessions(peer):
        return None
    return pool.session(peer.address, service, lambda: _open(pool, peer.address, service))


def _open(pool: PeerPool, address: str, service: str) -> CallSession:
    channel = pool.channel(address)
    if service == "prefill":
        stub = pfpb_grpc.PrefillServiceStub(channel)
        return CallSession(
            stub.PrefillSession, pfpb.PrefillSessionRequest, pfpb.PrefillSessionCall, "prefill"
        )
    dec = decpb_grpc.DecodeServiceStub(channel)
    return CallSession(dec.DecodeSession, decpb.DecodeSessionRequest, decpb.DecodeSessionCall, "decode")


def prefill(pool: PeerPool, peer: dpb.Peer, request: pfpb.PrefillRequest, timeout: float) -> Any:
    """`Prefill` on `peer`: awaitable for its `PrefillResponse`, cancellable."""
    session = _session(pool, peer, "prefill")
    if session is None:
        return pfpb_grpc.PrefillServiceStub(pool.channel(peer.address)).Prefill(request, timeout=timeout)
    return session.unary("prefill", request, request_id=request.request_id, timeout=timeout)


def release_source(pool: PeerPool, peer: dpb.Peer, request: pfpb.ReleaseSourceRequest, timeout: float) -> Any:
    """`ReleaseSource` on `peer`: awaitable for its `ReleaseSourceResponse`."""
    session = _session(pool, peer, "prefill")
    if session is None:
        stub = pfpb_grpc.PrefillServiceStub(pool.channel(peer.address))
        return stub.ReleaseSource(request, timeout=timeout)
    return session.unary("release_source", request, request_id=request.request_id, timeout=timeout)


def decode(pool: PeerPool, peer: dpb.Peer, request: decpb.DecodeRequest, timeout: float) -> Any:
    """`Decode` on `peer`: read to `grpc.aio.EOF`, cancellable, `wait_for_connection()`."""
    session = _session(pool, peer, "decode")
    if session is None:
        return decpb_grpc.DecodeServiceStub(pool.channel(peer.address)).Decode(request, timeout=timeout)
    return session.stream("decode", request, request_id=request.request_id, timeout=timeout)


__all__ = ["decode", "prefill", "release_source"]
