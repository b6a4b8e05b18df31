"""The one way Xavier's services open ``grpc.aio`` channels to each other.

Every internal channel gets the same options: a fast reconnect (backoff capped at one second, so a
restarted directory sees its peers again within about one heartbeat interval and the router reaches a
restarted peer at once) and a message size limit in both directions.
"""

from __future__ import annotations

import grpc

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "channel_options", "open_channel"]

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
"""Largest message sent or received on an internal channel (a peer's stats, a long prompt's tokens)."""


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[tuple[str, int], ...]:
    """The options of every internal channel."""
    if max_message_bytes <= 0:
        raise ValueError(f"max_message_bytes must be positive, got {max_message_bytes}")
    return (
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    )


def open_channel(target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """An insecure ``grpc.aio`` channel to ``target`` (host:port) with the internal options."""
    return grpc.aio.insecure_channel(target, options=channel_options(max_message_bytes))
