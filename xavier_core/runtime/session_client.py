"""The caller's side of call sessions: many calls to one peer service as messages on one stream.

A `CallSession` belongs to one channel and one session RPC. It opens its stream on first use and
again on the first call after it broke. One writer task sends every call (and cancel) queued while it
was waiting as one message, so calls made in one loop iteration leave together and nothing waits on a
timer; one reader hands each result to its call.

Its calls look like grpc.aio's to the code that makes them: `SessionUnaryCall` is awaited,
`SessionStreamCall` is read (`read()` until `grpc.aio.EOF`, or iterated); both have `cancel()` and
`wait_for_connection()`, and fail with the `grpc.aio.AioRpcError` the per-call RPC would have raised
(status code, message and the `ErrorInfo` in the trailers, so `from_rpc_error` reads them alike). A
cancelled call raises `asyncio.CancelledError`, as a cancelled grpc.aio call does. A stream that breaks
fails every open call UNAVAILABLE, with no ErrorInfo (a transport failure), unless the service ended
it with a status of its own (a refused caller's PERMISSION_DENIED), which they all get. A call whose
request is larger than the channel's message limit is never sent: it alone fails RESOURCE_EXHAUSTED
(MESSAGE_TOO_LARGE), where the message would have broken the stream for every call on it.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message
from google.rpc import status_pb2

from .channels import DEFAULT_MAX_MESSAGE_BYTES
from .durations import to_duration
from .errors import CapacityExhausted, status_proto

__all__ = ["BATCH_BYTES", "ENVELOPE_BYTES", "CallSession", "SessionStreamCall", "SessionUnaryCall", "batches"]

_DETAILS_KEY = "grpc-status-details-bin"
BATCH_BYTES = 4 << 20
"""A session message carries calls (or results) up to about this many bytes, well below the 16 MiB
message limit both sides set: a burst of long prompts goes out as several messages, never one the
peer must refuse (which would break the stream for every call on it)."""


ENVELOPE_BYTES = 1 << 10
"""Room left in a message for what wraps one call's request or answer (call id, request id, deadline,
flags, framing): a request or answer larger than the message limit less this is not sent."""


def batches(items: list[Any], limit: int = BATCH_BYTES) -> Iterator[list[Any]]:
    """`items` in order, cut into runs of at most `limit` bytes (an item larger than that alone)."""
    if len(items) == 1:  # alone whatever its size: measuring it would serialize it once more
        yield items
        return
    batch: list[Any] = []
    size = 0
    for item in items:
        n = item.ByteSize()
        if batch and size + n > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


_CANCELLED = object()


def _rpc_error(code: grpc.StatusCode, message: str, details: bytes | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((_DETAILS_KEY, details)) if details else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _status_error(blob: bytes) -> grpc.aio.AioRpcError | None:
    """The error a result's status says, or None for OK."""
    status = status_pb2.Status.FromString(blob)
    if status.code == 0:
        return None
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return _rpc_error(code, status.message, blob if status.details else None)


class _Call(ABC):
    """What the session knows of one open call."""

    __slots__ = ("_stream", "_timer", "call_id", "done", "error", "session")

    def __init__(self, session: CallSession, call_id: int, timeout: float | None) -> None:
        self.session = session
        self._stream = session._stream
        self.call_id = call_id
        self.done = False
        self.error: BaseException | None = None  # how the call failed, once it did
        self._timer = (
            asyncio.get_running_loop().call_later(timeout, self._expire) if timeout is not None else None
        )

    def _expire(self) -> None:
        if not self.done:
            self.session._cancel(self.call_id)
            self.fail(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _close(self) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        self.session._calls.pop(self.call_id, None)

    def cancel(self) -> bool:
        """Cancels the call here and on the peer; False when it had already ended."""
        if self.done:
            return False
        self.session._cancel(self.call_id)
        self.fail(_CANCELLED)
        return True

    async def wait_for_connection(self) -> None:
        """Returns once the session's stream is connected; raises how the call failed if it did (a
        peer that refuses the stream fails it UNAVAILABLE)."""
        await self.session._connected(self._stream)
        if self.error is not None:
            raise self.error

    def _failed(self, error: object) -> None:
        if isinstance(error, BaseException):
            self.error = error

    @abstractmethod
    def deliver(self, field: str, result: Any) -> None:
        """Hands the call one result (`field`: the result's outcome, a response or the final status)."""

    @abstractmethod
    def fail(self, error: object) -> None:
        """Ends the call with `error` (`_CANCELLED`: cancelled here), unless it already ended."""


class SessionUnaryCall(_Call):
    """A unary call on a session: awaited for its response."""

    __slots__ = ("_future",)

    def __init__(self, session: CallSession, call_id: int, timeout: float | None) -> None:
        super().__init__(session, call_id, timeout)
        self._future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._future.__await__()

    def deliver(self, field: str, result: Any) -> None:
        if self.done:
            return
        if field == "status":
            error = _status_error(getattr(result, field))
            if error is not None:
                self.fail(error)
                return
        self._close()
        self._future.set_result(getattr(result, field))

    def fail(self, error: object) -> None:
        if self.done:
            return
        self._close()
        self._failed(error)
        if error is _CANCELLED:
            self._future.cancel()
        else:
            self._future.set_exception(error)  # type: ignore[arg-type]
            self._future.exception()  # a failure nobody awaits (the call was left) is no warning


class SessionStreamCall(_Call):
    """A server-streaming call on a session: its messages by `read()` (then `grpc.aio.EOF`)."""

    __slots__ = ("_end", "_messages", "_waiter")

    def __init__(self, session: CallSession, call_id: int, timeout: float | None) -> None:
        super().__init__(session, call_id, timeout)
        self._messages: deque[Any] = deque()
        self._end: object | None = None  # EOF, _CANCELLED or the error, once the call ended
        self._waiter: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def deliver(self, field: str, result: Any) -> None:
        if self.done:
            return
        if field == "status":
            self._finish(_status_error(getattr(result, field)) or grpc.aio.EOF)
            return
        self._messages.append(getattr(result, field))
        if result.last:
            self._finish(grpc.aio.EOF)
        self._wake()

    def _finish(self, end: object) -> None:
        self._close()
        self._end = end
        self._wake()

    def fail(self, error: object) -> None:
        if not self.done:
            self._messages.clear()  # a cancelled or failed call hands out nothing more
            self._failed(error)
            self._finish(error)

    async def read(self) -> Any:
        """The next message, or `grpc.aio.EOF` once the call ended well; raises how it failed."""
        while not self._messages:
            end = self._end
            if end is grpc.aio.EOF:
                return end
            if end is _CANCELLED:
                raise asyncio.CancelledError
            if end is not None:
                raise end  # type: ignore[misc]
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._messages.popleft()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            msg = await self.read()
            if msg is grpc.aio.EOF:
                return
            yield msg


class CallSession:
    """Calls of one session RPC on one channel (`open_stream` starts the RPC: a stub's method).

    `request` is the session's request message type (its `calls` repeat the call type `call`)."""

    def __init__(
        self,
        open_stream: Callable[[], Any],
        request: Callable[..., Message],
        call: Callable[..., Message],
        name: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._open = open_stream
        self.max_message_bytes = max_message_bytes  # the channel's: a larger call is refused alone
        self._request = request
        self._call_type = call
        self.name = name
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._queue: list[Any] = []
        self._ready: asyncio.Event | None = None
        self._stream: Any = None
        self._tasks: tuple[asyncio.Task[None], ...] = ()
        self.opened = 0  # streams opened so far (a break and the next call open one more)
        self.closed = False

    def unary(
        self, method: str, request: Message, *, request_id: str, timeout: float | None
    ) -> SessionUnaryCall:
        """Starts the unary call `method` (the call's oneof field) with `request`."""
        call: SessionUnaryCall = self._start(SessionUnaryCall, method, request, request_id, timeout)
        return call

    def stream(
        self, method: str, request: Message, *, request_id: str, timeout: float | None
    ) -> SessionStreamCall:
        """Starts the server-streaming call `method` with `request`."""
        call: SessionStreamCall = self._start(SessionStreamCall, method, request, request_id, timeout)
        return call

    def _start(self, kind: Any, method: str, request: Message, request_id: str, timeout: float | None) -> Any:
        call_id = next(self._ids)
        if self._stream is None and not self.closed:
            try:
                self._connect()
            except grpc.aio.UsageError:  # its channel was closed under it
                self.closed = True
        if self.closed:
            # Retired (its peer left) or its channel closed: a caller that still held it gets what a
            # broken session gives, and fails over.
            closed_call = kind(self, call_id, None)
            closed_call.fail(_rpc_error(grpc.StatusCode.UNAVAILABLE, f"the {self.name} session is closed"))
            return closed_call
        call = kind(self, call_id, timeout)
        entry = self._call_type(call_id=call_id, request_id=request_id)
        getattr(entry, method).CopyFrom(request)
        if timeout is not None:
            entry.timeout.CopyFrom(to_duration(timeout))  # type: ignore[attr-defined]
        self._calls[call_id] = call
        size = entry.ByteSize()
        if size > self.max_message_bytes - ENVELOPE_BYTES:
            # Sent, it would break the stream for every call on it: this call alone fails, as an RPC's
            # oversized message fails that RPC alone.
            refused = CapacityExhausted(
                f"the {method} request is {size} bytes, more than a message may carry "
                f"({self.max_message_bytes})",
                reason="MESSAGE_TOO_LARGE",
                method=method,
                bytes=size,
                limit=self.max_message_bytes,
            )
            call.fail(_status_error(status_proto(refused).SerializeToString()))
            return call
        self._enqueue(entry)
        return call

    def _cancel(self, call_id: int) -> None:
        entry = self._call_type(call_id=call_id)
        entry.cancel.SetInParent()  # type: ignore[attr-defined]
        self._enqueue(entry)

    def _enqueue(self, entry: Any) -> None:
        self._queue.append(entry)
        if self._ready is not None:
            self._ready.set()

    def _connect(self) -> None:
        self._stream = stream = self._open()
        self.opened += 1
        self._ready = ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = (loop.create_task(self._write(stream, ready)), loop.create_task(self._read(stream)))

    async def _connected(self, stream: Any) -> None:
        if stream is None:
            return
        try:
            await stream.wait_for_connection()
        except grpc.aio.AioRpcError as exc:
            self._broke(stream, exc)

    async def _write(self, stream: Any, ready: asyncio.Event) -> None:
        try:
            while True:
                await ready.wait()
                ready.clear()
                queued, self._queue = self._queue, []
                for batch in batches(queued):
                    await stream.write(self._request(calls=batch))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._broke(stream, exc)

    async def _read(self, stream: Any) -> None:
        try:
            while True:
                msg = await stream.read()
                if msg is grpc.aio.EOF:
                    self._broke(stream, None)
                    return
                for result in msg.results:
                    call = self._calls.get(result.call_id)
                    if call is not None:
                        call.deliver(result.WhichOneof("outcome"), result)
        except grpc.aio.AioRpcError as exc:
            self._broke(stream, exc)

    def _broke(self, stream: Any, exc: BaseException | None) -> None:
        """Fails every open call of `stream` (if it is still the session's) and lets the next call
        open a new one."""
        if stream is not self._stream:
            return
        self._stream = None
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        stream.cancel()
        error = _break_error(self.name, exc)
        calls, self._calls, self._queue = list(self._calls.values()), {}, []
        for call in calls:
            call.fail(error)

    async def close(self) -> None:
        """Ends the stream; its open calls, and any call started from now on, fail UNAVAILABLE."""
        self.closed = True
        if self._stream is not None:
            self._broke(self._stream, None)


def _break_error(name: str, exc: BaseException | None) -> grpc.aio.AioRpcError:
    """UNAVAILABLE without an ErrorInfo (a transport failure), or the status the service ended the
    stream with when it said why (its own ErrorInfo)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        trailing = exc.trailing_metadata() or ()
        if any(key == _DETAILS_KEY for key, _ in trailing):
            return exc
        why = f"{exc.code().name}: {exc.details()}"
    else:
        why = "ended"
    return _rpc_error(grpc.StatusCode.UNAVAILABLE, f"the {name} session broke ({why})")
