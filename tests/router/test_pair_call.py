"""The one pair call (`router.pair_call`): the concurrent order's read loop, the cleanup every P/D transport
shares, and where a pair's first token comes from (declared, or implied for peers of xavier.v1.0)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2
from xavier_services.router.pair_call import (
    PairCall,
    PrefillFailed,
    carries_first_token,
    concurrently,
    first_token_source,
)

PREFILL = types_pb2.FIRST_TOKEN_SOURCE_PREFILL
DECODE = types_pb2.FIRST_TOKEN_SOURCE_DECODE
UNSAID = types_pb2.FIRST_TOKEN_SOURCE_UNSPECIFIED


def _peer(handoff: int, engine: str, source: int = UNSAID) -> dpb.Peer:
    layout = types_pb2.KvLayout(engine=engine, handoff=handoff, first_token_source=source)
    return dpb.Peer(peer_id="p", role=types_pb2.ROLE_PREFILL, layout=layout)


@pytest.mark.parametrize(
    ("handoff", "engine", "declared", "want"),
    [
        (types_pb2.HANDOFF_PROTOCOL_PAIR, "reference", PREFILL, PREFILL),
        (types_pb2.HANDOFF_PROTOCOL_CONCURRENT, "sglang", DECODE, DECODE),
        # Peers of xavier.v1.0 declare nothing: the handoff (or, before that, the engine) implies it.
        (types_pb2.HANDOFF_PROTOCOL_DIRECTORY_ROOMS, "reference", UNSAID, PREFILL),
        (types_pb2.HANDOFF_PROTOCOL_UNSPECIFIED, "reference", UNSAID, PREFILL),
        (types_pb2.HANDOFF_PROTOCOL_CONCURRENT, "sglang", UNSAID, DECODE),
        (types_pb2.HANDOFF_PROTOCOL_UNSPECIFIED, "sglang", UNSAID, DECODE),
    ],
)
def test_the_first_token_comes_from_where_the_peer_declares(
    handoff: int, engine: str, declared: int, want: int
) -> None:
    assert first_token_source(_peer(handoff, engine, declared)) == want


def test_a_prefill_answer_says_whether_it_carries_the_first_token() -> None:
    new = _peer(types_pb2.HANDOFF_PROTOCOL_PAIR, "reference", PREFILL)
    old = _peer(types_pb2.HANDOFF_PROTOCOL_UNSPECIFIED, "reference")
    old_sglang = _peer(types_pb2.HANDOFF_PROTOCOL_UNSPECIFIED, "sglang")
    assert carries_first_token(PREFILL, new)
    assert not carries_first_token(DECODE, new)  # the answer's word beats the declaration
    assert carries_first_token(UNSAID, old)  # a reference prefill of xavier.v1.0 always sent it
    assert not carries_first_token(UNSAID, old_sglang)  # an old SGLang prefill's 0 is no token


class _Decode:
    """A decode stream the test feeds one message at a time; records whether it was closed."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.closed = False

    async def messages(self) -> AsyncIterator[int]:
        try:
            while (msg := await self.queue.get()) is not None:
                yield msg
        finally:
            self.closed = True


async def test_a_prefill_failing_while_the_decode_waits_ends_the_stream_with_its_error() -> None:
    prefill: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    decode = _Decode()
    got: list[int] = []
    decode.queue.put_nowait(1)
    boom = RuntimeError("prefill refused")
    with pytest.raises(PrefillFailed) as info:
        async for msg in concurrently(prefill, decode.messages()):
            got.append(msg)
            asyncio.get_running_loop().call_soon(prefill.set_exception, boom)  # while the next read waits
    assert info.value.error is boom and got == [1]
    assert decode.closed
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # the interrupt was undone


async def test_a_prefill_failing_while_the_consumer_holds_a_message_ends_before_the_next() -> None:
    prefill: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    decode = _Decode()
    for msg in (1, 2):
        decode.queue.put_nowait(msg)
    got: list[int] = []
    with pytest.raises(PrefillFailed):
        async for msg in concurrently(prefill, decode.messages()):
            got.append(msg)
            prefill.set_exception(RuntimeError("late"))
            await asyncio.sleep(0)  # the consumer's own await is not interrupted
            got.append(-msg)
    assert got == [1, -1]
    assert decode.closed


async def test_the_decode_ending_ends_the_stream_and_leaves_the_prefill_running() -> None:
    prefill: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    decode = _Decode()
    for msg in (1, 2, None):
        decode.queue.put_nowait(msg)
    assert [m async for m in concurrently(prefill, decode.messages())] == [1, 2]
    assert not prefill.done()
    prefill.set_exception(RuntimeError("after the answer"))
    await asyncio.sleep(0)  # the prefill's callback is gone: nothing is interrupted
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    prefill.exception()


async def test_cancelling_the_request_is_not_taken_for_a_prefill_failure() -> None:
    prefill: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    decode = _Decode()
    started = asyncio.Event()

    async def consume() -> None:
        started.set()
        async for _ in concurrently(prefill, decode.messages()):
            pass

    task = asyncio.ensure_future(consume())
    await started.wait()
    await asyncio.sleep(0)  # the consumer waits on the decode
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert decode.closed and not prefill.done()


class _Call:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class _Pool:
    def __init__(self) -> None:
        self.out: list[str] = []

    def acquire(self, *peers: dpb.Peer) -> None:
        self.out.extend(p.peer_id for p in peers)

    def release(self, *peers: dpb.Peer) -> None:
        for p in peers:
            self.out.remove(p.peer_id)


def _pair() -> tuple[dpb.Peer, dpb.Peer]:
    return dpb.Peer(peer_id="p", role=types_pb2.ROLE_PREFILL), dpb.Peer(
        peer_id="d", role=types_pb2.ROLE_DECODE
    )


async def test_a_call_that_did_not_finish_cancels_both_releases_and_abandons_its_handoff() -> None:
    pool, (p, d) = _Pool(), _pair()
    spawned: list[Coroutine[Any, Any, None]] = []
    abandoned: list[str] = []

    async def abandon() -> None:
        abandoned.append("room")

    prefill, dec = _Call(), _Call()
    beside: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(RuntimeError, match="decode failed"):
        with PairCall(pool, [p, d], abandon=abandon, spawn=spawned.append, leave_prefill=True) as call:  # type: ignore[arg-type]
            assert pool.out == ["p", "d"]
            call.prefill, call.decode, call.beside = prefill, dec, beside
            call.release(p)  # the prefill answered
            assert pool.out == ["d"]
            raise RuntimeError("decode failed")
    assert prefill.cancelled and dec.cancelled and beside.cancelled()
    assert pool.out == []
    assert len(spawned) == 1
    await spawned[0]
    assert abandoned == ["room"]


async def test_a_finished_call_leaves_its_prefill_to_end_by_itself_when_asked() -> None:
    pool, (p, d) = _Pool(), _pair()
    spawned: list[Coroutine[Any, Any, None]] = []

    async def abandon() -> None:  # pragma: no cover - a finished call abandons nothing
        raise AssertionError("abandoned a finished call")

    for leave in (True, False):
        prefill, dec = _Call(), _Call()
        beside: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with PairCall(pool, [p, d], abandon=abandon, spawn=spawned.append, leave_prefill=leave) as call:  # type: ignore[arg-type]
            call.prefill, call.decode, call.beside = prefill, dec, beside
            call.finished = True
        assert dec.cancelled and pool.out == [] and not spawned
        assert prefill.cancelled is not leave and beside.cancelled() is not leave
        if leave:
            beside.set_exception(RuntimeError("after the answer"))  # retrieved: no "never retrieved"
            await asyncio.sleep(0)
