"""Who is calling: the Xavier identity in a caller's mTLS certificate, and the checks servicers make.

A service certificate names one identity as a URI subject alternative name, ``spiffe://xavier/<role>/<peer
id>`` (``xavier up`` issues one per service from its CA, see ``tls.DevCa``): the role is one of
:data:`ROLES`, the peer id the one the service registers under (``router``, ``directory``, ``client`` for
the ones that register nothing). A server started with ``[tls]`` demands a client certificate from its
CA on every connection; its servicers :func:`require` the identity each call needs:

- the directory: a peer's registration, heartbeats and unregistration only from that peer, room changes
  only from the room's own peers (a router may abort any room), a peer's room watch only from that peer;
- prefill and decode services: ``Prefill``, ``Decode``, ``GenerateUnified`` only from a router.

Reads (listing peers, stats) need any certificate of the CA. A certificate without a Xavier identity
gets ``PERMISSION_DENIED`` wherever an identity is required. On a plaintext connection (a server
without ``[tls]``, whose port takes nothing else) nothing is known about a caller and every check
passes: an insecure mesh (``xavier up --insecure`` warns about it).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from xavier.v1 import types_pb2

from .errors import PermissionDenied

__all__ = [
    "PEER_ROLES",
    "ROLES",
    "ROLE_NAMES",
    "Identity",
    "caller",
    "identity_of_pem",
    "require",
]

_SCHEME = "spiffe://xavier/"
PEER_ROLES = frozenset({"prefill", "decode", "unified"})
ROLES = frozenset({"directory", "router", "pagestore", "client", *PEER_ROLES})
ROLE_NAMES: dict[int, str] = {
    types_pb2.ROLE_PREFILL: "prefill",
    types_pb2.ROLE_DECODE: "decode",
    types_pb2.ROLE_UNIFIED: "unified",
    types_pb2.ROLE_PAGE_STORE: "pagestore",
}
"""The name of each directory role: the identity role its peers' certificates name, and the word in
default peer ids and metrics."""


@dataclass(frozen=True)
class Identity:
    """One service's identity: its role and the peer id it registers under."""

    role: str
    peer_id: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (one of {sorted(ROLES)})")
        if not self.peer_id or "/" in self.peer_id or len(self.peer_id) > 128:
            raise ValueError(f"peer id {self.peer_id!r} must be 1..128 characters without '/'")

    @property
    def uri(self) -> str:
        """The certificate's URI subject alternative name for this identity."""
        return f"{_SCHEME}{self.role}/{self.peer_id}"

    @classmethod
    def from_uri(cls, uri: str) -> Identity | None:
        """The identity a URI names, or None for a URI that is not a Xavier identity."""
        if not uri.startswith(_SCHEME):
            return None
        role, sep, peer_id = uri[len(_SCHEME) :].partition("/")
        try:
            return cls(role, peer_id) if sep else None
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.role}/{self.peer_id}"


@functools.lru_cache(maxsize=1024)
def identity_of_pem(pem: bytes) -> Identity | None:
    """The Xavier identity a PEM certificate names (its first URI SAN that is one), or None."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    for uri in sans.get_values_for_type(x509.UniformResourceIdentifier):
        found = Identity.from_uri(uri)
        if found is not None:
            return found
    return None


def _auth(ctx: Any) -> dict[str, list[bytes]]:
    try:
        return dict(ctx.auth_context())
    except (AttributeError, RuntimeError, TypeError):
        return {}


def _over_tls(auth: dict[str, list[bytes]]) -> bool:
    return b"ssl" in (auth.get("transport_security_type") or ())


def _identity(auth: dict[str, list[bytes]]) -> Identity | None:
    pems = auth.get("x509_pem_cert") or ()
    return identity_of_pem(bytes(pems[0])) if pems else None


def caller(ctx: Any) -> Identity | None:
    """The identity in the certificate the caller presented on this call's connection, if any."""
    return _identity(_auth(ctx))


def require(
    ctx: Any,
    method: str,
    *,
    roles: Collection[str] = (),
    peer_id: str | None = None,
    peer_role: str | None = None,
) -> Identity | None:
    """The caller's identity when it may make this call: its role is one of `roles`, or it is the peer
    `peer_id` (with role `peer_role` when given). Raises `PermissionDenied` otherwise; returns None
    without checking on a plaintext connection."""
    auth = _auth(ctx)
    if not _over_tls(auth):
        return None
    who = _identity(auth)
    if who is not None:
        if who.role in roles:
            return who
        if peer_id is not None and who.peer_id == peer_id and peer_role in (None, who.role):
            return who
    needs = [f"role {'|'.join(sorted(roles))}"] if roles else []
    if peer_id is not None:
        needs.append(f"peer {peer_role or '*'}/{peer_id}")
    need = " or ".join(needs) or "a Xavier identity"
    raise PermissionDenied(
        f"{method}: the caller ({who or 'a certificate with no Xavier identity'}) is not {need}",
        method=method,
        caller=str(who or ""),
        needs=need,
    )
