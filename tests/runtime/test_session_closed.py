"""A call session the router retired (its peer left the directory: session closed, channel closed) and a
request that still holds it: the call fails UNAVAILABLE, as on any broken session, so the router fails
over; it does not raise grpc's UsageError out of the flow (in process, real grpc.aio)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from xavier.v1 import prefill_service_pb2 as pre

from .test_session_stop import _caller, _session_handler


@pytest.mark.parametrize("kind", ["unary", "stream"])
async def test_a_call_on_a_closed_session_fails_unavailable(serve_handlers: Any, kind: str) -> None:
    async def prefill(request: pre.PrefillRequest, context: Any) -> pre.PrefillResponse:
        return pre.PrefillResponse(first_token=7)

    handle = await serve_handlers({"Session": _session_handler(prefill)})
    channel = grpc.aio.insecure_channel(handle.address)
    session = _caller(channel)
    first = await session.unary("prefill", pre.PrefillRequest(request_id="a"), request_id="a", timeout=5)
    assert first.first_token == 7
    await session.close()  # what the router's retirement does: the sessions, then the channel
    await channel.close()
    late = getattr(session, kind)("prefill", pre.PrefillRequest(request_id="b"), request_id="b", timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if kind == "unary":
            await late
        else:
            async for _ in late:
                pass
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "closed" in (caught.value.details() or "")
    assert session.opened == 1  # no stream was tried on the closed channel
