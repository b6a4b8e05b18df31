"""The end of a transfer still running after it failed: its pages stay out of use until it is told.

A read or write that failed while NIXL (or a CUDA copy) may still touch its pages cannot have them freed;
the one that holds them asks again every `REAP_POLL_S` whether it has ended (`poll_until`), and a future
(`released_when`) completes then, on which whoever keeps the pages gives them back (`on_success`). Nothing
here imports gRPC: the engine uses it too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

__all__ = ["REAP_POLL_S", "on_success", "poll_until", "released_when"]

log = logging.getLogger(__name__)

REAP_POLL_S = 1.0
"""How often a transfer still running after it failed (its pages kept out of use) is asked again whether it
has ended, so the pages can go back."""


async def poll_until(probe: Callable[[], Awaitable[bool]], interval: float = REAP_POLL_S) -> None:
    """Returns once `probe()` says True, asking again every `interval` seconds."""
    while True:
        if await probe():
            return
        await asyncio.sleep(interval)


def released_when(
    ended: Callable[[], Awaitable[object]], start: Callable[[Coroutine[Any, Any, None]], None], what: str
) -> asyncio.Future[None]:
    """A future that completes once `ended()` returns, awaited in a call handed to `start` (a
    `Background`'s, which its owner cancels on close): the end of `what`. It stays pending if `ended()`
    raises (the end can no longer be told) or the call is cancelled: whatever waits on it stays out of
    use."""
    released: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def wait() -> None:
        try:
            await ended()
        except Exception:
            log.exception("the end of a stuck %s can no longer be told", what)
            return
        log.info("a stuck %s has ended; its pages may be used again", what)
        released.set_result(None)

    start(wait())
    return released


def on_success(future: asyncio.Future[None], fn: Callable[[], None]) -> None:
    """Calls `fn()` once `future` completes with a result (never if it fails or is cancelled)."""

    def done(f: asyncio.Future[None]) -> None:
        if not f.cancelled() and f.exception() is None:
            fn()

    future.add_done_callback(done)
