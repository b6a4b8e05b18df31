"""The server side of call sessions: many calls of one caller as messages on one bidirectional stream.

A session RPC (`PrefillService.PrefillSession`, `DecodeService.DecodeSession`) carries calls that would
otherwise be one RPC each. `serve_session` checks the caller once, when the stream opens, with the same
`require` the per-call methods make, then runs each call's own servicer method as a task, handing it a
`CallContext` in place of the `ServicerContext` (the stream's identity, the call's request id as
invocation metadata, its deadline and cancellation). What a per-call RPC gets from `RuntimeInterceptor`
each call gets here: its request id bound into the log context, `xavier_rpc_*` metrics under the
per-call method's name, and typed errors mapped to the same status with one `ErrorInfo`
(`status_proto`), sent as the call's result.

A cancel message, the call's deadline or the stream's end cancels the call's task, exactly as a
cancelled RPC cancels its handler, so the servicers' own cleanup (pages, holds, rooms) runs unchanged.

One writer per stream sends every result queued while it was waiting as one message: results of one
loop iteration leave together, and nothing waits on a timer. A stream's message whose call ended with
it is marked `last`, so a call that ends well costs no separate status.

A call's answer larger than the server's message limit (`limit_messages`, the service's
`max_message_bytes`) is never sent: that call alone ends RESOURCE_EXHAUSTED (MESSAGE_TOO_LARGE), where
the message would have broken the stream for every call on it.

A stopping server ends its sessions (`end_sessions`): new calls are refused UNAVAILABLE
(SHUTTING_DOWN), running ones finish, then the stream ends, so an idle session never holds a shutdown
for its whole grace period.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from google.rpc import status_pb2

from .channels import DEFAULT_MAX_MESSAGE_BYTES
from .domain_errors import as_xavier_error
from .durations import to_seconds
from .errors import CapacityExhausted, Internal, Unavailable, XavierError, status_proto
from .identity import require
from .interceptors import REQUEST_ID_KEY, CallScope, _MethodState, method_state
from .logging import get_logger
from .session_client import ENVELOPE_BYTES, batches

__all__ = ["CallContext", "SessionMethod", "end_sessions", "limit_messages", "serve_session"]

_log = get_logger("xavier.rpc.session")
_OK, _DEADLINE_EXCEEDED, _UNIMPLEMENTED = 0, 4, 12  # google.rpc.Code
_LIVE: weakref.WeakSet[_Session] = weakref.WeakSet()
_limit = [DEFAULT_MAX_MESSAGE_BYTES]  # the process's gRPC message limit (`limit_messages`)


def limit_messages(max_message_bytes: int) -> None:
    """Sets the message limit of this process's server (its `max_message_bytes`, which the server
    starting here passes): a call's answer past it is refused alone (see the module's text)."""
    _limit[0] = max_message_bytes


@dataclass(frozen=True)
class SessionMethod:
    """One method a session carries: the call's oneof field `name`, the per-call method's full name
    (`/pkg.Service/Method`, for logs and metrics), its servicer method, and whether it streams.

    `ends`, for a streaming method, says whether a message is the stream's last word (Decode's finishing
    message): it goes out marked `last`, so the caller's call ends with it, in that message. Otherwise a
    stream's end waits for the servicer's cleanup, the writer has often sent the message alone by then,
    and the end costs one more message each way (the caller's cancel, the server's OK)."""

    name: str
    full: str
    handler: Callable[[Any, Any], Any]
    streaming: bool = False
    ends: Callable[[Any], bool] | None = None


class CallContext:
    """What a servicer method reads from its `ServicerContext`, for one call of a session."""

    __slots__ = ("_auth", "_deadline", "_loop", "_metadata", "_stream", "_task")

    def __init__(
        self, stream: Any, auth: Mapping[str, Sequence[bytes]], request_id: str, deadline: float | None
    ) -> None:
        self._stream = stream
        self._auth = auth
        self._metadata = ((REQUEST_ID_KEY, request_id),)
        self._deadline = deadline
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()

    def auth_context(self) -> Mapping[str, Sequence[bytes]]:
        """The session's connection's auth context: every call of a stream has its caller."""
        return self._auth

    def peer(self) -> str:
        return str(self._stream.peer())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._loop.time())

    def cancelled(self) -> bool:
        return self._task is not None and self._task.cancelling() > 0

    def set_trailing_metadata(self, metadata: Any) -> None:
        """Calls of a session have no trailers of their own (the request id is the caller's)."""


class _Session:
    """One open session: its running calls and its single writer."""

    def __init__(
        self, context: Any, methods: Sequence[SessionMethod], result: Callable[..., Message]
    ) -> None:
        self.context = context
        self.auth: Mapping[str, Sequence[bytes]] = context.auth_context()  # one connection, one caller
        self.methods = {m.name: (m, method_state(m.full)) for m in methods}
        self.result = result
        self.calls: dict[int, asyncio.Task[None]] = {}
        self.pending: list[Any] = []
        self.tails: dict[int, Any] = {}  # each call's latest unsent result (to mark `last` on)
        self.ended: set[int] = set()  # running calls whose last result is queued or sent
        self.ready = asyncio.Event()
        self.closing = False
        self.finished = False  # no call will queue anything more: the writer ends once it sent all
        self.stopped = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()

    def send(self, call_id: int, field: str, value: Any, last: bool = False) -> None:
        """Queues one result of a call; raises `CapacityExhausted` (MESSAGE_TOO_LARGE), sending
        nothing, for an answer past the message limit (the call's task then ends with that status)."""
        if call_id in self.ended:
            return  # the caller has the call's last word: what its cleanup raised since stays here
        if not isinstance(value, bytes):
            size, limit = value.ByteSize(), _limit[0]
            if size > limit - ENVELOPE_BYTES:
                raise CapacityExhausted(
                    f"the {field} answer is {size} bytes, more than a message may carry ({limit})",
                    reason="MESSAGE_TOO_LARGE",
                    method=field,
                    bytes=size,
                    limit=limit,
                )
        result = self.result(call_id=call_id)
        if isinstance(value, bytes):
            setattr(result, field, value)
        else:
            getattr(result, field).CopyFrom(value)
        if last:
            result.last = True  # type: ignore[attr-defined]
            self.ended.add(call_id)
        self.pending.append(result)
        self.tails[call_id] = result
        self.ready.set()

    def end_stream(self, call_id: int) -> None:
        """A streaming call ended well: its last unsent message says so, else an OK status does."""
        if call_id in self.ended:
            return
        tail = self.tails.get(call_id)
        if tail is not None and tail.WhichOneof("outcome") != "status":
            tail.last = True
            return
        self.send(call_id, "status", _status_bytes(_OK, ""))

    async def write_loop(self, response: Callable[..., Message]) -> None:
        while True:
            await self.ready.wait()
            self.ready.clear()
            queued, self.pending = self.pending, []
            self.tails.clear()
            for batch in batches(queued):
                await self.context.write(response(results=batch))
            if self.finished and not self.pending:
                return

    def start(self, call: Any) -> None:
        kind = call.WhichOneof("method")
        if kind == "cancel":
            task = self.calls.get(call.call_id)
            if task is not None:
                task.cancel()
            return
        if call.call_id in self.calls:
            return  # a duplicate id: the running call keeps it (the caller numbers calls uniquely)
        self.idle.clear()
        task = asyncio.get_running_loop().create_task(self._run(call, kind))
        self.calls[call.call_id] = task
        # On the task, not in it: a call cancelled in the message that started it never runs.
        task.add_done_callback(functools.partial(self._done, call.call_id))

    async def _run(self, call: Any, kind: str | None) -> None:
        found = self.methods.get(kind or "")
        if found is None:  # a method this build does not know: UNIMPLEMENTED, as for an unknown RPC
            self.send(
                call.call_id, "status", _status_bytes(_UNIMPLEMENTED, f"the session carries no {kind!r} call")
            )
            return
        method, state = found
        scope = CallScope(state, call.request_id or None)
        try:
            await self._serve(call, method, state, scope)
        finally:
            scope.close()

    async def _serve(self, call: Any, method: SessionMethod, state: _MethodState, scope: CallScope) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + to_seconds(call.timeout) if call.HasField("timeout") else None
        ctx = CallContext(self.context, self.auth, scope.request_id, deadline)
        request = getattr(call, method.name)
        try:
            if self.closing:
                raise Unavailable("the service is shutting down", reason="SHUTTING_DOWN")
            async with asyncio.timeout_at(deadline) as watch:
                try:
                    if method.streaming:
                        async with aclosing(method.handler(request, ctx)) as stream:
                            async for msg in stream:
                                last = method.ends is not None and method.ends(msg)
                                self.send(call.call_id, method.name, msg, last)
                        self.end_stream(call.call_id)
                    else:
                        self.send(call.call_id, method.name, await method.handler(request, ctx))
                except TimeoutError:
                    if watch.expired():
                        raise
                    raise Internal("internal error", request_id=scope.request_id) from None
        except TimeoutError:
            scope.code = "DEADLINE_EXCEEDED"
            self.send(call.call_id, "status", _status_bytes(_DEADLINE_EXCEEDED, "Deadline Exceeded"))
        except asyncio.CancelledError:
            scope.code = "CANCELLED"  # by the caller or the stream's end: nobody waits for an answer
            raise
        except Exception as exc:
            err = as_xavier_error(exc)
            if err is None:
                _log.error("unhandled exception in rpc", exc_info=exc)
                err = Internal("internal error", request_id=scope.request_id)
            scope.code = err.code.name
            self.send(call.call_id, "status", _error_bytes(err))

    def _done(self, call_id: int, _task: object = None) -> None:
        self.calls.pop(call_id, None)
        self.ended.discard(call_id)
        if not self.calls:
            self.idle.set()

    async def close(self) -> None:
        """Refuses new calls and waits for the running ones (a stopping server)."""
        self.closing = True
        self.stopped.set()
        await self.idle.wait()


def _status_bytes(code: int, message: str) -> bytes:
    return bytes(status_pb2.Status(code=code, message=message).SerializeToString())


def _error_bytes(err: XavierError) -> bytes:
    return bytes(status_proto(err).SerializeToString())


async def serve_session(
    requests: AsyncIterator[Any],
    context: Any,
    *,
    rpc: str,
    roles: Collection[str],
    methods: Sequence[SessionMethod],
    result: Callable[..., Message],
    response: Callable[..., Message],
) -> None:
    """Serves one session stream until the caller closes it (then its running calls finish first) or it
    breaks (then they are cancelled). `rpc` names the session method in a refusal."""
    require(context, rpc, roles=roles)
    session = _Session(context, methods, result)
    _LIVE.add(session)
    writer = asyncio.get_running_loop().create_task(session.write_loop(response))
    ended = asyncio.get_running_loop().create_task(_read(session, requests))
    stop = asyncio.ensure_future(session.stopped.wait())
    try:
        await asyncio.wait({ended, writer, stop}, return_when=asyncio.FIRST_COMPLETED)
        for task in (writer, ended):
            if task.done() and not task.cancelled():
                task.result()  # a failed read or write: the stream broke
        await session.idle.wait()  # the caller is done sending, or the server stops: calls finish
        session.finished = True
        session.ready.set()
        await writer  # what the last calls queued goes out, then the stream ends OK
    finally:
        _LIVE.discard(session)
        stop.cancel()
        ended.cancel()
        for task in list(session.calls.values()):
            task.cancel()  # the stream broke: each call ends as a cancelled RPC would
        writer.cancel()


async def _read(session: _Session, requests: AsyncIterator[Any]) -> None:
    async for msg in requests:
        for call in msg.calls:
            session.start(call)


async def end_sessions() -> None:
    """Ends every open session of this process once its running calls finished (a stopping server)."""
    await asyncio.gather(*(s.close() for s in list(_LIVE)), return_exceptions=True)
