"""The HTTP front's guard against held-open connections (real sockets on loopback): partial headers are
cut off at the header deadline, one connection past the cap is refused with a JSON 503, a kept-alive
connection serves requests and is then held to the deadline again, and a body that stops arriving is
answered 408 REQUEST_TIMEOUT by the OpenAI front."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from xavier_services.router.http_guard import ConnectionGuard
from xavier_services.router.openai_http import OpenAiFront

pytestmark = pytest.mark.asyncio


async def _serve(app: web.Application, max_connections: int, header_timeout: float) -> AsyncIterator[int]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    assert runner.server is not None
    server = await asyncio.get_running_loop().create_server(
        ConnectionGuard(runner.server, max_connections, header_timeout), "127.0.0.1", 0
    )
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await runner.cleanup()


async def _hello(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


@pytest.fixture
async def port() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/", _hello)
    async for p in _serve(app, max_connections=3, header_timeout=0.3):
        yield p


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), 20)  # the server closes: read() returns at EOF


async def test_partial_headers_are_cut_off(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
    await writer.drain()
    assert await _read_all(reader) == b""
    writer.close()


async def test_a_connection_past_the_cap_is_refused_and_a_slot_frees_when_one_closes(port: int) -> None:
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    refused = await _read_all(reader)
    assert refused.startswith(b"HTTP/1.1 503") and b"TOO_MANY_CONNECTIONS" in refused
    writer.close()
    for _, w in held:
        w.close()
    await asyncio.sleep(0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert b'{"ok": true}' in await _read_all(reader)
    writer.close()


async def test_a_kept_alive_connection_serves_then_is_held_to_the_deadline(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(2):
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        length = int(
            next(
                v
                for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n"))
                if k.lower() == b"content-length"
            )
        )
        assert json.loads(await reader.readexactly(length)) == {"ok": True}
    writer.write(b"GET / HTTP/1.1\r\n")  # the third request stalls in its headers
    assert await _read_all(reader) == b""
    writer.close()


async def test_a_body_that_stops_arriving_is_answered_408() -> None:
    config = SimpleNamespace(http_max_body_bytes=1 << 20, http_body_timeout_seconds=0.3, bearer_token="")
    front: Any = OpenAiFront(SimpleNamespace(config=config))  # type: ignore[arg-type]
    async for p in _serve(front.app(), max_connections=8, header_timeout=5):
        reader, writer = await asyncio.open_connection("127.0.0.1", p)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        await writer.drain()
        answer = await _read_all(reader)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "REQUEST_TIMEOUT"
        writer.close()
