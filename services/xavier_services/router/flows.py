"""What the routing flows share, and the colocated flow (a whole request on one unified replica).

A flow is an async generator of `Step`s. Cancelling the task that runs it (client cancel, disconnect or
Abort) runs its `finally`: the downstream calls are cancelled and, in P/D, the handoff is ended in the
background, so the client never waits for cleanup. The P/D flow is `pd` (over `pair_call`).

Failover (`failover`): until a decode (or unified replica) has streamed a token, a peer that fails
(refused connection, UNAVAILABLE, or gone from the directory) is left out and the request runs again on
another peer, at most `failover_attempts` times. A streaming peer that sends nothing for
`env.stall_seconds` is failed the same way (`paced`). `peer_failures` turns a failed or stalled call
into these typed errors: `PeerFailed` (fail over) before a streamed token, and after one
`StreamBroken`, which `migration` turns into a move to another pair (or, without one, the client's
PEER_FAILED). The gRPC requests of a P/D pair (`prefill_request`, `decode_request`) are built here for
both of its orders.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from xavier.v1 import decode_service_pb2 as decpb
from xavier.v1 import decode_service_pb2_grpc as decpb_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import error_reason_pb2 as er
from xavier.v1 import prefill_service_pb2 as pfpb
from xavier.v1 import types_pb2

from xavier_core.runtime import Unavailable, XavierError, from_rpc_error, get_logger
from xavier_core.runtime.durations import to_seconds
from xavier_services.router.health import peer_key, role_name
from xavier_services.router.pacing import Stalled, paced
from xavier_services.router.pair_call import Spawn
from xavier_services.router.peers import PeerPool
from xavier_services.router.request import Prepared, require_features, serves

_log = get_logger("xavier.router.flows")


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


class PeerFailed(Exception):
    """A peer failed before the request streamed a token from it: `failover` tries another."""

    def __init__(self, peer: dpb.Peer, error: XavierError, cause: str = "peer_gone") -> None:
        super().__init__(str(error))
        self.peer = peer
        self.error = error
        self.cause = cause  # unavailable (transport), peer_gone (left the directory, new epoch), stalled


class StreamBroken(Unavailable):
    """A peer failed or stalled after the client got tokens it streamed: the request cannot fail over
    inside the flow. Raised to the client as is (PEER_FAILED) unless `migration` moves the request;
    `cause` is unavailable (transport), peer_gone (left the directory, new epoch) or stalled."""

    def __init__(self, failed: PeerFailed) -> None:
        exhausted = _exhausted(failed, 1)
        super().__init__(exhausted.message, reason="PEER_FAILED", **exhausted.metadata)
        self.peer = failed.peer
        self.cause = failed.cause


def _stalled(peer: dpb.Peer, pool: PeerPool, seconds: float) -> PeerFailed:
    """A stalled peer leaves selection (a probe brings it back once it answers) and fails over."""
    pool.health.mark_down(peer, f"sent nothing for {seconds:g} s")
    error = Unavailable(f"sent nothing for {seconds:g} s", reason="PEER_UNAVAILABLE")
    return PeerFailed(peer, error, "stalled")


def _lost(err: Exception, streamed: bool) -> Exception:
    """What an attempt raises for `err`: a peer's failure after it streamed tokens breaks the stream."""
    if isinstance(err, PeerFailed) and streamed:
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
    """The typed error of a failed peer call, or `PeerFailed` when another peer may serve the request.

    A transport failure (UNAVAILABLE without an ErrorInfo: refused, reset, unreachable) takes the peer
    out of selection at once; the caller reports it to the client naming the peer, never its address.
    """
    err = from_rpc_error(exc)
    if err.code == grpc.StatusCode.UNAVAILABLE or err.is_reason(*_PEER_GONE):
        pool.invalidate()
        transport = err.code == grpc.StatusCode.UNAVAILABLE and err.is_reason(er.ERROR_REASON_UNAVAILABLE)
        if transport:
            pool.health.mark_down(peer, "call failed: UNAVAILABLE")
        return PeerFailed(peer, err, "unavailable" if transport else "peer_gone")
    return err


def _exhausted(failure: PeerFailed, attempts: int) -> Unavailable:
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


def note(trace: Trace | None, *peers: dpb.Peer) -> None:
    if trace is not None:
        trace.peers.extend(f"{role_name(p.role)}:{p.peer_id}" for p in peers)


async def failover(
    attempt: Callable[[frozenset[str]], AsyncIterator[Step]],
    env: FlowEnv,
    trace: Trace | None,
    avoid: frozenset[str] = frozenset(),
) -> AsyncIterator[Step]:
    """Runs `attempt(exclude)` until it ends without `PeerFailed`, leaving failed peers out each time
    (and from the first, the peers of `avoid`: `health.peer_key`s a migrated request's streams broke on)."""
    tried: set[str] = set(avoid)
    failure: PeerFailed | None = None
    for n in range(env.failover_attempts):
        try:
            async with aclosing(attempt(frozenset(tried))) as steps:  # type: ignore[type-var]
                async for step in steps:
                    yield step
            return
        except PeerFailed as failed:
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


def colocated_flow(
    prep: Prepared, env: FlowEnv, trace: Trace | None = None, avoid: frozenset[str] = frozenset()
) -> AsyncIterator[Step]:
    """Serves the whole request on the least-loaded healthy unified replica (with failover), leaving
    the replicas of `avoid` out."""
    return failover(lambda exclude: _colocated_attempt(prep, env, exclude, trace), env, trace, avoid)


async def pick(env: FlowEnv, exclude: frozenset[str], pick: Callable[[], Awaitable[T]]) -> T:
    """A request's first pick waits up to `env.peer_wait` for peers while none is registered (a
    restarted directory has them back within about a second); a failover's pick does not wait."""
    if exclude or env.peer_wait <= 0:
        return await pick()
    return await env.pool.wait_for_peers(pick, env.peer_wait)


async def _colocated_attempt(
    prep: Prepared, env: FlowEnv, exclude: frozenset[str], trace: Trace | None
) -> AsyncIterator[Step]:
    pool = env.pool
    able = serves(prep)
    peer = await pick(env, exclude, lambda: pool.retry_unavailable(lambda: pool.pick_unified(exclude, able)))
    require_features(prep, peer.layout, "unified")
    note(trace, peer)
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


@dataclass
class FirstToken:
    """The first token the client already has (a retry's decode continues from it)."""

    token: int
    logprob: float


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
    prep: Prepared, room_id: int, prefill: dpb.Peer, first: FirstToken | None = None
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
        cache_salt=prep.cache_salt,
    )
    if first is not None:
        req.first_token, req.first_logprob = first.token, first.logprob
        req.first_token_source = types_pb2.FIRST_TOKEN_SOURCE_PREFILL
    return req


__all__ = [
    "Calling",
    "FirstToken",
    "FlowEnv",
    "PeerFailed",
    "Step",
    "StreamBroken",
    "Trace",
    "colocated_flow",
    "decode_request",
    "failover",
    "note",
    "peer_failures",
    "pick",
    "prefill_request",
]
