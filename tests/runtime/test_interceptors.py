"""Request ids, contextvars, per-RPC metrics, /metrics and message-size limits on a real server."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from typing import Any

import grpc
import structlog
from prometheus_client import REGISTRY

from xavier_core.runtime import REQUEST_ID_KEY, current_request_id

from .conftest import SERVICE


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_request_id_propagated_generated_and_bound(serve_handlers: Any) -> None:
    seen: list[dict[str, Any]] = []

    async def echo(request: bytes, context: Any) -> bytes:
        seen.append({**structlog.contextvars.get_contextvars(), "current": current_request_id()})
        return request

    handle = await serve_handlers({"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    async with grpc.aio.insecure_channel(handle.address) as channel:
        method = channel.unary_unary(f"/{SERVICE}/Echo")
        given = method(b"a", metadata=((REQUEST_ID_KEY, "req-42"),), timeout=5)
        assert await given == b"a"
        fresh = method(b"b", timeout=5)
        await fresh
        bogus = method(b"c", metadata=((REQUEST_ID_KEY, "not a token; " + "x" * 200),), timeout=5)
        await bogus
        given_trailer = dict(await given.trailing_metadata())[REQUEST_ID_KEY]
        fresh_trailer = dict(await fresh.trailing_metadata())[REQUEST_ID_KEY]
        bogus_trailer = dict(await bogus.trailing_metadata())[REQUEST_ID_KEY]

    assert given_trailer == "req-42"
    assert re.fullmatch(r"[0-9a-f]{32}", fresh_trailer)
    assert re.fullmatch(r"[0-9a-f]{32}", bogus_trailer)
    assert [s["request_id"] for s in seen] == ["req-42", fresh_trailer, bogus_trailer]
    assert [s["current"] for s in seen] == ["req-42", fresh_trailer, bogus_trailer]
    assert seen[0]["rpc"] == f"/{SERVICE}/Echo"
    # Bindings end with the call: the test's own context never saw them.
    assert "request_id" not in structlog.contextvars.get_contextvars()


async def test_metrics_count_codes_and_time_streams(serve_handlers: Any) -> None:
    async def ok(request: bytes, context: Any) -> bytes:
        return b"ok"

    async def not_found(request: bytes, context: Any) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "nope")
        return b""

    async def writes(request: bytes, context: Any) -> None:
        # A coroutine stream handler (context.write), like the health Watch.
        for chunk in (b"x", b"y", b"z"):
            await context.write(chunk)

    handle = await serve_handlers(
        {
            "MetricsOk": grpc.unary_unary_rpc_method_handler(ok),
            "MetricsMissing": grpc.unary_unary_rpc_method_handler(not_found),
            "MetricsWrites": grpc.unary_stream_rpc_method_handler(writes),
        }
    )
    labels = {"service": SERVICE}
    before_ok = _sample("xavier_rpc_total", **labels, method="MetricsOk", code="OK")
    before_nf = _sample("xavier_rpc_total", **labels, method="MetricsMissing", code="NOT_FOUND")
    before_hist = _sample("xavier_rpc_seconds_count", **labels, method="MetricsWrites")
    async with grpc.aio.insecure_channel(handle.address) as channel:
        for _ in range(3):
            await channel.unary_unary(f"/{SERVICE}/MetricsOk")(b"", timeout=5)
        try:
            await channel.unary_unary(f"/{SERVICE}/MetricsMissing")(b"", timeout=5)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
        items = [i async for i in channel.unary_stream(f"/{SERVICE}/MetricsWrites")(b"", timeout=5)]
    assert items == [b"x", b"y", b"z"]
    assert _sample("xavier_rpc_total", **labels, method="MetricsOk", code="OK") == before_ok + 3
    assert _sample("xavier_rpc_total", **labels, method="MetricsMissing", code="NOT_FOUND") == before_nf + 1
    assert _sample("xavier_rpc_seconds_count", **labels, method="MetricsWrites") == before_hist + 1

    assert handle.metrics_address is not None
    url = f"http://{handle.metrics_address}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    line = f'xavier_rpc_total{{code="OK",method="MetricsOk",service="{SERVICE}"}}'
    assert any(row.startswith(line) and float(row.split()[-1]) >= 3 for row in body.splitlines())
    assert "xavier_rpc_seconds_bucket" in body


async def test_cancelled_stream_is_counted_cancelled(serve_handlers: Any) -> None:
    finished = asyncio.Event()

    async def forever(request: bytes, context: Any) -> Any:
        try:
            while True:
                yield b"tick"
                await asyncio.sleep(0.01)
        finally:
            finished.set()

    handle = await serve_handlers({"Forever": grpc.unary_stream_rpc_method_handler(forever)})
    labels = {"service": SERVICE, "method": "Forever", "code": "CANCELLED"}
    before = _sample("xavier_rpc_total", **labels)
    async with grpc.aio.insecure_channel(handle.address) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Forever")(b"", timeout=5)
        assert await call.read() == b"tick"
        call.cancel()
        await asyncio.wait_for(finished.wait(), 5)
    for _ in range(100):
        if _sample("xavier_rpc_total", **labels) == before + 1:
            break
        await asyncio.sleep(0.02)
    assert _sample("xavier_rpc_total", **labels) == before + 1


async def test_message_size_limit(serve_handlers: Any) -> None:
    async def echo(request: bytes, context: Any) -> bytes:
        return request

    handle = await serve_handlers({"Echo": grpc.unary_unary_rpc_method_handler(echo)}, max_message_bytes=4096)
    async with grpc.aio.insecure_channel(handle.address) as channel:
        method = channel.unary_unary(f"/{SERVICE}/Echo")
        assert await method(b"a" * 1000, timeout=5) == b"a" * 1000
        try:
            await method(b"a" * 10_000, timeout=5)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            raise AssertionError("oversized message accepted")
