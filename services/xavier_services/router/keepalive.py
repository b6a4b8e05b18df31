"""Ticks between the items of a slow async stream, so the HTTP front can send SSE keepalive comments."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class Tick:
    """No item arrived for one interval."""


TICK = Tick()


async def with_ticks(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | Tick]:
    """The items of `source`, with `TICK` after every `interval` seconds without one.

    The pending read is never cancelled by a tick (cancelling an async generator's `__anext__` would
    close it); it stays in flight across ticks and is cancelled only when the consumer stops.
    """
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield TICK
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait({pending})  # the source is not running when its owner closes it
