"""Admission slots and queue (in process) and the keepalive ticker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from xavier_services.router.admission import Admission, Overloaded
from xavier_services.router.keepalive import Tick, with_ticks


async def test_limits_queue_fifo_and_refusal() -> None:
    adm = Admission(max_inflight=1, max_queued=1, queue_timeout=5.0, retry_after=3)
    order: list[str] = []
    release = asyncio.Event()

    async def hold(name: str) -> None:
        async with adm.slot():
            order.append(name)
            await release.wait()

    first = asyncio.ensure_future(hold("a"))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(hold("b"))
    await asyncio.sleep(0)
    assert adm.inflight == 1 and adm.queued == 1
    with pytest.raises(Overloaded) as info:
        async with adm.slot():
            pass
    assert info.value.metadata["retry_after_seconds"] == "3"
    release.set()
    await asyncio.gather(first, second)
    assert order == ["a", "b"]
    assert adm.inflight == 0 and adm.queued == 0


async def test_queue_timeout_and_cancel_keep_counts() -> None:
    adm = Admission(max_inflight=1, max_queued=2, queue_timeout=0.1, retry_after=1)
    async with adm.slot():
        with pytest.raises(Overloaded):
            async with adm.slot():
                pass
        waiter = asyncio.ensure_future(adm.slot().__aenter__())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert adm.queued == 0
    assert adm.inflight == 0


async def test_ticks_between_slow_items() -> None:
    async def slow() -> AsyncIterator[int]:
        yield 1
        await asyncio.sleep(0.35)
        yield 2

    got = [x async for x in with_ticks(slow(), 0.1)]
    assert got[0] == 1 and got[-1] == 2
    assert sum(isinstance(x, Tick) for x in got) >= 2
