"""The one way Xavier's services open ``grpc.aio`` channels to each other.

Every internal channel gets the same options: a fast reconnect (backoff capped at one second, so a
restarted directory sees its peers again within about one heartbeat interval and the router reaches a
restarted peer at once) and a message size limit in both directions.

A service configured with ``[tls]`` dials every other service over mTLS: the server starts by calling
:func:`use_client_tls` with its settings, and from then on :func:`open_channel` presents the service's
certificate and trusts only ``ca_file`` — a plaintext channel is never opened by such a process, since
its peers (configured alike) refuse plaintext anyway and a silent downgrade would only hide a mistake.
The certificate files are re-read for each new channel, so channels opened after a rotation (and the
SIGHUP that reloads the server side) use the new certificate.
"""

from __future__ import annotations

import ipaddress

import grpc

from .config import TlsSettings
from .tls import channel_credentials

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "channel_options",
    "client_tls",
    "open_channel",
    "use_client_tls",
]

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
"""Largest message sent or received on an internal channel (a peer's stats, a long prompt's tokens)."""

_client_tls: TlsSettings | None = None


def use_client_tls(settings: TlsSettings | None) -> None:
    """Makes ``settings`` the TLS of every channel this process opens from now on (None: plaintext)."""
    global _client_tls
    _client_tls = settings


def client_tls() -> TlsSettings | None:
    """The TLS settings channels are opened with (None: plaintext)."""
    return _client_tls


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
    do not fit: ``tls`` or plaintext. A bad certificate file raises
    :class:`~xavier_core.runtime.config.ConfigError`.
    """
    settings = tls if tls is not None or not mesh else _client_tls
    target, extra = _targets(target)
    if settings is None:
        return grpc.aio.insecure_channel(target, options=channel_options(max_message_bytes) + extra)
    return grpc.aio.secure_channel(
        target,
        channel_credentials(settings),
        options=channel_options(max_message_bytes, settings.server_name) + extra,
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
