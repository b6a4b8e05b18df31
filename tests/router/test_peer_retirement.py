"""A router keeps connections only to peers the directory lists: the channel and the call sessions of an
address the peer list has lacked for `retire_after` are closed, and an address listed again is dialled
anew."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xavier.v1 import decode_service_pb2 as dec
from xavier.v1 import decode_service_pb2_grpc as dec_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.router.peers import PeerPool

from tests.runtime.test_channels import plaintext_server
from xavier_core.runtime.session_client import CallSession

__all__ = ["plaintext_server"]  # a real gRPC server (health only) on loopback


def _peer(address: str) -> dpb.Peer:
    return dpb.Peer(peer_id="decode-0", role=types_pb2.ROLE_DECODE, address=address, contract_fingerprint="f")


async def _check(channel: grpc.aio.Channel) -> int:
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(resp.status)


async def test_a_departed_peers_channel_and_sessions_are_closed(plaintext_server: str) -> None:
    server = plaintext_server
    pool = PeerPool("", rpc_timeout=1.0, refresh_seconds=0.0, attempts=1, retire_after=0.2)
    listed = [_peer(server)]

    async def list_all() -> list[dpb.Peer]:
        return list(listed)

    pool._list_all = list_all  # type: ignore[method-assign]  # the directory's answer, as the test sets it
    try:
        await pool.peers()
        channel = pool.channel(server)
        assert await _check(channel) == health_pb2.HealthCheckResponse.SERVING

        def make() -> CallSession:
            stub = dec_grpc.DecodeServiceStub(channel)
            return CallSession(stub.DecodeSession, dec.DecodeSessionRequest, dec.DecodeSessionCall, "decode")

        pool.session(server, "decode", make)
        listed.clear()  # the peer left the directory
        await pool.peers()
        assert pool.channel(server) is channel and pool.retired == 0  # not yet: within retire_after
        await asyncio.sleep(0.3)
        await pool.peers()
        assert pool.retired == 1
        for task in list(pool._retiring):
            await task
        with pytest.raises((grpc.aio.UsageError, RuntimeError, ValueError)):
            await _check(channel)  # closed
        assert (server, "decode") not in pool._sessions
        listed.append(_peer(server))  # it came back at the same address: dialled anew
        await pool.peers()
        fresh = pool.channel(server)
        assert fresh is not channel
        assert await _check(fresh) == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(0.3)
        await pool.peers()
        assert pool.retired == 1 and pool.channel(server) is fresh  # a listed address is never retired
    finally:
        await pool.close()
