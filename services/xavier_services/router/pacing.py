"""The stall watch of a peer's stream: each message within a deadline of the one before.

`paced` reads a streaming gRPC call under one timer a call that re-arms itself from the start of the
read in progress (no timer, task or context manager per message), and that counts nothing while the
caller holds a message, so only the peer's time counts; past the deadline it raises `Stalled`, which
the flows treat as the peer failing (`flows.peer_failures`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc


class Stalled(Exception):
    """A streaming peer sent nothing within the stall deadline."""


class _Watch:
    """The deadline of a read: `since` is when the read in progress began (None while none runs or it
    has no deadline); past `seconds` of it the reading task is cancelled and `fired` set."""

    __slots__ = ("_handle", "_loop", "_seconds", "fired", "since", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self._loop, self._seconds = loop, seconds
        self._handle: asyncio.TimerHandle | None = None
        self.since: float | None = None
        self.task: asyncio.Task[Any] | None = None
        self.fired = False

    def arm(self) -> None:
        if self._handle is None:
            self._handle = self._loop.call_later(self._seconds, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        since, now = self.since, self._loop.time()
        if since is not None and now - since >= self._seconds and self.task is not None:
            self._handle = None
            self.fired = True
            self.task.cancel()
            return
        # No read, or a younger one: due a deadline after the read in progress began (or from now).
        self._handle = self._loop.call_at((now if since is None else since) + self._seconds, self._check)


async def paced(call: Any, seconds: float, first: bool = True) -> AsyncIterator[Any]:
    """The messages of a streaming call, each within `seconds` of the previous one (of the call's start
    for the first, unless `first` is False: a unified replica's first message waits for its prefill);
    raises `Stalled` past it. Only the peer's time counts: the time the consumer holds a message does
    not."""
    loop = asyncio.get_running_loop()
    watch = _Watch(loop, seconds)
    timed = first
    try:
        while True:
            watch.task = asyncio.current_task()
            if timed:
                watch.since = loop.time()
                watch.arm()
            try:
                msg = await call.read()
            except asyncio.CancelledError:
                task = watch.task
                if watch.fired and task is not None and task.uncancel() == 0:
                    raise Stalled from None
                raise
            finally:
                watch.since = None
            if msg is grpc.aio.EOF:
                return
            timed = True
            yield msg
    finally:
        watch.stop()
