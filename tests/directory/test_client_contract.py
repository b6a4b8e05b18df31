"""The DirectoryClient covers every DirectoryService RPC; bounded UNAVAILABLE-only retries; deadlines."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc

from xavier_core.directory import DirectoryClient
from xavier_core.runtime import NotFound, Unavailable, XavierError, abort_with
from xavier_core.runtime.channels import open_channel
from xavier_core.runtime.retry import retry_unavailable

_NAMED_OTHERWISE = {"GetDirectoryStats": "get_stats"}
"""RPCs whose client method is not the plain snake_case of the RPC name."""


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_client_has_a_method_for_every_rpc() -> None:
    service = dpb.DESCRIPTOR.services_by_name["DirectoryService"]
    missing = []
    for rpc in service.methods:
        name = _NAMED_OTHERWISE.get(rpc.name, _snake(rpc.name))
        method = getattr(DirectoryClient, name, None)
        if method is None:
            missing.append(f"{rpc.name} -> DirectoryClient.{name}")
            continue
        # The method is the one that calls this RPC, not a namesake.
        assert f"self.stub.{rpc.name}" in inspect.getsource(method), f"{name} does not call {rpc.name}"
    assert not missing, f"RPCs without a client method: {missing}"


class _Flaky(dpb_grpc.DirectoryServiceServicer):
    """GetRoom fails `fail` times with UNAVAILABLE (or NOT_FOUND), or is slow; ListPeers answers big."""

    def __init__(self, fail: int = 0, not_found: bool = False, delay: float = 0.0) -> None:
        self.fail, self.not_found, self.delay = fail, not_found, delay
        self.calls = 0

    async def GetRoom(self, request: dpb.GetRoomRequest, context: Any) -> dpb.GetRoomResponse:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.not_found:
            await abort_with(context, NotFound("no such room", reason="ROOM_NOT_FOUND"))
        if self.calls <= self.fail:
            await abort_with(context, Unavailable("try again", reason="SHUTTING_DOWN"))
        return dpb.GetRoomResponse(room=dpb.Room(room_id=request.room_id))

    async def ListPeers(self, request: dpb.ListPeersRequest, context: Any) -> dpb.ListPeersResponse:
        return dpb.ListPeersResponse(peers=[dpb.Peer(peer_id=f"p{i:04d}") for i in range(200)])


@pytest.fixture
async def serve() -> AsyncIterator[Any]:
    servers: list[grpc.aio.Server] = []

    async def start(servicer: _Flaky) -> str:
        server = grpc.aio.server()
        dpb_grpc.add_DirectoryServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(None)


async def test_unavailable_is_retried_bounded(serve: Any) -> None:
    flaky = _Flaky(fail=2)
    async with DirectoryClient(await serve(flaky), retries=2, retry_backoff=0.001) as client:
        assert (await client.get_room(7)).room_id == 7
        assert flaky.calls == 3
    always = _Flaky(fail=100)
    async with DirectoryClient(await serve(always), retries=2, retry_backoff=0.001) as client:
        with pytest.raises(Unavailable) as info:
            await client.get_room(7)
        assert info.value.reason == "SHUTTING_DOWN" and always.calls == 3


async def test_other_errors_are_not_retried(serve: Any) -> None:
    missing = _Flaky(not_found=True)
    async with DirectoryClient(await serve(missing), retries=5, retry_backoff=0.001) as client:
        with pytest.raises(NotFound) as info:
            await client.get_room(7)
        assert info.value.reason == "ROOM_NOT_FOUND" and missing.calls == 1


async def test_every_call_has_a_deadline(serve: Any) -> None:
    async with DirectoryClient(await serve(_Flaky(delay=5.0)), timeout=0.2, retries=0) as client:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(XavierError) as info:
            await client.get_room(7)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert asyncio.get_running_loop().time() - t0 < 2.0


async def test_channel_enforces_the_message_size_limit(serve: Any) -> None:
    address = await serve(_Flaky())
    async with open_channel(address) as channel:
        assert len(await DirectoryClient(channel=channel).list_peers()) == 200
    async with open_channel(address, max_message_bytes=512) as channel:
        with pytest.raises(XavierError) as info:
            await DirectoryClient(channel=channel).list_peers()
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_retry_helper_calls_on_retry_and_rejects_no_attempts() -> None:
    failures: list[str] = []
    outcomes: list[Exception | str] = [
        Unavailable("a", reason="SHUTTING_DOWN"),
        Unavailable("b", reason="PEER_UNAVAILABLE"),
        "ok",
    ]

    async def step() -> str:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    got = await retry_unavailable(
        step, attempts=3, base_delay=0.001, max_delay=0.001, on_retry=lambda e: failures.append(e.reason)
    )
    assert got == "ok" and failures == ["SHUTTING_DOWN", "PEER_UNAVAILABLE"]
    with pytest.raises(ValueError):
        await retry_unavailable(step, attempts=0, base_delay=0.001, max_delay=0.001)
