"""Background tasks of a service: a round run at an interval, a task's end waited for on stop, and calls
nobody waits for."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from xavier_core.runtime.errors import XavierError

__all__ = ["Background", "cancel_and_wait", "every"]


def every(
    interval: float,
    round_: Callable[[], Awaitable[object]],
    skipped: Callable[[XavierError], None],
    name: str,
) -> asyncio.Task[None]:
    """A task on the running loop that awaits `round_()` every `interval` seconds until cancelled (the
    first round at once); a round that raises `XavierError` (a directory outage, say) is handed to
    `skipped` and the next one comes as usual."""

    async def loop() -> None:
        while True:
            try:
                await round_()
            except XavierError as err:
                skipped(err)
            await asyncio.sleep(interval)

    return asyncio.get_running_loop().create_task(loop(), name=name)


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancels `task` (None: nothing to do) and waits until it has ended; its cancellation is not
    raised here."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Background:
    """Calls the caller does not wait for; each handles its own failure. Holds a reference to each task
    until it ends (the event loop keeps only weak ones) so that `wait` can drain them."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, call: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(call, name=self._name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Returns once every call started so far (and any started meanwhile) has ended."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel(self) -> None:
        """Cancels every call still running and waits for them to end."""
        for task in list(self._tasks):
            task.cancel()
        await self.wait()
