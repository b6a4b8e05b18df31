"""The router's stream queue (in process): what a flow's task puts on it, and the last response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from xavier.v1 import types_pb2
from xavier_services.router.flows import Step
from xavier_services.router.stream import Ended, Failed, Item, Tally, last_response, pump


def _drain(queue: asyncio.Queue[Item]) -> list[Item]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def test_steps_then_ended_and_the_flow_closed() -> None:
    closed: list[bool] = []

    async def flow() -> AsyncIterator[Step]:
        try:
            yield Step([1], "a")
            yield Step([2, 3], "bc", finish=types_pb2.FINISH_REASON_STOP)
        finally:
            closed.append(True)

    queue: asyncio.Queue[Item] = asyncio.Queue()
    await pump(flow(), queue)
    items = _drain(queue)
    assert [i.token_ids for i in items[:2] if isinstance(i, Step)] == [[1], [2, 3]]
    assert items[2:] == [Ended(cancelled=False)] and closed == [True]


async def test_a_failing_flow_is_failed_and_a_cancelled_one_ended_cancelled() -> None:
    gate = asyncio.Event()

    async def failing() -> AsyncIterator[Step]:
        yield Step([1], "a")
        raise ValueError("boom")

    async def waiting() -> AsyncIterator[Step]:
        yield Step([1], "a")
        await gate.wait()
        yield Step([2], "b")

    queue: asyncio.Queue[Item] = asyncio.Queue()
    await pump(failing(), queue)
    items = _drain(queue)
    assert len(items) == 2 and isinstance(items[1], Failed) and str(items[1].error) == "boom"

    task = asyncio.get_running_loop().create_task(pump(waiting(), queue))
    first = await queue.get()
    assert isinstance(first, Step) and first.token_ids == [1]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _drain(queue) == [Ended(cancelled=True)]


def test_tally_keeps_the_latest_figures_and_the_last_response_sums_them() -> None:
    tally = Tally(ttft=0.25)
    tally.add(Step([5, 6], "xy", cached_tokens=32, cached_tokens_store=16, prefill_seconds=0.5))
    tally.add(Step([7], "z", transfer_seconds=0.125))
    assert tally.finish == types_pb2.FINISH_REASON_UNSPECIFIED and tally.last is None
    tally.add(Step([8], "!", finish=types_pb2.FINISH_REASON_LENGTH, cached_tokens=48))
    resp = last_response("r1", 1, 100, tally, total=2.0)
    assert (resp.request_id, list(resp.token_ids), resp.text) == ("r1", [8], "!")
    assert resp.finish_reason == types_pb2.FINISH_REASON_LENGTH and resp.mode == 1
    usage = resp.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (100, 4)
    assert (usage.cached_tokens, usage.cached_tokens_store, usage.cached_tokens_local) == (48, 16, 32)
    t = resp.timings
    assert t.time_to_first_token.ToNanoseconds() == 250_000_000 and t.total.ToNanoseconds() == 2_000_000_000
    assert t.prefill.ToNanoseconds() == 500_000_000 and t.transfer.ToNanoseconds() == 125_000_000


def test_a_flow_that_ended_without_a_finish_answers_no_tokens() -> None:
    tally = Tally()
    tally.add(Step([1, 2], "ab"))
    tally.finish = types_pb2.FINISH_REASON_ABORT  # what the reader sets on Ended
    resp = last_response("r2", 2, 3, tally, total=1.5)
    assert list(resp.token_ids) == [] and resp.text == "" and not resp.HasField("prompt_logprobs")
    assert resp.finish_reason == types_pb2.FINISH_REASON_ABORT and resp.usage.completion_tokens == 2
    assert resp.timings.time_to_first_token.ToNanoseconds() == 1_500_000_000  # no token: the total
