"""P/D over Xavier peers: the prefill and the decode of one request on a pair, with failover.

`pd_flow` picks a pair (least outstanding work, prefix affinity) and calls it in the order its peers
declare (`pair_call.call_order`): SEQUENTIAL here, CONCURRENT in `pd_concurrent`. Either way the call
ends in the one cleanup (`pair_call.PairCall`): a request that ends early (client cancel, disconnect,
Abort, a failed peer) has its calls cancelled and its handoff ended in the background, so the client
never waits for cleanup.

The sequential order takes three hops on the router's side: the prefill (which returns the first token
and publishes its pages under a room id chosen here), then the decode with that first token, whose
stream continues after it. The two peers meet in the directory by room id (the router never opens the
room; `abort_room` ends it early), or, when both declare HANDOFF_PROTOCOL_PAIR, the prefill's answer
carries its source and the router hands it on (`release_source` tells the prefill it gave up).

Failover (`flows.failover`): until the decode has streamed a token, a peer that fails is left out and
the request runs again on another pair. The client's first token is sent only once the decode call is
connected, so a dead decode is found before the client sees anything; if the decode fails after that
but before its first token, the retry re-prefills on a new pair and hands the new decode the first
token the client already has (`flows.FirstToken`), so the stream continues where it was. A pair whose
decode streams its own first token (the concurrent order) cannot continue it and is not retried into.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine
from contextlib import aclosing
from typing import Any

import grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pfpb
from xavier.v1 import types_pb2

from xavier_core.runtime import Unavailable, XavierError, get_logger
from xavier_core.runtime.durations import to_seconds
from xavier_services.router import peer_calls
from xavier_services.router.flows import (
    Calling,
    FirstToken,
    FlowEnv,
    PeerFailed,
    Step,
    Trace,
    decode_request,
    failover,
    note,
    peer_failures,
    pick,
    prefill_request,
)
from xavier_services.router.pacing import paced
from xavier_services.router.pair_call import Order, PairCall, call_order, carries_first_token, pair_handoff
from xavier_services.router.pd_concurrent import concurrent_attempt
from xavier_services.router.peers import Pair, affinity_key
from xavier_services.router.request import Prepared, new_room_id, require_features, serves

_log = get_logger("xavier.router.pd")
_RELEASE_TIMEOUT_S = 5.0
"""Deadline of a ReleaseSource (best effort: the prefill's lease bounds the pin without it)."""


def pd_flow(
    prep: Prepared, env: FlowEnv, trace: Trace | None = None, avoid: frozenset[str] = frozenset()
) -> AsyncIterator[Step]:
    """Prefill, then decode from the prefill's first token, failing over to another pair until the
    decode has streamed a token; the peers of `avoid` are left out from the first pick."""
    key = affinity_key(prep.token_ids, prep.cache_salt, env.affinity_tokens)
    sent: list[FirstToken] = []

    def attempt(exclude: frozenset[str]) -> AsyncIterator[Step]:
        return _pd_attempt(prep, env, key, exclude, sent, trace)

    return failover(attempt, env, trace, avoid)


async def _pd_attempt(
    prep: Prepared,
    env: FlowEnv,
    key: bytes | None,
    exclude: frozenset[str],
    sent: list[FirstToken],
    trace: Trace | None,
) -> AsyncIterator[Step]:
    pool = env.pool
    able = serves(prep)  # a pair whose engines declare what the request needs, while there is one
    pair: Pair = await pick(
        env, exclude, lambda: pool.retry_unavailable(lambda: pool.pick_pair(key, exclude, able))
    )
    p, d = pair.prefill, pair.decode
    require_features(prep, p.layout, "prefill")
    require_features(prep, d.layout, "decode")
    note(trace, p, d)
    if call_order(pair) is Order.SEQUENTIAL:
        steps = _sequential(prep, env, pair, sent)
    elif sent:  # its decode streams its own first token: it cannot continue another engine's stream
        raise PeerFailed(p, Unavailable("the pair cannot continue this stream", reason="PEER_UNAVAILABLE"))
    else:  # the prefill answers only after the decode took the KV (see pd_concurrent)
        steps = concurrent_attempt(prep, env, pair, trace)
    async with aclosing(steps):  # type: ignore[type-var]
        async for step in steps:
            yield step


async def _sequential(
    prep: Prepared, env: FlowEnv, pair: Pair, sent: list[FirstToken]
) -> AsyncIterator[Step]:
    """The prefill, then the decode from the first token its answer carries (or, on a retry, the one
    the client already has), through a directory room or a pair handoff."""
    pool = env.pool
    p, d = pair.prefill, pair.decode
    room_id = new_room_id()
    direct = pair_handoff(pair)
    reached = False  # from then on the decode may have the request (and may read the source)

    def abandon() -> Coroutine[Any, Any, None]:
        if direct:  # a decode never connected never read: the source is unpinned at once
            return release_source(env, p, prep.request_id, room_id, decode_called=reached)
        return abort_room(env, prep.request_id, room_id, "router: request ended early")

    with (
        PairCall(pool, [p, d], abandon=abandon, spawn=env.spawn) as call,
        peer_failures(env, Calling(p), d) as calling,
    ):
        pf_call = peer_calls.prefill(
            pool, p, prefill_request(prep, room_id, d, pair_handoff=direct), env.request_timeout
        )
        call.prefill = pf_call
        pf = await pf_call
        call.release(p)
        if pf.finish_reason and not sent:
            call.finished = True  # the prefill published nothing and opened no room
            yield _first_step(prep, pf.first_token, pf.first_logprob, pf)
            return
        if pf.finish_reason:
            # A retry's prefill sampled a token that ends the request, but the client already has
            # another first token: this pair cannot continue that stream.
            raise PeerFailed(p, Unavailable("the retried prefill ended early", reason="PEER_UNAVAILABLE"))
        first = sent[0] if sent else _prefill_first(p, pf)
        calling.peer = d
        dec_channel = pool.channel(d.address)
        dec_request = decode_request(prep, room_id, p, first)
        if direct:
            dec_request.source.CopyFrom(pf.source)
        call.decode = dec_call = peer_calls.decode(pool, d, dec_request, env.request_timeout)
        if dec_channel.get_state() != grpc.ChannelConnectivity.READY:
            # No live connection to the decode (first use, or it went away): a dead decode refuses the
            # connection here, found before the client sees a token. On a ready connection this wait
            # would cost the client milliseconds of TTFT; a decode that fails later fails over too.
            await dec_call.wait_for_connection()
        reached = True
        if not sent:
            sent.append(first)
            yield _first_step(prep, first.token, first.logprob, pf)
        async for msg in paced(dec_call, env.stall_seconds):
            calling.streamed = True
            # Set before the finishing step is handed on: a reader that has it closes this generator at
            # the yield, and the request must not count as given up (no ReleaseSource, no AbortRoom).
            call.finished = bool(msg.finish_reason)
            transfer = to_seconds(msg.timings.transfer) if msg.HasField("timings") else None
            yield Step(
                list(msg.delta.token_ids),
                msg.delta.text,
                list(msg.delta.logprobs) if prep.sampling.logprobs else [],
                msg.finish_reason,
                transfer_seconds=transfer,
                top_logprobs=list(msg.delta.top_logprobs),
            )
            if msg.finish_reason:
                return
        yield Step([], "", finish=types_pb2.FINISH_REASON_ABORT)


def _prefill_first(prefill: dpb.Peer, pf: pfpb.PrefillResponse) -> FirstToken:
    """The first token the prefill's answer carries; a prefill that answered none (its pair's decode
    would stream it) cannot serve the sequential order, and another pair is tried."""
    if not carries_first_token(pf.first_token_source, prefill):
        raise PeerFailed(
            prefill, Unavailable("the prefill answered without a first token", reason="PEER_UNAVAILABLE")
        )
    return FirstToken(pf.first_token, pf.first_logprob)


def _first_step(prep: Prepared, token: int, logprob: float, pf: pfpb.PrefillResponse) -> Step:
    # The prefill's engine rendered the first token's text (after the prompt, stop strings applied, the
    # tail flushed if the request ends here); the decode's text deltas continue exactly where it stops.
    return Step(
        [token],
        pf.first_text,
        [logprob] if prep.sampling.logprobs else [],
        pf.finish_reason,
        cached_tokens=pf.usage.cached_tokens,
        cached_tokens_store=pf.usage.cached_tokens_store,
        prefill_seconds=to_seconds(pf.timings.prefill),
        top_logprobs=[pf.first_top_logprobs] if pf.HasField("first_top_logprobs") else [],
        prompt_logprobs=pf.prompt_logprobs if pf.HasField("prompt_logprobs") else None,
    )


async def abort_room(env: FlowEnv, request_id: str, room_id: int, detail: str) -> None:
    """Best-effort AbortRoom with a deadline (the room's lease bounds it if this fails).

    The room may not exist yet (the prefill had not published): the directory then keeps a tombstone so
    the late publication sees the room ended and the prefill unpins at once.
    """
    if env.pool.directory is None:
        return
    try:
        await env.pool.directory.abort_room(
            room_id, dpb.ROOM_END_CAUSE_ROUTER_ABORT, detail, request_id=f"{request_id}/abort"
        )
    except XavierError as exc:
        _log.info("abort room failed", room_id=room_id, code=exc.code.name)


async def release_source(
    env: FlowEnv, prefill: dpb.Peer, request_id: str, room_id: int, decode_called: bool
) -> None:
    """Best-effort ReleaseSource of a pair handoff the router gave up on (the prefill's room lease, then
    its park timeout, bound it if this fails)."""
    try:
        await peer_calls.release_source(
            env.pool,
            prefill,
            pfpb.ReleaseSourceRequest(request_id=request_id, room_id=room_id, decode_called=decode_called),
            _RELEASE_TIMEOUT_S,
        )
    except grpc.aio.AioRpcError as exc:
        _log.info("release source failed", room_id=room_id, code=exc.code().name)


__all__ = ["abort_room", "pd_flow", "release_source"]
