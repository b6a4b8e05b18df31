"""A stopping server and its call sessions (in process, real grpc.aio): a call running on an open session
finishes within the grace, and a session opened while the server stops is refused at once, so it runs
no call and holds nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from xavier.v1 import prefill_service_pb2 as pre

from xavier_core.runtime import session as sessions
from xavier_core.runtime.session import SessionMethod, serve_session
from xavier_core.runtime.session_client import CallSession

from .conftest import SERVICE


def _session_handler(prefill: Any) -> grpc.RpcMethodHandler:
    async def session(requests: Any, context: Any) -> None:
        await serve_session(
            requests,
            context,
            rpc="Session",
            roles=("router",),
            methods=[SessionMethod("prefill", f"/{SERVICE}/Prefill", prefill)],
            result=pre.PrefillSessionResult,
            response=pre.PrefillSessionResponse,
        )

    return grpc.stream_stream_rpc_method_handler(
        session,
        request_deserializer=pre.PrefillSessionRequest.FromString,
        response_serializer=pre.PrefillSessionResponse.SerializeToString,
    )


def _caller(channel: grpc.aio.Channel) -> CallSession:
    open_stream = channel.stream_stream(
        f"/{SERVICE}/Session",
        request_serializer=pre.PrefillSessionRequest.SerializeToString,
        response_deserializer=pre.PrefillSessionResponse.FromString,
    )
    return CallSession(open_stream, pre.PrefillSessionRequest, pre.PrefillSessionCall, "prefill")


async def test_a_session_opened_while_the_server_stops_is_refused(serve_handlers: Any) -> None:
    gate, running_started = asyncio.Event(), asyncio.Event()
    started: list[str] = []

    async def prefill(request: pre.PrefillRequest, context: Any) -> pre.PrefillResponse:
        started.append(request.request_id)
        running_started.set()
        await gate.wait()
        return pre.PrefillResponse(first_token=7)

    handle = await serve_handlers({"Session": _session_handler(prefill)})
    address = handle.address
    async with grpc.aio.insecure_channel(address) as first_ch, grpc.aio.insecure_channel(address) as late_ch:
        first = _caller(first_ch)
        running = first.unary(
            "prefill", pre.PrefillRequest(request_id="running"), request_id="running", timeout=30
        )
        await running_started.wait()
        stopping = asyncio.ensure_future(handle.shutdown(grace=30))
        # Until the open session was told to end (it waits for its running call), then a new one.
        for _ in range(3000):
            if any(s.closing for s in list(sessions._LIVE)):
                break
            await asyncio.sleep(0.01)
        late = _caller(late_ch)
        refused = late.unary("prefill", pre.PrefillRequest(request_id="late"), request_id="late", timeout=5)
        try:
            await refused
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        else:
            raise AssertionError("a session opened while the server stops ran a call")
        assert started == ["running"]  # the late call never reached the servicer
        gate.set()
        answer = await running  # the call in flight finishes within the grace
        assert answer.first_token == 7
        await first.close()
        await stopping
