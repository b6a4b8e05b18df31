"""The server interceptor: request id, per-RPC metrics and domain-error mapping.

All three concerns live in one wrapper so each call pays for one extra frame,
not three (the directory's room lifecycle is a handful of small unary RPCs
and its throughput target is set by this overhead). Wrapped handlers are
cached per method, so steady-state calls allocate no handler objects.

* Request id: ``x-request-id`` from the invocation metadata when it is a sane
  token (1..128 of ``[A-Za-z0-9._:-]``), else a new 32-hex-digit id (a random per-process prefix and
  a counter: unique like a uuid4 hex, without a urandom call per RPC). It is bound into
  structlog contextvars (``request_id`` and ``rpc``, the full method path
  ``/pkg.Service/Method``) for the call,
  readable with :func:`current_request_id`, and echoed to the client as
  *trailing* metadata ``x-request-id`` (trailing, not initial: sending initial
  metadata costs an extra batch per unary call and would forbid handlers from
  sending their own). A handler that sets its own trailing metadata replaces it.
* Metrics: ``xavier_rpc_total{service,method,code}`` and
  ``xavier_rpc_seconds{service,method}`` (whole stream for streaming RPCs).
* Errors: a :class:`XavierError` becomes its rich status, and so do the core's
  gRPC-free errors (engine, sampling) through :mod:`.domain_errors`; ``context.abort``
  passes through; anything else is logged with its traceback and the client
  gets INTERNAL / reason ``INTERNAL`` with only the request id.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeAlias

import grpc
import structlog
from prometheus_client import Counter

from .domain_errors import as_xavier_error
from .errors import Internal, InvalidArgument, to_rpc_status
from .logging import get_logger
from .metrics import RpcMetrics, rpc_metrics

__all__ = [
    "REQUEST_ID_KEY",
    "CallScope",
    "RuntimeInterceptor",
    "current_request_id",
    "method_state",
    "new_request_id",
]

REQUEST_ID_KEY = "x-request-id"
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("xavier_request_id", default=None)
_log = get_logger("xavier.rpc")
# Generated request ids: 64 random bits fixed per process, then a 64-bit counter.
_ID_PREFIX = os.urandom(8).hex()
_ID_SEQ = itertools.count(int.from_bytes(os.urandom(4), "big"))

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


def current_request_id() -> str | None:
    """The request id of the RPC being handled in this task, if any."""
    return _REQUEST_ID.get()


class _MethodState:
    """Per-method precomputed labels and metric children (hot path: no label lookups)."""

    __slots__ = ("_counter", "_counts", "full", "method", "seconds", "service")

    def __init__(self, full: str, metrics: RpcMetrics) -> None:
        service, _, method = full.lstrip("/").partition("/")
        self.full = full
        self.service = service or "unknown"
        self.method = method or full
        self.seconds = metrics.seconds.labels(self.service, self.method)
        self._counter = metrics.total
        self._counts: dict[str, Counter] = {}

    def count(self, code: str) -> None:
        child = self._counts.get(code)
        if child is None:
            child = self._counter.labels(self.service, self.method, code)
            self._counts[code] = child
        child.inc()


class CallScope:
    """One call's request id (bound into the log context of the task handling it) and its metrics: the
    per-call RPCs' wrapper and the calls of a session share it."""

    __slots__ = ("code", "request_id", "rid_token", "start", "state", "tokens")

    def __init__(self, state: _MethodState, request_id: str | None) -> None:
        self.state = state
        self.code = "OK"
        sane = request_id is not None and _REQUEST_ID_RE.fullmatch(request_id) is not None
        self.request_id = request_id if sane and request_id else new_request_id()
        self.tokens = structlog.contextvars.bind_contextvars(request_id=self.request_id, rpc=state.full)
        self.rid_token = _REQUEST_ID.set(self.request_id)
        self.start = time.perf_counter()

    def close(self) -> None:
        """Counts the call under `code` and unbinds its request id."""
        self.state.seconds.observe(time.perf_counter() - self.start)
        self.state.count(self.code)
        try:
            structlog.contextvars.reset_contextvars(**self.tokens)
            _REQUEST_ID.reset(self.rid_token)
        except ValueError:
            # A stream closed by the garbage collector finalizes in another context.
            pass


def new_request_id() -> str:
    """A fresh request id for a call that brought none."""
    return f"{_ID_PREFIX}{next(_ID_SEQ) & 0xFFFFFFFFFFFFFFFF:016x}"


def method_state(full: str, metrics: RpcMetrics | None = None) -> _MethodState:
    """The labels and metric children of the method `full` (``/pkg.Service/Method``)."""
    return _MethodState(full, metrics if metrics is not None else rpc_metrics())


class _Call(CallScope):
    """Begin/finish bookkeeping shared by the unary and streaming wrappers."""

    __slots__ = ()

    def __init__(self, state: _MethodState, context: Context) -> None:
        rid: str | None = None
        for key, value in context.invocation_metadata() or ():
            if key == REQUEST_ID_KEY and isinstance(value, str):
                rid = value
                break
        super().__init__(state, rid)
        context.set_trailing_metadata(((REQUEST_ID_KEY, self.request_id),))

    async def fail(self, context: Context, exc: BaseException) -> None:
        """Record the outcome of ``exc`` and abort the call accordingly (re-raises)."""
        err = as_xavier_error(exc)
        if err is not None:
            self.code = err.code.name
            trailing = ((REQUEST_ID_KEY, self.request_id),)
            await context.abort_with_status(to_rpc_status(err, trailing))
        if isinstance(exc, grpc.aio.AbortError):
            code = context.code()
            self.code = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
            raise exc
        if isinstance(exc, asyncio.CancelledError):
            self.code = "CANCELLED"
            raise exc
        self.code = "INTERNAL"
        _log.error("unhandled exception in rpc", exc_info=exc)
        err = Internal("internal error", request_id=self.request_id)
        await context.abort_with_status(to_rpc_status(err, ((REQUEST_ID_KEY, self.request_id),)))

    def finish(self, context: Context) -> None:
        if self.code == "OK":
            code = context.code()
            if isinstance(code, grpc.StatusCode):
                self.code = code.name
        self.close()


Behaviour = Callable[..., Any]


class _Undecodable:
    """What the request deserializer hands over when the bytes do not parse (protobuf raises on a string
    field that is not UTF-8): the handler wrapper answers INVALID_ARGUMENT instead of gRPC's UNKNOWN."""

    __slots__ = ()


_UNDECODABLE = _Undecodable()


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:
            return _UNDECODABLE

    return parse


def _undecodable(state: _MethodState) -> InvalidArgument:
    return InvalidArgument(
        f"the {state.method} request does not parse: a string field is not valid UTF-8, or the bytes are "
        "not a protobuf message",
        reason="INVALID_ENCODING",
        method=state.method,
    )


def _wrap_unary(state: _MethodState, inner: Behaviour) -> Behaviour:
    async def behaviour(request: Any, context: Context) -> Any:
        call = _Call(state, context)
        try:
            if request is _UNDECODABLE:
                raise _undecodable(state)
            result = inner(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result
        except BaseException as exc:
            await call.fail(context, exc)
            raise
        finally:
            call.finish(context)

    return behaviour


def _wrap_stream(state: _MethodState, inner: Behaviour) -> Behaviour:
    async def behaviour(request: Any, context: Context) -> AsyncIterator[Any]:
        call = _Call(state, context)
        try:
            if request is _UNDECODABLE:
                raise _undecodable(state)
            async with aclosing(inner(request, context)) as stream:
                async for item in stream:
                    yield item
        except GeneratorExit:
            call.code = "CANCELLED"
            raise
        except BaseException as exc:
            await call.fail(context, exc)
            raise
        finally:
            call.finish(context)

    return behaviour


def _wrap_handler(state: _MethodState, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    # Only a single request message is checked before the handler runs; streamed requests are unused.
    raw_de, se = handler.request_deserializer, handler.response_serializer
    de = _lenient(raw_de)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_wrap_unary(state, handler.unary_unary), de, se)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_wrap_unary(state, handler.stream_unary), raw_de, se)
    if handler.unary_stream is not None:
        inner = handler.unary_stream
        # Async generators are re-yielded; coroutines that use context.write() are awaited.
        wrapped = (
            _wrap_stream(state, inner) if inspect.isasyncgenfunction(inner) else _wrap_unary(state, inner)
        )
        return grpc.unary_stream_rpc_method_handler(wrapped, de, se)
    if handler.stream_stream is not None:
        inner = handler.stream_stream
        wrapped = (
            _wrap_stream(state, inner) if inspect.isasyncgenfunction(inner) else _wrap_unary(state, inner)
        )
        return grpc.stream_stream_rpc_method_handler(wrapped, raw_de, se)
    return handler


class RuntimeInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc,unused-ignore]
    """Request id + metrics + error mapping for every RPC of a ``grpc.aio`` server."""

    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self._metrics = metrics if metrics is not None else rpc_metrics()
        self._cache: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method
        cached = self._cache.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _wrap_handler(_MethodState(method, self._metrics), handler)
        self._cache[method] = (handler, wrapped)
        return wrapped
