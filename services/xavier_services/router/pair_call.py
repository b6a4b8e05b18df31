"""One P/D pair call: what every P/D flow shares, whatever carries its prefill and decode calls.

- What the pair declares decides how it is called, never its engine's name: `call_order` (SEQUENTIAL:
  the prefill's answer, then the decode from the first token it carries; CONCURRENT: both at once, the
  decode's stream being the answer from its first token), `pair_handoff` (a sequential pair that meets
  without a directory room) and `first_token_source` (the prefill's answer or the decode's own stream;
  `carries_first_token` reads a prefill's answer by it).
- `concurrently` is the concurrent order's one read loop: the decode's messages while the prefill runs
  beside them, and the prefill's failure (`PrefillFailed`) as soon as it comes, since a decode whose
  prefill failed would otherwise wait out its bootstrap timeout.
- `PairCall` is the one cleanup: however the call ends (finished, failed, cancelled by the client), the
  decode is cancelled, the prefill cancelled (or, once the answer is complete and the transport says so,
  left to end by itself) and its result retrieved, the pair's serving slots released and, for a call that
  did not finish, the handoff ended in the background (`abandon`: abort the room, release the source).

The transports plug into these: `pd` (gRPC, sequential, through a directory room or a pair handoff),
`pd_concurrent` (gRPC, concurrent) and `native` (SGLang's own servers over HTTP, concurrent).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, TypeAlias, TypeVar

from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import types_pb2

from xavier_services.router.peers import Pair, PeerPool

M = TypeVar("M")
FirstTokenSource: TypeAlias = types_pb2.FirstTokenSource.ValueType
Spawn = Callable[[Coroutine[Any, Any, None]], None]

SGLANG_ENGINE = "sglang"
"""`KvLayout.engine` of SGLang peers: those that declare no handoff protocol are concurrent."""


class Order(enum.Enum):
    """How a pair's two calls are made."""

    SEQUENTIAL = "sequential"  # the prefill's answer, then the decode
    CONCURRENT = "concurrent"  # both at once: the prefill answers only once its decode took the KV


def _concurrent(layout: types_pb2.KvLayout) -> bool:
    """HANDOFF_PROTOCOL_CONCURRENT is concurrent, and so is an SGLang peer registered before peers
    declared their protocol; every other handoff is sequential."""
    if layout.handoff == types_pb2.HANDOFF_PROTOCOL_UNSPECIFIED:
        return bool(layout.engine == SGLANG_ENGINE)
    return bool(layout.handoff == types_pb2.HANDOFF_PROTOCOL_CONCURRENT)


def call_order(pair: Pair) -> Order:
    """The order its prefill declares (`_concurrent`)."""
    return Order.CONCURRENT if _concurrent(pair.prefill.layout) else Order.SEQUENTIAL


def pair_handoff(pair: Pair) -> bool:
    """Whether both peers hand over between themselves (HandoffProtocol PAIR), not in a directory room."""
    return all(p.layout.handoff == types_pb2.HANDOFF_PROTOCOL_PAIR for p in (pair.prefill, pair.decode))


def first_token_source(peer: dpb.Peer) -> FirstTokenSource:
    """Where the peer's P/D requests take their first token from: what it declares or, for a peer of
    xavier.v1.0, what its handoff implies (the decode's own stream in the concurrent order)."""
    declared = peer.layout.first_token_source
    if declared != types_pb2.FIRST_TOKEN_SOURCE_UNSPECIFIED:
        return declared
    concurrent = _concurrent(peer.layout)
    return types_pb2.FIRST_TOKEN_SOURCE_DECODE if concurrent else types_pb2.FIRST_TOKEN_SOURCE_PREFILL


def carries_first_token(said: FirstTokenSource, prefill: dpb.Peer) -> bool:
    """Whether a prefill's answer carries the first token: what the answer says
    (`PrefillResponse.first_token_source`) or, from a prefill of xavier.v1.0 that says nothing, what
    the prefill declares."""
    if said == types_pb2.FIRST_TOKEN_SOURCE_UNSPECIFIED:
        said = first_token_source(prefill)
    return bool(said == types_pb2.FIRST_TOKEN_SOURCE_PREFILL)


class PrefillFailed(Exception):
    """The prefill running beside the decode failed first; `error` is what its call raised."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _failed(fut: asyncio.Future[Any]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is not None


async def concurrently(prefill: asyncio.Future[Any], decode: AsyncIterator[M]) -> AsyncIterator[M]:
    """The decode's messages while `prefill` runs beside them; raises `PrefillFailed` once the prefill
    fails, at once if the decode is being waited on (it is interrupted), else before its next message.

    Only a wait on the decode is interrupted, never the consumer holding a message; `decode` is closed
    when this ends.
    """
    task = asyncio.current_task()
    waiting = interrupted = False

    def _ended(fut: asyncio.Future[Any]) -> None:
        nonlocal interrupted
        if waiting and task is not None and _failed(fut):
            interrupted = True
            task.cancel(msg="the prefill failed")

    prefill.add_done_callback(_ended)
    try:
        while True:
            if _failed(prefill):
                raise PrefillFailed(prefill.exception())  # type: ignore[arg-type]
            waiting = True
            try:
                msg = await anext(decode)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not interrupted or task is None or task.uncancel() > 0:
                    raise  # the request itself is cancelled
                raise PrefillFailed(prefill.exception()) from None  # type: ignore[arg-type]
            finally:
                waiting = False
            yield msg
    finally:
        prefill.remove_done_callback(_ended)
        close = getattr(decode, "aclose", None)
        if close is not None:  # an async generator's own cleanup (an HTTP response, a timer) runs now
            await close()


class _Cancellable(Protocol):
    def cancel(self) -> bool: ...


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # a prefill that fails once the answer is complete is no error of the request


@dataclass
class PairCall:
    """What one pair call holds until it ends, and the one place that lets it go (a `with` block).

    `held` are the pair's serving slots in `pool`, taken here; `prefill` and `decode` are the RPCs in
    flight, cancelled at the end (the prefill not when `leave_prefill` and the call finished: it ends
    by itself within its deadline); `beside` is a prefill running beside the decode (concurrent order),
    cancelled the same way and its result retrieved; `abandon` makes the coroutine that ends the handoff
    of a call that did not finish, run in the background by `spawn`. The flow sets `finished` once the
    client's answer is complete.
    """

    pool: PeerPool | None = None
    held: list[dpb.Peer] = field(default_factory=list)
    prefill: _Cancellable | None = None
    decode: _Cancellable | None = None
    beside: asyncio.Future[Any] | None = None
    abandon: Callable[[], Coroutine[Any, Any, None]] | None = None
    spawn: Spawn | None = None
    leave_prefill: bool = False
    finished: bool = False

    def __post_init__(self) -> None:
        if self.pool is not None and self.held:
            self.pool.acquire(*self.held)

    def release(self, peer: dpb.Peer) -> None:
        """Gives `peer`'s serving slot back before the end (a prefill that answered)."""
        for i, held in enumerate(self.held):
            if held is peer and self.pool is not None:
                del self.held[i]
                self.pool.release(peer)
                return

    def __enter__(self) -> PairCall:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        keep = self.finished and self.leave_prefill
        if self.decode is not None:
            self.decode.cancel()
        if self.prefill is not None and not keep:
            self.prefill.cancel()
        if self.beside is not None:
            if not self.beside.done() and not keep:
                self.beside.cancel()
            self.beside.add_done_callback(_retrieve)
        for peer in list(self.held):
            self.release(peer)
        if not self.finished and self.abandon is not None and self.spawn is not None:
            with contextlib.suppress(RuntimeError):  # no loop left to run it: the lease bounds the room
                self.spawn(self.abandon())


__all__ = [
    "Order",
    "PairCall",
    "PrefillFailed",
    "call_order",
    "carries_first_token",
    "concurrently",
    "first_token_source",
    "pair_handoff",
]
