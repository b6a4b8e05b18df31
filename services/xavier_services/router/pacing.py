"""The stall watch of a peer's stream: each message within a deadline of the one before.

`paced` reads a streaming gRPC call under one timer that each message moves (no task per read) and
that is off while the caller holds a message, so only the peer's time counts; past the deadline it
raises `Stalled`, which the flows treat as the peer failing (`flows.peer_failures`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc


class Stalled(Exception):
    """A streaming peer sent nothing within the stall deadline."""


async def paced(call: Any, seconds: float, first: bool = True) -> AsyncIterator[Any]:
    """The messages of a streaming call, each within `seconds` of the previous one (of the call's start
    for the first, unless `first` is False: a unified replica's first message waits for its prefill);
    raises `Stalled` past it. One timer per call, moved at each message (no task per read), and off
    while the consumer holds a message: only the peer's time counts."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(loop.time() + seconds if first else None) as watch:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    return
                watch.reschedule(None)
                yield msg
                watch.reschedule(loop.time() + seconds)
    except TimeoutError:
        raise Stalled from None
