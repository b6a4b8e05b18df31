"""Routing flows over Xavier peers: P/D (prefill + decode through a room) and colocated (unified).

A flow is an async generator of `Step`s. Cancelling the task that runs it (client cancel, disconnect or
Abort) runs its `finally`: the downstream calls are cancelled and, in P/D, the room is aborted in the
background, so the client never waits for cleanup.

P/D takes three hops on the router's side: the prefill (which returns the first token and publishes its
pages under a room id chosen here), then the decode with that first token, whose stream continues after
it. The two peers meet in the directory by room id; the router never opens the room.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
from xavier.v1 import decode_service_pb2 as decpb
from xavier.v1 import decode_service_pb2_grpc as decpb_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import prefill_service_pb2 as pfpb
from xavier.v1 import prefill_service_pb2_grpc as pfpb_grpc
from xavier.v1 import types_pb2

from xavier_core.runtime import XavierError, from_rpc_error, get_logger
from xavier_core.runtime.durations import to_seconds
from xavier_core.text.tokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer
from xavier_services.router.peers import PeerPool, affinity_key
from xavier_services.router.request import Prepared

_log = get_logger("xavier.router.flows")
Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass
class Step:
    """Tokens the client gets next; `finish` (a FinishReason value) is set on the last step."""

    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    finish: int = types_pb2.FINISH_REASON_UNSPECIFIED
    cached_tokens: int | None = None
    prefill_seconds: float | None = None
    transfer_seconds: float | None = None


@dataclass
class FlowEnv:
    """What the flows share: peers, tokenizer, deadlines and a way to run background cleanup."""

    pool: PeerPool
    tokenizer: TextTokenizer
    request_timeout: float
    rpc_timeout: float
    spawn: Spawn
    affinity_tokens: int = 0  # leading tokens keying prefix affinity in pair selection (0: off)


def _typed(exc: grpc.aio.AioRpcError, pool: PeerPool) -> XavierError:
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        pool.invalidate()
    return from_rpc_error(exc)


async def colocated_flow(prep: Prepared, env: FlowEnv) -> AsyncIterator[Step]:
    """Serves the whole request on the least-loaded unified replica."""
    pool = env.pool
    peer = await pool.retry_unavailable(pool.pick_unified)
    stub = decpb_grpc.DecodeServiceStub(pool.channel(peer.address))
    req = decpb.GenerateUnifiedRequest(
        request_id=prep.request_id,
        token_ids=prep.token_ids,
        sampling=prep.sampling,
        cache_salt=prep.cache_salt,
    )
    pool.acquire(peer)
    call = stub.GenerateUnified(req, timeout=env.request_timeout)
    try:
        async for msg in call:
            yield Step(
                list(msg.delta.token_ids),
                msg.delta.text,
                list(msg.delta.logprobs),
                msg.finish_reason,
                cached_tokens=msg.usage.cached_tokens if msg.HasField("usage") else None,
                prefill_seconds=to_seconds(msg.timings.prefill) if msg.HasField("timings") else None,
            )
            if msg.finish_reason:
                return
        yield Step([], "", finish=types_pb2.FINISH_REASON_ABORT)
    except grpc.aio.AioRpcError as exc:
        raise _typed(exc, pool) from None
    finally:
        call.cancel()
        pool.release(peer)


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


async def pd_flow(prep: Prepared, env: FlowEnv) -> AsyncIterator[Step]:
    """Prefill, then decode from the prefill's first token; the first token goes out as soon as it exists."""
    pool = env.pool
    key = affinity_key(prep.token_ids, prep.cache_salt, env.affinity_tokens)
    pair = await pool.retry_unavailable(lambda: pool.pick_pair(key))
    p, d = pair.prefill, pair.decode
    room_id = secrets.randbits(63) or 1
    s = prep.sampling
    pool.acquire(p, d)
    prefill_held = True
    pf_call = pfpb_grpc.PrefillServiceStub(pool.channel(p.address)).Prefill(
        pfpb.PrefillRequest(
            request_id=prep.request_id,
            room_id=room_id,
            decode_peer_id=d.peer_id,
            decode_epoch=d.epoch,
            token_ids=prep.token_ids,
            sampling=s,
            cache_salt=prep.cache_salt,
        ),
        timeout=env.request_timeout,
    )
    dec_call: Any = None
    finished_cleanly = False
    try:
        pf = await pf_call
        pool.release(p)
        prefill_held = False
        # The router renders the first token's text the way the decode's detokenizer does (primed with
        # the prompt and this token), so the decode's text deltas continue exactly where this one stops.
        detok = IncrementalDetokenizer(env.tokenizer, prep.token_ids)
        first_text, _ = StopMatcher(list(s.stop)).feed(detok.push(pf.first_token))
        yield Step(
            [pf.first_token],
            first_text,
            [pf.first_logprob] if s.logprobs else [],
            pf.finish_reason,
            cached_tokens=pf.usage.cached_tokens,
            prefill_seconds=to_seconds(pf.timings.prefill),
        )
        if pf.finish_reason:
            finished_cleanly = True  # the prefill published nothing and opened no room
            return
        dec_call = decpb_grpc.DecodeServiceStub(pool.channel(d.address)).Decode(
            decpb.DecodeRequest(
                request_id=prep.request_id,
                room_id=room_id,
                prefill_peer_id=p.peer_id,
                prefill_epoch=p.epoch,
                token_ids=prep.token_ids,
                first_token=pf.first_token,
                first_logprob=pf.first_logprob,
                sampling=s,
            ),
            timeout=env.request_timeout,
        )
        async for msg in dec_call:
            transfer = to_seconds(msg.timings.transfer) if msg.HasField("timings") else None
            yield Step(
                list(msg.delta.token_ids),
                msg.delta.text,
                list(msg.delta.logprobs) if s.logprobs else [],
                msg.finish_reason,
                transfer_seconds=transfer,
            )
            if msg.finish_reason:
                finished_cleanly = True
                return
        yield Step([], "", finish=types_pb2.FINISH_REASON_ABORT)
    except grpc.aio.AioRpcError as exc:
        raise _typed(exc, pool) from None
    finally:
        pf_call.cancel()
        if dec_call is not None:
            dec_call.cancel()
        pool.release(d)
        if prefill_held:
            pool.release(p)
        if not finished_cleanly:
            with contextlib.suppress(RuntimeError):
                env.spawn(abort_room(env, prep.request_id, room_id, "router: request ended early"))


async def drain(gen: AsyncIterator[Step]) -> list[Step]:
    """Collects every step (tests and unary callers)."""
    return [step async for step in gen]


__all__ = ["FlowEnv", "Step", "abort_room", "colocated_flow", "drain", "pd_flow"]
