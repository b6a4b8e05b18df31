"""The HTTP front's connection guard: a cap on open connections and a deadline for each request's headers.

aiohttp holds a connection open for as long as its peer keeps it: partial headers, a slow trickle, or
thousands of idle sockets each cost a file descriptor until the process has none left. The guard wraps
aiohttp's protocol factory:

- at most `max_connections` open at once; one more is answered ``503`` with a JSON body and closed,
  with a log line (at most one a second) and ``xavier_http_connections_refused_total``;
- a connection must deliver a request's complete headers within `header_timeout` of its first byte
  (or of being opened): the deadline is armed while it waits for headers and disarmed when the
  router's middleware sees the request (``request_started``), re-armed for the next request on a
  kept-alive connection (``request_done``). A connection past it is closed
  (``xavier_http_connections_timed_out_total``).

The body has its own deadline where the OpenAI front reads it (`OpenAiFront._body`): 408 ``REQUEST_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge

from xavier_core.runtime import get_registry
from xavier_core.runtime.logging import get_logger

__all__ = ["ConnectionGuard", "GuardedProtocol"]

_log = get_logger("xavier.router.http")
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


def _refusal_body(reason: str) -> bytes:
    """The OpenAI error shape of a refused connection (written before any request is read)."""
    error = {"message": "too many open connections", "type": "server_error", "code": reason, "param": None}
    return json.dumps({"error": error}).encode()


_REFUSAL_BODY = _refusal_body(reason="TOO_MANY_CONNECTIONS")


@functools.cache
def _metrics() -> tuple[Counter, Counter, Gauge]:
    """The front's connection metrics, registered once per process."""
    registry = get_registry()
    return (
        Counter("xavier_http_connections_refused", "HTTP connections refused at the cap", registry=registry),
        Counter(
            "xavier_http_connections_timed_out",
            "HTTP connections closed because a request's headers did not arrive in time",
            registry=registry,
        ),
        Gauge("xavier_http_connections", "open HTTP connections", registry=registry),
    )


class ConnectionGuard:
    """Counts the front's connections and makes the protocols that enforce the cap and deadlines."""

    def __init__(
        self, factory: Callable[[], asyncio.Protocol], max_connections: int, header_timeout: float
    ) -> None:
        self._factory = factory
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open = 0
        self._last_log = 0.0
        self.refused, self.timed_out, self.gauge = _metrics()

    def __call__(self) -> asyncio.Protocol:
        return GuardedProtocol(self, self._factory())

    def _note(self, what: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last_log >= 1.0:
            self._last_log = now
            _log.warning(what, **fields)


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the guard's cap and header deadline around it."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._transport: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._waiting = True  # for a request's headers
        self._counted = False

    # --- asyncio ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # (uvloop's transports are not asyncio.Transport instances)
        guard = self._guard
        if guard.open >= guard.max_connections:
            guard.refused.inc()
            guard._note("HTTP connection refused: the connection cap is reached", limit=guard.max_connections)
            self._transport.write(_REFUSAL % (len(_REFUSAL_BODY), _REFUSAL_BODY))
            transport.close()
            return
        guard.open += 1
        guard.gauge.inc()
        self._counted = True
        self._inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        if self._waiting and self._timer is None:
            self._arm()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._counted else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            self._guard.open -= 1
            self._guard.gauge.dec()
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._counted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._counted:
            self._inner.resume_writing()

    # --- the router's middleware -----------------------------------------------------------------

    def request_started(self) -> None:
        """The request's headers arrived (aiohttp parsed them and called the handlers)."""
        self._waiting = False
        self._disarm()

    def request_done(self) -> None:
        """The response went out: on a kept-alive connection the next request's headers are awaited."""
        self._waiting = True
        self._arm()

    # --- internals -------------------------------------------------------------------------------

    def _arm(self) -> None:
        self._disarm()
        if self._counted and self._guard.header_timeout > 0:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._guard.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._waiting and self._transport is not None and not self._transport.is_closing():
            self._guard.timed_out.inc()
            peer = self._transport.get_extra_info("peername")
            self._guard._note("HTTP connection closed: request headers not received in time", peer=str(peer))
            self._transport.close()
