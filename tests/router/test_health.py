"""The router's peer health: a real grpc.health.v1 server goes NOT_SERVING, SERVING, then away."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.router.health import PeerHealth


async def test_probe_takes_out_and_readmits() -> None:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    peer = dpb.Peer(peer_id="decode-x", epoch=3, role=types_pb2.ROLE_DECODE, address=f"127.0.0.1:{port}")
    channels: dict[str, grpc.aio.Channel] = {}

    def channel(address: str) -> grpc.aio.Channel:
        return channels.setdefault(address, grpc.aio.insecure_channel(address))

    changes: list[tuple[str, bool]] = []
    h = PeerHealth(
        channel, interval=0.1, timeout=1.0, on_change=lambda p, up, why: changes.append((p.peer_id, up))
    )
    try:
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await h.probe_all([peer])
        assert h.is_up(peer)
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await h.probe_all([peer])
        assert not h.is_up(peer)
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await h.probe_all([peer])
        assert h.is_up(peer)
        # A call that saw the peer fail takes it out at once; a new epoch of it is a new peer.
        h.mark_down(peer, "call failed: UNAVAILABLE")
        assert not h.is_up(peer) and h.is_up(dpb.Peer(peer_id="decode-x", epoch=4))
        await server.stop(0)
        await h.probe_all([peer])
        assert not h.is_up(peer)
        assert changes == [("decode-x", False), ("decode-x", True), ("decode-x", False)]
        # A peer the directory no longer lists is forgotten.
        await h.probe_all([])
        assert h.down == {}
    finally:
        await server.stop(0)
        for ch in channels.values():
            await ch.close()
