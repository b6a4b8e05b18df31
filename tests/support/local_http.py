"""A local HTTP server whose `/generate` is a test's handler (SGLang's answers shaped by hand)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def generate_server(generate: Handler) -> AsyncIterator[str]:
    """Serves POST /generate on 127.0.0.1:0 with `generate`; yields the base URL. The clean-up waits
    for handlers still running."""
    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def stalled(request: web.Request) -> web.StreamResponse:
    """Starts an answer and sends nothing for 1.5 s (past a short client timeout)."""
    resp = web.StreamResponse()
    await resp.prepare(request)
    await asyncio.sleep(1.5)
    return resp
