"""Client channels that follow the ``[tls]`` files across a SIGHUP.

gRPC fixes a channel's credentials when the channel is made and reconnects with them for as long as it
lives, so a service whose certificate was rotated (new files, SIGHUP) would keep dialling with the old
one; once its peers trust only the new CA, its next reconnect would fail. Hence, in a TLS process:

- :class:`ClientTls` holds the process's client credentials and a generation. ``request_reload`` (what
  SIGHUP calls, beside the server side's reload) bumps the generation; the first channel call after it
  re-reads the files, once. Broken files keep the current credentials and are logged; the next SIGHUP
  tries again, as on the server side.
- A :class:`ReloadingChannel` (what ``channels.open_channel`` returns for a mesh channel) is a
  ``grpc.aio.Channel`` whose calls go to an inner channel dialled with the current credentials; a call
  that finds a newer generation dials a new inner channel first. Stubs bind to the ReloadingChannel, so
  every stub made over it follows. A call in flight keeps the inner channel it started on (a watch stream
  is not cut by a rotation); superseded inner channels are closed with the ReloadingChannel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc

from .config import ConfigError, TlsSettings
from .logging import get_logger
from .tls import channel_credentials

__all__ = ["ClientTls", "ReloadingChannel"]

_log = get_logger("xavier.tls")


class ClientTls:
    """The client credentials of one ``[tls]`` section, re-read after each :meth:`request_reload`."""

    def __init__(self, settings: TlsSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._asked = 0  # generations asked for by request_reload
        self._loaded = -1  # the generation `_credentials` was read for
        self._credentials: grpc.ChannelCredentials | None = None
        self.reloads = 0
        """Credentials re-read after the first (for logs and tests)."""

    def request_reload(self) -> None:
        """Re-read the files before the next call (safe from a signal handler or any thread)."""
        with self._lock:
            self._asked += 1

    def current(self) -> tuple[int, grpc.ChannelCredentials]:
        """The generation and the credentials of the files as last read. The first read raises
        :class:`ConfigError` for a bad file; a later one that fails keeps the credentials it had."""
        with self._lock:
            if self._loaded == self._asked and self._credentials is not None:
                return self._loaded, self._credentials
            asked = self._asked
            try:
                credentials = channel_credentials(self.settings)
            except ConfigError as err:
                if self._credentials is None:
                    raise
                _log.error("client tls reload failed; keeping the current certificate", error=str(err))
            else:
                if self._credentials is not None:
                    self.reloads += 1
                    _log.info("client tls certificates reloaded", cert_file=str(self.settings.cert_file))
                self._credentials = credentials
            self._loaded = asked  # a failed reload is not retried on every call
            return self._loaded, self._credentials


class _Method:
    """One RPC method of a :class:`ReloadingChannel`: each call goes to the current inner channel."""

    def __init__(self, channel: ReloadingChannel, kind: str, method: str, kwargs: dict[str, Any]) -> None:
        self._channel = channel
        self._kind = kind  # unary_unary, unary_stream, stream_unary or stream_stream
        self._method = method
        self._kwargs = kwargs
        self._bound: tuple[grpc.aio.Channel, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._channel.inner()
        if self._bound is None or self._bound[0] is not inner:
            self._bound = (inner, getattr(inner, self._kind)(self._method, **self._kwargs))
        return self._bound[1](*args, **kwargs)


class ReloadingChannel(grpc.aio.Channel):  # type: ignore[misc]  # grpc ships no type information
    """A ``grpc.aio.Channel`` to one target that re-dials with new credentials after a reload."""

    def __init__(self, tls: ClientTls, dial: Callable[[grpc.ChannelCredentials], grpc.aio.Channel]) -> None:
        self._tls = tls
        self._dial = dial
        generation, credentials = tls.current()
        self._generation = generation
        self._inner: grpc.aio.Channel = dial(credentials)
        self._superseded: list[grpc.aio.Channel] = []

    def inner(self) -> grpc.aio.Channel:
        """The channel new calls go to, dialled again if the credentials were reloaded since."""
        generation, credentials = self._tls.current()
        if generation != self._generation:
            self._generation = generation
            self._superseded.append(self._inner)
            self._inner = self._dial(credentials)
        return self._inner

    # --- grpc.aio.Channel ------------------------------------------------------------------------

    def unary_unary(self, method: str, **kwargs: Any) -> Any:
        return _Method(self, "unary_unary", method, kwargs)

    def unary_stream(self, method: str, **kwargs: Any) -> Any:
        return _Method(self, "unary_stream", method, kwargs)

    def stream_unary(self, method: str, **kwargs: Any) -> Any:
        return _Method(self, "stream_unary", method, kwargs)

    def stream_stream(self, method: str, **kwargs: Any) -> Any:
        return _Method(self, "stream_stream", method, kwargs)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.inner().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.inner().wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.inner().channel_ready()

    async def close(self, grace: float | None = None) -> None:
        for channel in (*self._superseded, self._inner):
            await channel.close(grace)
        self._superseded.clear()

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(None)
