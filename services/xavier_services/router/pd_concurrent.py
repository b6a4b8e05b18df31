"""P/D through a pair that declares HANDOFF_PROTOCOL_CONCURRENT (SGLang's): prefill and decode at once.

Such a prefill answers only once its decode has taken the KV, so the sequential flow (prefill, then
decode from the prefill's first token) would wait for itself. Here both calls start together under one
room id; the decode's stream is the answer from its first token (FIRST_TOKEN_SOURCE_DECODE: the first
token reaches the decode in SGLang's aux buffer, and the router hands it none). The two SGLang servers
hand the KV over between themselves (the xavier backend's pair protocol, `engines/xavier_sglang/wire.py`):
the room is never in the directory, so nothing here calls it. A prefill that fails while the decode
waits ends the attempt at once with the prefill's error (`pair_call.concurrently`). A prefill still
running when the decode finished is left to end by itself (its call has the request deadline); one
cancelled earlier aborts the request in both SGLang servers, which end the room between themselves.

Logprobs: the decode's messages carry each token's logprob and alternatives, the first token's too
(SGLang's prefill sampled it and hands them over with it in the aux buffer). The prompt's logprobs come
only in the prefill's answer, so a request that asks for them has its first step wait for that answer
(which comes about when the decode has the KV) and carry them; any other request waits for nothing.

Cached tokens: the decode computes none of the prompt, so what the prefill found cached (its answer's
usage) is the request's; the first step read after that answer came carries it (none, when the request
finished first).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

from xavier.v1 import prefill_service_pb2 as pfpb
from xavier.v1 import types_pb2

from xavier_core.runtime.durations import to_seconds
from xavier_services.router import flows, peer_calls
from xavier_services.router.pacing import paced
from xavier_services.router.pair_call import PairCall, PrefillFailed, concurrently
from xavier_services.router.peers import Pair
from xavier_services.router.request import Prepared, new_room_id


async def _prefill(call: Awaitable[pfpb.PrefillResponse]) -> pfpb.PrefillResponse:
    return await call


def _prefill_answer(prefill: asyncio.Future[pfpb.PrefillResponse]) -> pfpb.PrefillResponse | None:
    """The prefill's answer if it came and succeeded (its failure is `concurrently`'s to raise)."""
    if not prefill.done() or prefill.cancelled() or prefill.exception() is not None:
        return None
    return prefill.result()


async def _prompt_logprobs(prefill: asyncio.Future[pfpb.PrefillResponse]) -> types_pb2.PromptLogprobs | None:
    """The prompt's logprobs in the prefill's answer, once it comes; its failure is the attempt's
    (`PrefillFailed`). Shielded: a request cancelled meanwhile leaves the prefill to `PairCall`."""
    try:
        answer = await asyncio.shield(prefill)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise PrefillFailed(exc) from None
    return answer.prompt_logprobs if answer.HasField("prompt_logprobs") else None


async def concurrent_attempt(
    prep: Prepared, env: flows.FlowEnv, pair: Pair, trace: flows.Trace | None
) -> AsyncIterator[flows.Step]:
    """One attempt of a request on `pair` (chosen by `pd`), both calls at once; the decode's stream is
    the answer."""
    pool = env.pool
    p, d = pair.prefill, pair.decode
    room_id = new_room_id()
    s = prep.sampling
    with (
        PairCall(pool, [p, d], leave_prefill=True) as call,
        flows.peer_failures(env, flows.Calling(d), d) as calling,
    ):
        pf_call = peer_calls.prefill(pool, p, flows.prefill_request(prep, room_id, d), env.request_timeout)
        call.prefill = pf_call
        call.decode = dec_call = peer_calls.decode(
            pool, d, flows.decode_request(prep, room_id, p), env.request_timeout
        )
        call.beside = asyncio.ensure_future(_prefill(pf_call))
        # Past the first message (which waits for SGLang's prefill), a silent decode is stalled.
        messages = concurrently(call.beside, paced(dec_call, env.stall_seconds, first=False))
        prompt_pending = s.prompt_logprobs  # only the prefill's answer has them: the first step waits
        cached_pending = True  # what the prefill found cached: on the first step once its answer is in
        try:
            async with aclosing(messages):  # type: ignore[type-var]
                async for msg in messages:
                    step = flows.Step(
                        list(msg.delta.token_ids),
                        msg.delta.text,
                        list(msg.delta.logprobs) if s.logprobs else [],
                        msg.finish_reason,
                        top_logprobs=list(msg.delta.top_logprobs),
                        transfer_seconds=to_seconds(msg.timings.transfer)
                        if msg.HasField("timings")
                        else None,
                    )
                    if prompt_pending:
                        # Before the stream counts as started: a prefill failing here fails over.
                        step.prompt_logprobs = await _prompt_logprobs(call.beside)
                        prompt_pending = False
                    answer = _prefill_answer(call.beside) if cached_pending else None
                    if answer is not None:
                        step.cached_tokens = answer.usage.cached_tokens
                        step.cached_tokens_store = answer.usage.cached_tokens_store
                        cached_pending = False
                    calling.streamed = True
                    # Before the yield: a reader that has the finishing step closes this generator there.
                    call.finished = bool(msg.finish_reason)
                    yield step
                    if msg.finish_reason:
                        return
        except PrefillFailed as failed:
            calling.peer = p  # the prefill's error is the attempt's
            raise failed.error from None
        yield flows.Step([], "", finish=types_pb2.FINISH_REASON_ABORT)
