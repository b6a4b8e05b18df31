"""SSE keepalive comments on a streamed response that is quiet for a while.

`Keepalive` writes from a task of its own, started once the response is prepared (before that the
status is still open, for a clean error). The stream's reader only notes when each item arrived
(`touch`): nothing per item is created, scheduled or awaited for the keepalive's sake. A comment that
finds the client gone says so (`on_lost`), so a quiet answer's reader stops at once, as its own write
would have made it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

COMMENT = b": keepalive\n\n"


class Keepalive:
    """Writes `COMMENT` through `write` whenever `interval` seconds passed since the last `touch` (or
    the last comment). `stop` ends it. A write that fails ends it: one that found the connection gone
    calls `on_lost` first (the reader's task is cancelled there, as a client that left cancels it)."""

    __slots__ = ("_interval", "_last", "_loop", "_on_lost", "_task", "_write")

    def __init__(
        self,
        write: Callable[[bytes], Awaitable[object]],
        interval: float,
        on_lost: Callable[[], object] | None = None,
    ) -> None:
        self._write, self._interval, self._on_lost = write, interval, on_lost
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._last = self._loop.time()
            self._task = asyncio.create_task(self._run())

    def touch(self) -> None:
        """An item arrived now."""
        self._last = self._loop.time()

    async def stop(self) -> None:
        """Ends the task; after this no comment is written."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        try:
            while True:
                wait = self._last + self._interval - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                self._last = self._loop.time()
                await self._write(COMMENT)
        except ConnectionError:  # the client left
            if self._on_lost is not None:
                self._on_lost()
        except Exception:  # the response ended meanwhile: nothing is owed
            return
