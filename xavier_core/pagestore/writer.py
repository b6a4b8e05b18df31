"""The bounded write-through queue: writes leave the caller at once, overload drops them (counted)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

NS = TypeVar("NS")
WriteFn = Callable[[NS, Sequence[bytes], Sequence[int], float], Awaitable[int]]
"""`(namespace, keys, pages, seconds the pages stand after it) -> pages committed`."""
Done = Callable[[int], None]
_Item = tuple[NS, list[bytes], list[int], Done | None, float]


class WriteQueue(Generic[NS]):
    """At most `maxsize` queued writes, run one at a time by a task started with the first submit."""

    def __init__(self, write: WriteFn[NS], maxsize: int, on_drop: Callable[[], None]) -> None:
        self._write = write
        self._maxsize = maxsize
        self._on_drop = on_drop
        self._queue: asyncio.Queue[_Item[NS]] | None = None
        self._task: asyncio.Task[None] | None = None

    def submit(
        self, namespace: NS, keys: list[bytes], pages: list[int], done: Done | None, stand_s: float = 0.0
    ) -> bool:
        """Queues a write; False (and `done(0)` at once) when the queue is full."""
        if self._queue is None:
            self._queue = asyncio.Queue(self._maxsize)
            self._task = asyncio.get_running_loop().create_task(
                self._run(self._queue), name="pagestore-writer"
            )
        try:
            self._queue.put_nowait((namespace, keys, pages, done, stand_s))
        except asyncio.QueueFull:
            self._on_drop()
            if done is not None:
                done(0)
            return False
        return True

    async def flush(self) -> None:
        if self._queue is not None:
            await self._queue.join()

    async def close(self) -> None:
        """Stops the task; queued writes are dropped, each `done(0)` called."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while self._queue is not None and not self._queue.empty():
            done = self._queue.get_nowait()[3]
            if done is not None:
                done(0)

    async def _run(self, queue: asyncio.Queue[_Item[NS]]) -> None:
        while True:
            namespace, keys, pages, done, stand_s = await queue.get()
            committed = 0
            try:
                committed = await self._write(namespace, keys, pages, stand_s)
            except Exception:  # the write fn counts store trouble itself; anything else must not stop us
                log.exception("page store write-through failed")
            finally:
                if done is not None:
                    try:
                        done(committed)
                    except Exception:  # a caller's callback must not stop the writer for everyone
                        log.exception("page store write-through callback failed")
                queue.task_done()
