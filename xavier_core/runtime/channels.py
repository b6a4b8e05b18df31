"""The one way Xavier's services open ``grpc.aio`` channels to each other.

Every internal channel gets the same options: a fast reconnect (backoff capped at one second, so a
restarted directory sees its peers again within about one heartbeat interval and the router reaches a
restarted peer at once) and a message size limit in both directions.

A service configured with ``[tls]`` dials every other service over mTLS: the server starts by calling
:func:`use_client_tls` with its settings, and from then on :func:`open_channel` presents the service's
certificate and trusts only ``ca_file`` — a plaintext channel is never opened by such a process, since
its peers (configured alike) refuse plaintext anyway and a silent downgrade would only hide a mistake.
Such a mesh channel is a :class:`~xavier_core.runtime.client_tls.ReloadingChannel`: after
:func:`reload_client_tls` (what SIGHUP calls, beside the server side's reload) its next call re-reads the
files and dials again, so channels already open follow a rotation as well as new ones do.
"""

from __future__ import annotations

import ipaddress
import weakref

import grpc

from .client_tls import ClientTls, ReloadingChannel
from .config import TlsSettings

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "channel_options",
    "client_tls",
    "open_channel",
    "reload_client_tls",
    "use_client_tls",
]

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
"""Largest message sent or received on an internal channel (a peer's stats, a long prompt's tokens)."""

_client_tls: ClientTls | None = None
_named_tls: weakref.WeakSet[ClientTls] = weakref.WeakSet()
"""The credentials of channels opened with their own ``tls`` (etcd's): they follow a reload too."""


def use_client_tls(settings: TlsSettings | None) -> None:
    """Makes ``settings`` the TLS of every channel this process opens from now on (None: plaintext)."""
    global _client_tls
    _client_tls = ClientTls(settings) if settings is not None else None


def client_tls() -> TlsSettings | None:
    """The TLS settings channels are opened with (None: plaintext)."""
    return _client_tls.settings if _client_tls is not None else None


def reload_client_tls() -> None:
    """The process's mesh channels re-read their certificate files before their next call (SIGHUP)."""
    if _client_tls is not None:
        _client_tls.request_reload()
    for named in list(_named_tls):
        named.request_reload()


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, server_name: str = ""
) -> tuple[tuple[str, int | str], ...]:
    """The options of every internal channel (``server_name``: the name the server's cert must carry)."""
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
    options: tuple[tuple[str, int | str], ...] = (
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    )
    if server_name:
        options += (("grpc.ssl_target_name_override", server_name),)
    return options


def open_channel(
    target: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: TlsSettings | None = None,
    mesh: bool = True,
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target`` (host:port, or several ip:port joined by commas).

    mTLS with ``tls`` when given, else with the process's settings (:func:`use_client_tls`), else
    plaintext. ``mesh=False`` dials a service outside the mesh (etcd), which the process's settings
    do not fit: ``tls`` or plaintext. A TLS channel, on the process's settings or its own ``tls``,
    follows :func:`reload_client_tls`. A bad certificate file raises
    :class:`~xavier_core.runtime.config.ConfigError`.
    """
    target, extra = _targets(target)
    if tls is not None or not mesh or _client_tls is None:
        if tls is None:
            return grpc.aio.insecure_channel(target, options=channel_options(max_message_bytes) + extra)
        options = channel_options(max_message_bytes, tls.server_name) + extra
        named = ClientTls(tls)
        channel = ReloadingChannel(
            named, lambda credentials: grpc.aio.secure_channel(target, credentials, options=options)
        )
        _named_tls.add(named)  # held by the channel: gone with it
        return channel
    # The process's own certificate: a channel that follows its reloads.
    options = channel_options(max_message_bytes, _client_tls.settings.server_name) + extra
    return ReloadingChannel(
        _client_tls, lambda credentials: grpc.aio.secure_channel(target, credentials, options=options)
    )


def _targets(target: str) -> tuple[str, tuple[tuple[str, int | str], ...]]:
    """``host:port`` as is; ``ip:port,ip:port,...`` (replicas of one service, e.g. two directories on
    etcd) as one channel spreading calls round-robin, so a dead replica's calls move to the others."""
    if "," not in target:
        return target, ()
    parts = [p.strip() for p in target.split(",")]
    hosts = [p.rpartition(":")[0] for p in parts]
    try:
        kinds = {ipaddress.ip_address(h.strip("[]")).version for h in hosts}
    except ValueError:
        raise ValueError(
            f"several addresses must be IP literals (one address may be a name): {target!r}"
        ) from None
    if len(kinds) != 1:
        raise ValueError(f"several addresses must all be IPv4 or all IPv6: {target!r}")
    scheme = "ipv4" if kinds == {4} else "ipv6"
    return f"{scheme}:{','.join(parts)}", (("grpc.lb_policy_name", "round_robin"),)
