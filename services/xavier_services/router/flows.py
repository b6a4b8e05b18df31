"""Routing flows over Xavier peers: P/D (prefill + decode through a room) and colocated (unified).

A flow is an async generator of `Step`s. Cancelling the task that runs it (client cancel, disconnect or
Abort) runs its `finally`: the downstream calls are cancelled and, in P/D, the room is aborted in the
background, so the client never waits for cleanup.

A pair whose prefill declares HANDOFF_PROTOCOL_CONCURRENT (SGLang's) takes another path: its prefill
answers only once the decode has taken the KV, so both are called at once and the decode streams from
the first token (`pd_concurrent`). What a pair declares is read in `pair_call`, which also holds the
cleanup every P/D call ends in.

P/D takes three hops on the router's side: the prefill (which returns the first token and publishes its
pages under a room id chosen here), then the decode with that first token, whose stream continues after
it. The two peers meet in the directory by room id (the router never opens the room), or, when both
declare HANDOFF_PROTOCOL_PAIR, the prefill's answer carries its source and the router hands it on.

Failover: until a decode (or unified replica) has streamed a token, a peer that fails (refused
connection, UNAVAILABLE, or gone from the directory) is left out and the request runs again on another
peer, at most `failover_attempts` times. The client's first P/D token is sent only once the decode call
is connected, so a dead decode is found before the client sees anything; if the decode fails after that
but before its first token, the retry re-prefills on a new pair and hands the new decode the first
token the client already has, so the stream continues where it was. A decode that sends nothing for
`env.stall_seconds` (its first token included) is failed the same way (`paced`). Once a decode token
went out, a failed or stalled peer raises `StreamBroken`, which `migration` turns into a move to another
pair (or, without one, the client's PEER_FAILED).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from xavier.v1 import decode_service_pb2 as decpb
from xavier.v1 import decode_service_pb2_grpc as decpb_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import error_reason_pb2 as er
from xavier.v1 import prefill_service_pb2 as pfpb
from xavier.v1 import prefill_service_pb2_grpc as pfpb_grpc
from xavier.v1 import types_pb2

from xavier_core.runtime import Unavailable, XavierError, from_rpc_error, get_logger
from xavier_core.runtime.durations import to_seconds
from xavier_services.router.health import peer_key, role_name
from xavier_services.router.pacing import Stalled, paced
from xavier_services.router.pair_call import (
    Order,
    PairCall,
    Spawn,
    call_order,
    carries_first_token,
    pair_handoff,
)
from xavier_services.router.peers import Pair, PeerPool, affinity_key
from xavier_services.router.request import Prepared, new_room_id, require_features

_log = get_logger("xavier.router.flows")
_RELEASE_TIMEOUT_S = 5.0
"""Deadline of a ReleaseSource (best effort: the prefill's lease bounds the pin without it)."""


T = TypeVar("T")


@dataclass
class Step:
    """Tokens the client gets next; `finish` (a FinishReason value) is set on the last step."""

    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    finish: int = types_pb2.FINISH_REASON_UNSPECIFIED
    top_logprobs: list[types_pb2.TopLogprobs] = field(default_factory=list)  # one per token, when asked
    prompt_logprobs: types_pb2.PromptLogprobs | None = None  # on the first step, when asked
    cached_tokens: int | None = None
    cached_tokens_store: int | None = None  # the page store's share of cached_tokens
    prefill_seconds: float | None = None
    transfer_seconds: float | None = None


@dataclass
class FlowEnv:
    """What the flows share: peers, the request deadline and a way to run background cleanup."""

    pool: PeerPool
    request_timeout: float
    spawn: Spawn
    affinity_tokens: int = 0  # leading tokens keying prefix affinity in pair selection (0: off)
    failover_attempts: int = 1
    peer_wait: float = 0.0  # how long a first attempt waits for peers while none is registered
    stall_seconds: float = 5.0  # a streaming peer silent this long is failed (`paced`)


@dataclass
class Trace:
    """What one request's flow did: the peers it used (role:peer_id, in order) and its failovers."""

    peers: list[str] = field(default_factory=list)
    failovers: int = 0
    failed: list[str] = field(default_factory=list)


# Errors of a peer call that say the peer (not the request) is the problem: the request may go elsewhere.
_PEER_GONE = (er.ERROR_REASON_PEER_NOT_FOUND, er.ERROR_REASON_STALE_EPOCH, er.ERROR_REASON_PEER_UNAVAILABLE)


class _PeerFailed(Exception):
    """A peer failed before the request streamed a token from it: try another (internal to the flows)."""

    def __init__(self, peer: dpb.Peer, error: XavierError, cause: str = "peer_gone") -> None:
        super().__init__(str(error))
        self.peer = peer
        self.error = error
        self.cause = cause  # unavailable (transport), peer_gone (left the directory, new epoch), stalled


class StreamBroken(Unavailable):
    """A peer failed or stalled after the client got tokens it streamed: the request cannot fail over
    inside the flow. Raised to the client as is (PEER_FAILED) unless `migration` moves the request;
    `cause` is unavailable (transport), peer_gone (left the directory, new epoch) or stalled."""

    def __init__(self, failed: _PeerFailed) -> None:
        exhausted = _exhausted(failed, 1)
        super().__init__(exhausted.message, reason="PEER_FAILED", **exhausted.metadata)
        self.peer = failed.peer
        self.cause = failed.cause


def _stalled(peer: dpb.Peer, pool: PeerPool, seconds: float) -> _PeerFailed:
    """A stalled peer leaves selection (a probe brings it back once it answers) and fails over."""
    pool.health.mark_down(peer, f"sent nothing for {seconds:g} s")
    error = Unavailable(f"sent nothing for {seconds:g} s", reason="PEER_UNAVAILABLE")
    return _PeerFailed(peer, error, "stalled")


def _lost(err: Exception, streamed: bool) -> Exception:
    """What an attempt raises for `err`: a peer's failure after it streamed tokens breaks the stream."""
    if isinstance(err, _PeerFailed) and streamed:
        return StreamBroken(err)
    return err


@dataclass
class Calling:
    """The peer a call waits on now and whether the request streamed a decode token yet: what a failure
    becomes depends on both (`peer_failures`)."""

    peer: dpb.Peer
    streamed: bool = False


@contextlib.contextmanager
def peer_failures(env: FlowEnv, calling: Calling, streaming: dpb.Peer) -> Iterator[Calling]:
    """Turns a failed call of `calling.peer` (or a stall of `streaming`, the peer whose stream is read)
    into the flows' typed errors: failover before a streamed token, `StreamBroken` after one."""
    try:
        yield calling
    except grpc.aio.AioRpcError as exc:
        raise _lost(_peer_error(exc, calling.peer, env.pool), calling.streamed) from None
    except Stalled:
        raise _lost(_stalled(streaming, env.pool, env.stall_seconds), calling.streamed) from None


def _peer_error(exc: grpc.aio.AioRpcError, peer: dpb.Peer, pool: PeerPool) -> Exception:
    """The typed error of a failed peer call, or `_PeerFailed` when another peer may serve the request.

    A transport failure (UNAVAILABLE without an ErrorInfo: refused, reset, unreachable) takes the peer
    out of selection at once; the caller reports it to the client naming the peer, never its address.
    """
    err = from_rpc_error(exc)
    if err.code == grpc.StatusCode.UNAVAILABLE or err.is_reason(*_PEER_GONE):
        pool.invalidate()
        transport = err.code == grpc.StatusCode.UNAVAILABLE and err.is_reason(er.ERROR_REASON_UNAVAILABLE)
        if transport:
            pool.health.mark_down(peer, "call failed: UNAVAILABLE")
        return _PeerFailed(peer, err, "unavailable" if transport else "peer_gone")
    return err


def _exhausted(failure: _PeerFailed, attempts: int) -> Unavailable:
    peer = failure.peer
    role = role_name(peer.role)
    transport = failure.error.is_reason(er.ERROR_REASON_UNAVAILABLE)
    why = "could not be reached" if transport else f"failed ({failure.error.reason})"
    if failure.cause == "stalled":
        why = failure.error.message
    return Unavailable(
        f"{role} peer {peer.peer_id!r} {why}; no other {role} peer could take the request",
        reason="PEER_FAILED",
        role=role,
        peer_id=peer.peer_id,
        attempts=attempts,
    )


def _note(trace: Trace | None, *peers: dpb.Peer) -> None:
    if trace is not None:
        trace.peers.extend(f"{role_name(p.role)}:{p.peer_id}" for p in peers)


async def _failover(
    attempt: Callable[[frozenset[str]], AsyncIterator[Step]],
    env: FlowEnv,
    trace: Trace | None,
) -> AsyncIterator[Step]:
    """Runs `attempt(exclude)` until it ends without `_PeerFailed`, leaving failed peers out each time."""
    tried: set[str] = set()
    failure: _PeerFailed | None = None
    for n in range(env.failover_attempts):
        try:
            async with aclosing(attempt(frozenset(tried))) as steps:  # type: ignore[type-var]
                async for step in steps:
                    yield step
            return
        except _PeerFailed as failed:
            failure = failed
            tried.add(peer_key(failed.peer))
            if trace is not None:
                trace.failed.append(f"{role_name(failed.peer.role)}:{failed.peer.peer_id}")
                trace.failovers += 1 if n + 1 < env.failover_attempts else 0
            _log.info(
                "peer failed before the first token; failing over",
                peer_id=failed.peer.peer_id,
                reason=failed.error.reason,
                attempt=n + 1,
            )
        except XavierError as err:
            # No other peer to go to: report the peer that failed rather than "no peers" (or "no decode
            # with a matching layout", when the failed one was the only such decode).
            if failure is not None and err.is_reason(
                er.ERROR_REASON_NO_PEERS, er.ERROR_REASON_LAYOUT_MISMATCH
            ):
                break
            raise
    if failure is None:  # pragma: no cover - the loop runs at least once
        raise Unavailable("no peer could take the request", reason="NO_PEERS")
    raise _exhausted(failure, len(tried))


def colocated_flow(prep: Prepared, env: FlowEnv, trace: Trace | None = None) -> AsyncIterator[Step]:
    """Serves the whole request on the least-loaded healthy unified replica (with failover)."""
    return _failover(lambda exclude: _colocated_attempt(prep, env, exclude, trace), env, trace)


async def _pick(env: FlowEnv, exclude: frozenset[str], pick: Callable[[], Awaitable[T]]) -> T:
    """A request's first pick waits up to `env.peer_wait` for peers while none is registered (a
    restarted directory has them back within about a second); a failover's pick does not wait."""
    if exclude or env.peer_wait <= 0:
        return await pick()
    return await env.pool.wait_for_peers(pick, env.peer_wait)


async def _colocated_attempt(
    prep: Prepared, env: FlowEnv, exclude: frozenset[str], trace: Trace | None
) -> AsyncIterator[Step]:
    pool = env.pool
    peer = await _pick(env, exclude, lambda: pool.retry_unavailable(lambda: pool.pick_unified(exclude)))
    require_features(prep, peer.layout, "unified")
    _note(trace, peer)
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
        with peer_failures(env, Calling(peer), peer) as calling:
            async for msg in paced(call, env.stall_seconds, first=False):
                calling.streamed = True
                yield Step(
                    list(msg.delta.token_ids),
                    msg.delta.text,
                    list(msg.delta.logprobs),
                    msg.finish_reason,
                    cached_tokens=msg.usage.cached_tokens if msg.HasField("usage") else None,
                    cached_tokens_store=msg.usage.cached_tokens_store if msg.HasField("usage") else None,
                    prefill_seconds=to_seconds(msg.timings.prefill) if msg.HasField("timings") else None,
                    top_logprobs=list(msg.delta.top_logprobs),
                    prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
                )
                if msg.finish_reason:
                    return
            yield Step([], "", finish=types_pb2.FINISH_REASON_ABORT)
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


async def release_source(
    env: FlowEnv, prefill: dpb.Peer, request_id: str, room_id: int, decode_called: bool
) -> None:
    """Best-effort ReleaseSource of a pair handoff the router gave up on (the prefill's room lease, then
    its park timeout, bound it if this fails)."""
    try:
        await pfpb_grpc.PrefillServiceStub(env.pool.channel(prefill.address)).ReleaseSource(
            pfpb.ReleaseSourceRequest(request_id=request_id, room_id=room_id, decode_called=decode_called),
            timeout=_RELEASE_TIMEOUT_S,
        )
    except grpc.aio.AioRpcError as exc:
        _log.info("release source failed", room_id=room_id, code=exc.code().name)


@dataclass
class _Sent:
    """The first token the client already has (a retry's decode continues from it)."""

    token: int
    logprob: float


def pd_flow(prep: Prepared, env: FlowEnv, trace: Trace | None = None) -> AsyncIterator[Step]:
    """Prefill, then decode from the prefill's first token, failing over to another pair until the
    decode has streamed a token."""
    key = affinity_key(prep.token_ids, prep.cache_salt, env.affinity_tokens)
    sent: list[_Sent] = []

    def attempt(exclude: frozenset[str]) -> AsyncIterator[Step]:
        return _pd_attempt(prep, env, key, exclude, sent, trace)

    return _failover(attempt, env, trace)


async def _pd_attempt(
    prep: Prepared,
    env: FlowEnv,
    key: bytes | None,
    exclude: frozenset[str],
    sent: list[_Sent],
    trace: Trace | None,
) -> AsyncIterator[Step]:
    pool = env.pool
    pair: Pair = await _pick(
        env, exclude, lambda: pool.retry_unavailable(lambda: pool.pick_pair(key, exclude))
    )
    p, d = pair.prefill, pair.decode
    require_features(prep, p.layout, "prefill")
    require_features(prep, d.layout, "decode")
    _note(trace, p, d)
    from xavier_services.router.pd_concurrent import concurrent_attempt  # (imports us)

    if call_order(pair) is Order.SEQUENTIAL:
        steps = _sequential(prep, env, pair, sent)
    elif sent:  # its decode streams its own first token: it cannot continue another engine's stream
        raise _PeerFailed(p, Unavailable("the pair cannot continue this stream", reason="PEER_UNAVAILABLE"))
    else:  # the prefill answers only after the decode took the KV (see pd_concurrent)
        steps = concurrent_attempt(prep, env, pair, trace)
    async with aclosing(steps):  # type: ignore[type-var]
        async for step in steps:
            yield step


async def _sequential(prep: Prepared, env: FlowEnv, pair: Pair, sent: list[_Sent]) -> AsyncIterator[Step]:
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
        pf_call = pfpb_grpc.PrefillServiceStub(pool.channel(p.address)).Prefill(
            prefill_request(prep, room_id, d, pair_handoff=direct), timeout=env.request_timeout
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
            raise _PeerFailed(p, Unavailable("the retried prefill ended early", reason="PEER_UNAVAILABLE"))
        first = sent[0] if sent else _prefill_first(p, pf)
        calling.peer = d
        dec_channel = pool.channel(d.address)
        dec_request = decode_request(prep, room_id, p, first)
        if direct:
            dec_request.source.CopyFrom(pf.source)
        call.decode = dec_call = decpb_grpc.DecodeServiceStub(dec_channel).Decode(
            dec_request, timeout=env.request_timeout
        )
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
                call.finished = True
                return
        yield Step([], "", finish=types_pb2.FINISH_REASON_ABORT)


def _prefill_first(prefill: dpb.Peer, pf: pfpb.PrefillResponse) -> _Sent:
    """The first token the prefill's answer carries; a prefill that answered none (its pair's decode
    would stream it) cannot serve the sequential order, and another pair is tried."""
    if not carries_first_token(pf.first_token_source, prefill):
        raise _PeerFailed(
            prefill, Unavailable("the prefill answered without a first token", reason="PEER_UNAVAILABLE")
        )
    return _Sent(pf.first_token, pf.first_logprob)


def prefill_request(
    prep: Prepared, room_id: int, decode: dpb.Peer, *, pair_handoff: bool = False
) -> pfpb.PrefillRequest:
    """The Prefill of a request in `room_id`, paired with `decode`."""
    return pfpb.PrefillRequest(
        pair_handoff=pair_handoff,
        request_id=prep.request_id,
        room_id=room_id,
        decode_peer_id=decode.peer_id,
        decode_epoch=decode.epoch,
        token_ids=prep.token_ids,
        sampling=prep.sampling,
        cache_salt=prep.cache_salt,
    )


def decode_request(
    prep: Prepared, room_id: int, prefill: dpb.Peer, first: _Sent | None = None
) -> decpb.DecodeRequest:
    """The Decode of a request in `room_id`, paired with `prefill`, continuing after `first`; without it
    the decode streams from its own first token (FIRST_TOKEN_SOURCE_DECODE)."""
    req = decpb.DecodeRequest(
        request_id=prep.request_id,
        room_id=room_id,
        prefill_peer_id=prefill.peer_id,
        prefill_epoch=prefill.epoch,
        token_ids=prep.token_ids,
        sampling=prep.sampling,
        first_token_source=types_pb2.FIRST_TOKEN_SOURCE_DECODE,
    )
    if first is not None:
        req.first_token, req.first_logprob = first.token, first.logprob
        req.first_token_source = types_pb2.FIRST_TOKEN_SOURCE_PREFILL
    return req


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


__all__ = ["FlowEnv", "Step", "StreamBroken", "Trace", "abort_room", "colocated_flow", "pd_flow"]
