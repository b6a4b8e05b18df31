"""Connection options shared by the sync and asyncio clients: TLS, bearer token, deadlines, retries."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import grpc

DEFAULT_PORT_HINT = "127.0.0.1:50051"


@dataclass(frozen=True)
class TlsOptions:
    """Server verification and optional client certificate (mTLS), as PEM bytes or file paths."""

    root_certificates: bytes | Path | None = None
    private_key: bytes | Path | None = None
    certificate_chain: bytes | Path | None = None
    server_name: str | None = None
    """Overrides the name checked against the server certificate (tests with a private CA)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of idempotent calls on UNAVAILABLE: bounded attempts, exponential backoff with jitter."""

    max_attempts: int = 4
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    multiplier: float = 2.0

    def backoff(self, attempt: int) -> float:
        """Seconds to sleep before retry number `attempt` (1-based)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return base * (0.5 + random.random() / 2)


def _pem(value: bytes | Path | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def channel_args(tls: TlsOptions | None, max_message_bytes: int) -> list[tuple[str, object]]:
    """gRPC channel options for the connection."""
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def channel_credentials(tls: TlsOptions | None, token: str | None) -> grpc.ChannelCredentials | None:
    """Credentials for a secure channel, or None for plaintext.

    A bearer token is only sent over TLS (gRPC refuses call credentials on insecure channels);
    plaintext with a token uses per-call metadata instead, see `call_metadata`.
    """
    if tls is None:
        return None
    creds = grpc.ssl_channel_credentials(
        root_certificates=_pem(tls.root_certificates),
        private_key=_pem(tls.private_key),
        certificate_chain=_pem(tls.certificate_chain),
    )
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


def call_metadata(tls: TlsOptions | None, token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata: the bearer token when the channel is plaintext (loopback deployments)."""
    if token and tls is None:
        return (("authorization", f"Bearer {token}"),)
    return ()
