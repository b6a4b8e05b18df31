"""Background tasks of a service: a round run at an interval, and a task's end waited for on stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from xavier_core.runtime.errors import XavierError

__all__ = ["cancel_and_wait", "every"]


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
