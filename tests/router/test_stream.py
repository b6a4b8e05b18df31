"""The router's reader of a request's flow (in process, with flows of its own making, one of them read
through the OpenAI front), and the last response."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from xavier.v1 import router_service_pb2 as rpb
from xavier.v1 import types_pb2
from xavier_services.router.config import RouterConfig
from xavier_services.router.core import ProgressTimeout, Router
from xavier_services.router.flows import Step
from xavier_services.router.openai_http import OpenAiFront
from xavier_services.router.prompts import PromptCache, PromptEncoder, load_model_info
from xavier_services.router.stream import Tally, last_response

from xavier_core.engine.tiny import make_tiny
from xavier_core.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), "qwen2", max_position=64)


async def _router(model_dir: Path, flow: AsyncIterator[Step], **config: float) -> Router:
    """A router without peers whose every request runs `flow`."""
    info = load_model_info(model_dir)
    encoder = PromptEncoder(
        TextTokenizer.load(model_dir), PromptCache(4, info.tokenizer_fingerprint, CollectorRegistry())
    )
    router = Router(RouterConfig(**config), encoder, info, CollectorRegistry())  # type: ignore[arg-type]
    router._flow = lambda *args: flow  # type: ignore[method-assign]
    return router


@contextlib.asynccontextmanager
async def _serving(model_dir: Path, flow: AsyncIterator[Step], **config: float) -> AsyncIterator[Router]:
    """`_router`, closed when the block ends."""
    router = await _router(model_dir, flow, **config)
    try:
        yield router
    finally:
        await router.close()


async def _gated(gate: asyncio.Event, closed: list[str]) -> AsyncIterator[Step]:
    """A step, then a finishing one once `gate` is set; `closed` says how it was left."""
    try:
        yield Step([1], "a")
        await gate.wait()
        yield Step([2], "b", finish=types_pb2.FINISH_REASON_STOP)
    except asyncio.CancelledError:
        closed.append("cancelled")
        raise
    finally:
        closed.append("closed")


async def _prepared(router: Router, request_id: str) -> object:
    req = rpb.GenerateRequest(text="hello", request_id=request_id, mode=rpb.ROUTING_MODE_PD)
    req.sampling.max_tokens = 4
    return await router.prepare_async(req)


async def test_steps_then_the_last_response_and_the_flow_closed(model_dir: Path) -> None:
    closed: list[bool] = []

    async def flow() -> AsyncIterator[Step]:
        try:
            yield Step([1], "a")
            yield Step([], "")  # nothing to send
            yield Step([2, 3], "bc", finish=types_pb2.FINISH_REASON_STOP)
        finally:
            closed.append(True)

    async with _serving(model_dir, flow()) as router:
        out = [m async for m in router.generate(await _prepared(router, "r1"))]  # type: ignore[arg-type]
        assert [list(m.token_ids) for m in out] == [[1], [2, 3]]
        assert out[-1].finish_reason == types_pb2.FINISH_REASON_STOP and closed == [True]
        assert out[-1].usage.completion_tokens == 3 and router.active == 0


async def test_a_failing_flow_raises_its_error_and_one_without_a_finish_ends_aborted(model_dir: Path) -> None:
    async def failing() -> AsyncIterator[Step]:
        yield Step([1], "a")
        raise ValueError("boom")

    async with _serving(model_dir, failing()) as router:
        with pytest.raises(ValueError, match="boom"):
            async for _ in router.generate(await _prepared(router, "r1")):  # type: ignore[arg-type]
                pass

    async def short() -> AsyncIterator[Step]:
        yield Step([1], "a")

    async with _serving(model_dir, short()) as router:
        out = [m async for m in router.generate(await _prepared(router, "r2"))]  # type: ignore[arg-type]
        assert out[-1].finish_reason == types_pb2.FINISH_REASON_ABORT and router.active == 0


async def test_abort_while_the_flow_waits_cancels_that_wait_and_closes_it(model_dir: Path) -> None:
    gate = asyncio.Event()
    closed: list[str] = []

    async with _serving(model_dir, _gated(gate, closed)) as router:
        stream = router.generate(await _prepared(router, "r1"))  # type: ignore[arg-type]
        first = await anext(stream)
        assert list(first.token_ids) == [1]
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)  # the flow now waits on the gate
        assert router.abort("r1") and not pending.done()
        last = await pending
        assert last.finish_reason == types_pb2.FINISH_REASON_ABORT and list(last.token_ids) == []
        assert closed == ["cancelled", "closed"]
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert not router.abort("r1") and router.active == 0


async def test_abort_while_a_step_is_being_sent_never_cancels_the_sender(model_dir: Path) -> None:
    closed: list[str] = []

    async def flow() -> AsyncIterator[Step]:
        try:
            yield Step([1], "a")
            yield Step([2], "b")
        except GeneratorExit:
            closed.append("closed at its step")
            raise

    async with _serving(model_dir, flow()) as router:
        stream = router.generate(await _prepared(router, "r1"))  # type: ignore[arg-type]
        first = await anext(stream)
        assert router.abort("r1")  # the reader holds its step: nothing of this task is cancelled
        await asyncio.sleep(0)  # a cancel of this task, had there been one, would land here
        last = await anext(stream)
        assert last.finish_reason == types_pb2.FINISH_REASON_ABORT and list(first.token_ids) == [1]
        assert closed == ["closed at its step"]
        with pytest.raises(StopAsyncIteration):
            await anext(stream)


async def test_no_step_within_the_progress_deadline_ends_the_flow_and_fails(model_dir: Path) -> None:
    closed: list[bool] = []

    async def silent() -> AsyncIterator[Step]:
        try:
            await asyncio.Event().wait()
            yield Step([1], "a")
        finally:
            closed.append(True)

    async with _serving(model_dir, silent(), progress_timeout_seconds=0.05) as router:
        with pytest.raises(ProgressTimeout):
            async for _ in router.generate(await _prepared(router, "r1")):  # type: ignore[arg-type]
                pass
        assert closed == [True] and router.active == 0


async def test_the_progress_deadline_counts_the_waits_never_the_time_a_reader_holds_a_step(
    model_dir: Path,
) -> None:
    async def flow() -> AsyncIterator[Step]:
        yield Step([1], "a")
        await asyncio.sleep(0.01)
        yield Step([2], "b", finish=types_pb2.FINISH_REASON_STOP)

    async with _serving(model_dir, flow(), progress_timeout_seconds=1.0) as router:
        stream = router.generate(await _prepared(router, "r1"))  # type: ignore[arg-type]
        await anext(stream)
        await asyncio.sleep(2.5)  # the reader holds its step past two deadlines
        rest = [r async for r in stream]  # no ProgressTimeout
        assert rest[-1].finish_reason == types_pb2.FINISH_REASON_STOP and router.active == 0


async def test_a_client_that_leaves_a_quiet_answer_closes_its_flow_at_the_next_keepalive(
    model_dir: Path,
) -> None:
    closed = asyncio.Event()

    async def quiet() -> AsyncIterator[Step]:
        try:
            yield Step([1], "a")
            await asyncio.Event().wait()  # then nothing: only keepalive comments flow
            yield Step([2], "b")
        finally:
            closed.set()

    router = await _router(model_dir, quiet(), keepalive_seconds=0.1, progress_timeout_seconds=600)
    runner = web.AppRunner(OpenAiFront(router).app())
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"prompt": "hello", "max_tokens": 4, "stream": True, "xavier_mode": "pd"}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while b"data: {" not in got:
            got += await asyncio.wait_for(reader.read(4096), 10)
        writer.transport.abort()  # the client leaves while the answer is quiet
        await asyncio.wait_for(closed.wait(), 10)  # not the 600 s progress deadline
        for _ in range(100):
            if router.active == 0:
                break
            await asyncio.sleep(0.05)
        assert router.active == 0
    finally:
        await runner.cleanup()
        await router.close()


async def test_a_reader_that_leaves_closes_the_flow_and_the_close_aborts_what_is_live(
    model_dir: Path,
) -> None:
    gate = asyncio.Event()
    closed: list[str] = []

    router = await _router(model_dir, _gated(gate, closed))
    stream = router.generate(await _prepared(router, "r1"))  # type: ignore[arg-type]
    await anext(stream)
    reader = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.01)
    reader.cancel()  # a client that left: its task is cancelled
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert closed == ["cancelled", "closed"] and router.active == 0
    closed.clear()

    router._flow = lambda *args: _gated(gate, closed)  # type: ignore[method-assign]
    stream = router.generate(await _prepared(router, "r2"))  # type: ignore[arg-type]
    await anext(stream)
    reader = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(router.close())  # ends the live request as an abort would
    assert (await reader).finish_reason == types_pb2.FINISH_REASON_ABORT
    assert closed == ["cancelled", "closed"]
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    await asyncio.wait_for(closing, 1)  # it waited for the request to end, no longer


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
