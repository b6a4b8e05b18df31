"""P/D through a pair whose engine is SGLang: prefill and decode called at the same time.

SGLang's prefill answers only once its decode has taken the KV, so the sequential flow (prefill, then
decode from the prefill's first token) would wait for itself. Here both calls start together under one
room id; the decode's stream is the answer from its first token (the first token reaches the decode in
SGLang's aux buffer). The two SGLang servers hand the KV over between themselves (the xavier backend's
pair protocol, `engines/xavier_sglang/wire.py`): the room is never in the directory, so nothing here
calls it. A prefill that fails while the decode waits ends the attempt at once with the prefill's error
(the decode would otherwise wait out SGLang's bootstrap timeout). A prefill still running when the decode
finished is left to end by itself (its call has the request deadline).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from xavier.v1 import decode_service_pb2 as decpb
from xavier.v1 import decode_service_pb2_grpc as decpb_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pfpb
from xavier.v1 import prefill_service_pb2_grpc as pfpb_grpc
from xavier.v1 import types_pb2

from xavier_core.runtime.durations import to_seconds
from xavier_services.router import flows
from xavier_services.router.peers import Pair
from xavier_services.router.request import Prepared, new_room_id

SGLANG_ENGINE = "sglang"
"""`KvLayout.engine` of SGLang peers: those that declare no handoff protocol are concurrent."""


def concurrent_pair(pair: Pair) -> bool:
    """Whether the pair needs prefill and decode called at once: its prefill declares
    HANDOFF_PROTOCOL_CONCURRENT (or, registered before peers declared their protocol, is SGLang's)."""
    layout = pair.prefill.layout
    if layout.handoff == types_pb2.HANDOFF_PROTOCOL_UNSPECIFIED:
        return bool(layout.engine == SGLANG_ENGINE)
    return bool(layout.handoff == types_pb2.HANDOFF_PROTOCOL_CONCURRENT)


def _consume(fut: asyncio.Future[pfpb.PrefillResponse]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: a prefill that fails after the answer was streamed is not an error


async def _prefill(
    call: grpc.aio.UnaryUnaryCall[pfpb.PrefillRequest, pfpb.PrefillResponse],
) -> pfpb.PrefillResponse:
    return await call


async def concurrent_attempt(
    prep: Prepared, env: flows.FlowEnv, pair: Pair, trace: flows.Trace | None
) -> AsyncIterator[flows.Step]:
    pool = env.pool
    p, d = pair.prefill, pair.decode
    room_id = new_room_id()
    s = prep.sampling
    pool.acquire(p, d)
    pf_call = pfpb_grpc.PrefillServiceStub(pool.channel(p.address)).Prefill(
        flows.prefill_request(prep, room_id, d), timeout=env.request_timeout
    )
    dec_call = decpb_grpc.DecodeServiceStub(pool.channel(d.address)).Decode(
        flows.decode_request(prep, room_id, p), timeout=env.request_timeout
    )
    prefill = asyncio.ensure_future(_prefill(pf_call))
    calling: dpb.Peer = d
    streamed = finished = False
    try:
        messages = dec_call.__aiter__()
        while True:
            nxt: asyncio.Future[decpb.DecodeResponse] = asyncio.ensure_future(messages.__anext__())
            if not prefill.done():
                await asyncio.wait({nxt, prefill}, return_when=asyncio.FIRST_COMPLETED)
                if prefill.done() and not prefill.cancelled() and prefill.exception() is not None:
                    nxt.cancel()
                    calling = p
                    prefill.result()  # raises the prefill's AioRpcError
            try:
                # Past the first message (which waits for SGLang's prefill), a silent decode is stalled.
                msg = await (asyncio.wait_for(nxt, env.stall_seconds) if streamed else nxt)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise flows._lost(flows._stalled(d, pool, env.stall_seconds), streamed) from None
            streamed = True
            finished = bool(msg.finish_reason)  # before the yield: a reader with the finish closes us there
            yield flows.Step(
                list(msg.delta.token_ids),
                msg.delta.text,
                list(msg.delta.logprobs) if s.logprobs else [],
                msg.finish_reason,
                cached_tokens=msg.usage.cached_tokens if msg.HasField("usage") else None,
                transfer_seconds=to_seconds(msg.timings.transfer) if msg.HasField("timings") else None,
            )
            if msg.finish_reason:
                return
        yield flows.Step([], "", finish=types_pb2.FINISH_REASON_ABORT)
    except grpc.aio.AioRpcError as exc:
        raise flows._lost(flows._peer_error(exc, calling, pool), streamed) from None
    finally:
        dec_call.cancel()
        prefill.add_done_callback(_consume)
        if not finished:
            # Cancelling both calls aborts the request in both SGLang servers, which end the room
            # between themselves (it never was in the directory).
            prefill.cancel()
            pf_call.cancel()
        pool.release(p, d)
