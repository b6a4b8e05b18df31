"""The stall watch of a peer's stream (`pacing.paced`) over a stand-in call whose messages the test
releases one by one."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from xavier_services.router.pacing import Stalled, paced


class _Call:
    """`read()` as a grpc.aio streaming call's: the next message put, or EOF."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()

    async def read(self) -> object:
        return await self.queue.get()


async def test_messages_in_time_pass_and_the_time_a_consumer_holds_one_does_not_count() -> None:
    call = _Call()
    for m in ("a", "b"):
        call.queue.put_nowait(m)
    call.queue.put_nowait(grpc.aio.EOF)
    got = []
    async for msg in paced(call, 0.5):
        got.append(msg)
        await asyncio.sleep(1.2)  # held past two deadlines
    assert got == ["a", "b"]


async def test_a_read_past_the_deadline_stalls() -> None:
    call = _Call()
    call.queue.put_nowait("a")
    stream = paced(call, 0.2)
    assert await anext(stream) == "a"
    with pytest.raises(Stalled):
        await anext(stream)


async def test_the_first_message_may_wait_when_asked_but_not_the_next() -> None:
    call = _Call()
    stream = paced(call, 0.2, first=False)
    asyncio.get_running_loop().call_later(0.6, call.queue.put_nowait, "a")
    assert await anext(stream) == "a"  # three deadlines' wait: no stall
    with pytest.raises(Stalled):
        await anext(stream)


async def test_a_reader_cancelled_from_outside_is_cancelled_not_stalled() -> None:
    call = _Call()
    stream = paced(call, 5.0)
    reader = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.05)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
