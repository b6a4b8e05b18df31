"""Deadlines on waits: the router's progress deadline and the stall watch of a peer's stream.

`WaitDeadline` keeps a deadline on each wait with one timer that re-arms itself from the start of the
wait in progress: the time between waits (a token being sent to a client) never counts, and a wait costs
no timer, task or context manager of its own. `paced` reads a streaming gRPC call under one, so only the
peer's time counts; past the deadline it raises `Stalled`, which the flows treat as the peer failing
(`flows.peer_failures`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc


class Stalled(Exception):
    """A streaming peer sent nothing within the stall deadline."""


class WaitDeadline:
    """A deadline of `seconds` on each wait (`watch` to `unwatch`), timed from that wait's own start;
    `since` is when the wait in progress began, None while none runs. A wait that runs past it calls
    `expired`, and the timer stops until a wait starts it again; `stop` stops it."""

    __slots__ = ("_expired", "_handle", "_loop", "_seconds", "since")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, expired: Callable[[], None]) -> None:
        self._loop, self._seconds, self._expired = loop, seconds, expired
        self._handle: asyncio.TimerHandle | None = None
        self.since: float | None = None

    def watch(self) -> None:
        """Starts a wait, and the timer if it is not running."""
        self.since = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self.since + self._seconds, self._check)

    def unwatch(self) -> None:
        """Ends the wait in progress; the time until the next one does not count."""
        self.since = None

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        since, now = self.since, self._loop.time()
        if since is not None and now - since >= self._seconds:
            self._handle = None
            self._expired()
            return
        # No wait, or a younger one: due a deadline after the wait in progress began (or from now).
        self._handle = self._loop.call_at((now if since is None else since) + self._seconds, self._check)


async def paced(call: Any, seconds: float, first: bool = True) -> AsyncIterator[Any]:
    """The messages of a streaming call, each within `seconds` of the previous one (of the call's start
    for the first, unless `first` is False: a unified replica's first message waits for its prefill);
    raises `Stalled` past it. Only the peer's time counts: the time the consumer holds a message does
    not."""
    reader: asyncio.Task[Any] | None = None
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        if reader is not None:
            reader.cancel()

    deadline = WaitDeadline(asyncio.get_running_loop(), seconds, expire)
    timed = first
    try:
        while True:
            reader = asyncio.current_task()
            if timed:
                deadline.watch()
            try:
                msg = await call.read()
            except asyncio.CancelledError:
                if fired and reader is not None and reader.uncancel() == 0:
                    raise Stalled from None
                raise
            finally:
                deadline.unwatch()
            if msg is grpc.aio.EOF:
                return
            timed = True
            yield msg
    finally:
        deadline.stop()
