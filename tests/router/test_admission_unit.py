"""Admission slots and queue (in process) and the keepalive ticker."""

from __future__ import annotations

import asyncio

import pytest
from xavier_services.router.admission import Admission, Overloaded
from xavier_services.router.keepalive import COMMENT, Keepalive


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


async def test_keepalive_comments_a_quiet_stream_until_stopped() -> None:
    wrote: list[bytes] = []

    async def write(data: bytes) -> None:
        wrote.append(data)

    keep = Keepalive(write, 0.1)
    await asyncio.sleep(0.25)
    assert wrote == []  # not started: the status is still open
    keep.start()
    await asyncio.sleep(0.35)
    assert len(wrote) >= 2 and set(wrote) == {COMMENT}
    await keep.stop()
    n = len(wrote)
    await asyncio.sleep(0.25)
    assert len(wrote) == n


async def test_keepalive_ends_quietly_when_the_client_left() -> None:
    calls = 0

    async def write(data: bytes) -> None:
        nonlocal calls
        calls += 1
        raise ConnectionResetError("Cannot write to closing transport")

    lost: list[bool] = []
    keep = Keepalive(write, 0.05, lambda: lost.append(True))
    keep.start()
    await asyncio.sleep(0.3)
    assert calls == 1 and lost == [True]  # the first failed write ended it, and said so
    await keep.stop()  # raises nothing
