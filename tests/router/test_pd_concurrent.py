"""The concurrent pair order (`router.pd_concurrent`) against real gRPC servers standing in for an SGLang
pair: the decode's alternatives reach every step, the prompt's logprobs come from the prefill's answer on
the first step, and only a request that asks for them waits for that answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any, cast

import grpc
import pytest
from xavier.v1 import decode_service_pb2 as dpb
from xavier.v1 import decode_service_pb2_grpc, prefill_service_pb2_grpc, types_pb2
from xavier.v1 import directory_service_pb2 as dirpb
from xavier.v1 import prefill_service_pb2 as ppb
from xavier_services.router import pd_concurrent
from xavier_services.router.flows import FlowEnv, PeerFailed, Step
from xavier_services.router.pd_concurrent import concurrent_attempt
from xavier_services.router.peers import Pair, PeerPool
from xavier_services.router.request import Prepared

from xavier_core.runtime import XavierError

PROMPT = (5, 6, 7, 8)
TOKENS = [40, 41, 42]
PROMPT_LOGPROBS = types_pb2.PromptLogprobs(
    logprobs=[-1.0, -2.0, -3.0],
    top_logprobs=[types_pb2.TopLogprobs(token_ids=[t, 1], logprobs=[-0.5, -4.0]) for t in PROMPT[1:]],
)


def _top(token: int) -> types_pb2.TopLogprobs:
    return types_pb2.TopLogprobs(token_ids=[token, token + 100], logprobs=[-0.25, -1.25])


class _Prefill(prefill_service_pb2_grpc.PrefillServiceServicer):  # type: ignore[misc]
    """Answers once `release` is set (SGLang's prefill answers once the decode took the KV), or fails
    with `fail`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.fail: grpc.StatusCode | None = None
        self.cached = 0

    async def Prefill(self, request: ppb.PrefillRequest, context: Any) -> ppb.PrefillResponse:
        await self.release.wait()
        if self.fail is not None:
            await context.abort(self.fail, "the prefill failed")
        answer = ppb.PrefillResponse(
            first_token_source=types_pb2.FIRST_TOKEN_SOURCE_DECODE,
            usage=types_pb2.Usage(prompt_tokens=len(request.token_ids), cached_tokens=self.cached),
        )
        if request.sampling.prompt_logprobs:
            answer.prompt_logprobs.CopyFrom(PROMPT_LOGPROBS)
        return answer


class _Decode(decode_service_pb2_grpc.DecodeServiceServicer):  # type: ignore[misc]
    """Streams TOKENS from its own first one, one a message, with logprobs and alternatives as asked;
    the last one once `last` is set. Its usage says nothing was cached (an SGLang decode computes none of
    the prompt)."""

    def __init__(self) -> None:
        self.last = asyncio.Event()
        self.last.set()

    async def Decode(self, request: dpb.DecodeRequest, context: Any) -> AsyncIterator[dpb.DecodeResponse]:
        s = request.sampling
        for i, token in enumerate(TOKENS):
            last = i == len(TOKENS) - 1
            if last:
                await self.last.wait()
            yield dpb.DecodeResponse(
                delta=dpb.TokenDelta(
                    token_ids=[token],
                    text=f"t{token}",
                    logprobs=[-0.25] if s.logprobs else [],
                    top_logprobs=[_top(token)] if s.top_logprobs else [],
                ),
                finish_reason=types_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=types_pb2.Usage(prompt_tokens=len(request.token_ids)) if last else None,
            )


_DECODE = _Decode()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[_Prefill, Pair, FlowEnv]]:
    server = grpc.aio.server()
    prefill = _Prefill()
    prefill_service_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, server)
    _DECODE.last = asyncio.Event()
    _DECODE.last.set()
    decode_service_pb2_grpc.add_DecodeServiceServicer_to_server(_DECODE, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    layout = types_pb2.KvLayout(
        engine="sglang",
        handoff=types_pb2.HANDOFF_PROTOCOL_CONCURRENT,
        first_token_source=types_pb2.FIRST_TOKEN_SOURCE_DECODE,
    )
    peers = [
        dirpb.Peer(peer_id=name, role=role, address=address, layout=layout)
        for name, role in (("p", types_pb2.ROLE_PREFILL), ("d", types_pb2.ROLE_DECODE))
    ]
    pool = PeerPool("", rpc_timeout=5.0, refresh_seconds=1e9, attempts=1)
    env = FlowEnv(pool=pool, request_timeout=10.0, spawn=lambda c: c.close())
    try:
        yield prefill, Pair(peers[0], peers[1]), env
    finally:
        prefill.release.set()
        await pool.close()
        await server.stop(0)


def _prep(**sampling: Any) -> Prepared:
    s = types_pb2.SamplingParams(max_tokens=len(TOKENS), logprobs=True, **sampling)
    return Prepared("r", PROMPT, s, 0, "")


def _steps(prep: Prepared, pair: Pair, env: FlowEnv) -> AsyncGenerator[Step, None]:
    return cast(AsyncGenerator[Step, None], concurrent_attempt(prep, env, pair, None))  # it is one


def _tops(steps: list[Step]) -> Iterator[tuple[list[int], list[float]]]:
    for step in steps:
        for top in step.top_logprobs:
            yield list(top.token_ids), list(top.logprobs)


async def test_the_decodes_alternatives_reach_every_step(pair: tuple[_Prefill, Pair, FlowEnv]) -> None:
    prefill, p, env = pair
    prefill.release.set()
    async with aclosing(_steps(_prep(top_logprobs=2), p, env)) as steps:
        got = [step async for step in steps]
    assert [t for step in got for t in step.token_ids] == TOKENS
    assert all(len(step.top_logprobs) == len(step.token_ids) for step in got)  # one per token
    assert list(_tops(got)) == [([t, t + 100], [-0.25, -1.25]) for t in TOKENS]
    assert all(step.prompt_logprobs is None for step in got)


async def test_without_prompt_logprobs_nothing_waits_for_the_prefill(
    pair: tuple[_Prefill, Pair, FlowEnv],
) -> None:
    prefill, p, env = pair  # the prefill never answers while the steps are read
    async with aclosing(_steps(_prep(top_logprobs=2), p, env)) as steps:
        got = [await asyncio.wait_for(anext(steps), 5) for _ in TOKENS]
    assert [t for step in got for t in step.token_ids] == TOKENS and got[-1].finish
    assert not prefill.release.is_set()


async def test_prompt_logprobs_ride_on_the_first_step_once_the_prefill_answers(
    pair: tuple[_Prefill, Pair, FlowEnv],
) -> None:
    prefill, p, env = pair
    async with aclosing(_steps(_prep(top_logprobs=2, prompt_logprobs=True), p, env)) as steps:
        first = asyncio.ensure_future(anext(steps))
        await asyncio.sleep(0.3)
        assert not first.done()  # the decode's first message is in; the prefill's answer is not
        prefill.release.set()
        step = await asyncio.wait_for(first, 5)
        rest = [s async for s in steps]
    assert step.token_ids == TOKENS[:1] and step.prompt_logprobs == PROMPT_LOGPROBS
    assert list(_tops([step])) == [([TOKENS[0], TOKENS[0] + 100], [-0.25, -1.25])]
    assert [s.prompt_logprobs for s in rest] == [None, None]


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE])
async def test_a_prefill_that_fails_while_the_first_step_waits_is_the_attempts_error(
    pair: tuple[_Prefill, Pair, FlowEnv], code: grpc.StatusCode
) -> None:
    prefill, p, env = pair
    prefill.fail = code
    got: list[Step] = []
    async with aclosing(_steps(_prep(prompt_logprobs=True), p, env)) as steps:
        first = asyncio.ensure_future(anext(steps))
        await asyncio.sleep(0.3)
        prefill.release.set()
        with pytest.raises((XavierError, PeerFailed)) as info:
            got.append(await asyncio.wait_for(first, 5))
    assert got == []  # the client saw nothing: the request may still go to another pair
    if code == grpc.StatusCode.UNAVAILABLE:
        assert isinstance(info.value, PeerFailed) and info.value.peer.peer_id == "p"
    else:
        assert isinstance(info.value, XavierError) and info.value.code == code


async def test_the_prefills_cached_count_is_the_requests(
    pair: tuple[_Prefill, Pair, FlowEnv], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the prefill found cached rides on the first step read after its answer came; the decode's
    usage (nothing cached: it computes none of the prompt) does not overwrite it."""
    prefill, p, env = pair
    prefill.cached = 3
    answered = asyncio.Event()
    real = pd_concurrent._prefill

    async def observed(call: Any) -> ppb.PrefillResponse:
        answer = await real(call)
        answered.set()  # the router's task holds the answer once this returns
        return answer

    monkeypatch.setattr(pd_concurrent, "_prefill", observed)
    _DECODE.last.clear()
    async with aclosing(_steps(_prep(), p, env)) as steps:
        got = [await asyncio.wait_for(anext(steps), 5) for _ in TOKENS[:-1]]
        assert all(step.cached_tokens is None for step in got)  # the prefill has not answered
        prefill.release.set()
        await asyncio.wait_for(answered.wait(), 5)
        _DECODE.last.set()
        got += [step async for step in steps]
    assert [step.cached_tokens for step in got] == [None, None, 3]
