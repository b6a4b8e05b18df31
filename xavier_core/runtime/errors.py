"""Typed domain errors and their mapping to ``google.rpc.Status``.

Every failure that crosses a service boundary travels as a gRPC status whose
details hold exactly one ``google.rpc.ErrorInfo`` (domain ``xavier.v1``, an
UPPER_SNAKE ``reason`` and string metadata). Servicers raise the subclasses
below; the server interceptor turns them into statuses, and callers turn the
received ``grpc.RpcError`` back into the same typed error with
:func:`from_rpc_error`.

Every reason is declared in ``protos/xavier/v1/error_reason.proto`` (the
``ErrorReason`` enum, value names without the ``ERROR_REASON_`` prefix). A raise
with an undeclared reason, or an error class whose default is undeclared, fails
with ``ValueError`` at once (one set lookup), so a typo never reaches the wire;
a reason *received* from a peer is data and is kept as it came. Code that branches
on a reason names it by the generated enum (``err.is_reason(ERROR_REASON_NO_PEERS)``,
``wire_reasons(...)``), never by a string literal, so a misspelt name fails mypy
and the import instead of never matching.
tests/contract/test_error_reasons.py checks the other direction (every declared
reason is emitted somewhere).

``LeaseExpired`` maps to FAILED_PRECONDITION rather than DEADLINE_EXCEEDED:
the lease is server-side state that has ended (retrying the same call cannot
succeed), while DEADLINE_EXCEEDED is reserved for the caller's own deadline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from xavier.v1 import error_reason_pb2

ERROR_DOMAIN = "xavier.v1"
_DETAILS_KEY = "grpc-status-details-bin"
_REASON_PREFIX = "ERROR_REASON_"
Reason: TypeAlias = error_reason_pb2.ErrorReason.ValueType
"""A declared reason as the generated enum names it (`error_reason_pb2.ERROR_REASON_PEER_FAILED`)."""
_WIRE_NAMES: dict[int, str] = {
    value: name.removeprefix(_REASON_PREFIX)
    for name, value in error_reason_pb2.ErrorReason.items()
    if value != error_reason_pb2.ERROR_REASON_UNSPECIFIED
}
DECLARED_REASONS: frozenset[str] = frozenset(_WIRE_NAMES.values())

__all__ = [
    "DECLARED_REASONS",
    "ERROR_DOMAIN",
    "Aborted",
    "CapacityExhausted",
    "FailedPrecondition",
    "GenericError",
    "Internal",
    "InvalidArgument",
    "LayoutMismatch",
    "LeaseExpired",
    "NotFound",
    "PermissionDenied",
    "Reason",
    "Unavailable",
    "Unimplemented",
    "XavierError",
    "abort_with",
    "error_for_code",
    "from_rpc_error",
    "to_rpc_status",
    "wire_reason",
    "wire_reasons",
]


class XavierError(Exception):
    """Base of all domain errors.

    ``code`` and ``reason`` are class defaults; a raise may override ``reason``
    (e.g. ``NotFound("room 7", reason="ROOM_NOT_FOUND", room_id="7")``). Extra
    keyword arguments become the ``ErrorInfo.metadata`` (values stringified).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    reason: str = "UNKNOWN"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _require_declared(cls.reason)

    def __init__(self, message: str = "", *, reason: str | None = None, **metadata: object) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = _require_declared(reason)
        self.metadata: dict[str, str] = {k: str(v) for k, v in metadata.items()}

    def is_reason(self, *reasons: Reason) -> bool:
        """Whether this error carries one of `reasons` (a received reason this build does not declare
        matches none)."""
        return any(self.reason == wire_reason(r) for r in reasons)

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}" if self.message else self.reason

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, reason={self.reason!r}, metadata={self.metadata!r})"


def wire_reason(reason: Reason) -> str:
    """The name `reason` travels under in an ErrorInfo: its enum value's name without the prefix."""
    try:
        return _WIRE_NAMES[reason]
    except KeyError:
        raise ValueError(f"ErrorReason {reason} is not a reason that travels") from None


def wire_reasons(*reasons: Reason) -> frozenset[str]:
    """The wire names of `reasons`, for a set a received `err.reason` is looked up in."""
    return frozenset(wire_reason(r) for r in reasons)


def _require_declared(reason: str) -> str:
    if reason not in DECLARED_REASONS:
        raise ValueError(f"reason {reason!r} is not declared in protos/xavier/v1/error_reason.proto")
    return reason


class GenericError(XavierError):
    """A received status with no typed class (e.g. DEADLINE_EXCEEDED): keeps the wire code and reason.

    The reason is the received one (or the code's name), not checked against the declared reasons: a
    peer built from a newer contract may send one this build does not know.
    """

    def __init__(
        self, code: grpc.StatusCode, message: str = "", *, reason: str | None = None, **metadata: object
    ) -> None:
        super().__init__(message)
        self.reason = reason or code.name
        self.code = code
        self.metadata = {k: str(v) for k, v in metadata.items()}


class InvalidArgument(XavierError):
    """The request is malformed or out of range; retrying it unchanged fails again."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class PermissionDenied(XavierError):
    """The caller's mTLS identity may not make this call (see ``xavier_core.runtime.identity``)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class NotFound(XavierError):
    """A named entity does not exist (``ROOM_NOT_FOUND``, ``PEER_NOT_FOUND``, ...)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class FailedPrecondition(XavierError):
    """State forbids the call (``STALE_EPOCH``, ``WRONG_ROLE``, ``WRONG_STATE``, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class LayoutMismatch(FailedPrecondition):
    """Two peers' KV layouts differ; metadata names each differing field."""

    reason = "LAYOUT_MISMATCH"


class LeaseExpired(FailedPrecondition):
    """The room or peer lease ended before the call (see module docstring for the code)."""

    reason = "LEASE_EXPIRED"


class CapacityExhausted(XavierError):
    """Out of pages, slots or rooms; the caller may retry later or elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "CAPACITY_EXHAUSTED"


class Unavailable(XavierError):
    """Transiently unable to serve (``SHUTTING_DOWN``, ``PEER_UNAVAILABLE``); safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


class Aborted(XavierError):
    """The request was aborted (client cancel, abort RPC)."""

    code = grpc.StatusCode.ABORTED
    reason = "REQUEST_ABORTED"


class Unimplemented(XavierError):
    """The RPC exists in the contract but this part is not built yet."""

    code = grpc.StatusCode.UNIMPLEMENTED
    reason = "NOT_IMPLEMENTED"


class Internal(XavierError):
    """A bug or an unexpected failure; the message never carries a traceback."""

    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"


# Reconstruction picks the most specific class for (code, reason), then the
# class for the code alone, then a generic error keeping the code.
_BY_REASON: dict[tuple[grpc.StatusCode, str], type[XavierError]] = {
    (grpc.StatusCode.FAILED_PRECONDITION, "LAYOUT_MISMATCH"): LayoutMismatch,
    (grpc.StatusCode.FAILED_PRECONDITION, "LEASE_EXPIRED"): LeaseExpired,
}
_BY_CODE: dict[grpc.StatusCode, type[XavierError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        PermissionDenied,
        NotFound,
        FailedPrecondition,
        CapacityExhausted,
        Unavailable,
        Aborted,
        Unimplemented,
        Internal,
    )
}


def error_for_code(
    code: grpc.StatusCode,
    message: str = "",
    *,
    reason: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> XavierError:
    """Build the typed error for a status code and reason (generic when none fits).

    ``metadata`` is a mapping rather than keywords so wire keys such as
    ``message`` or ``reason`` cannot collide with the constructor's parameters.
    """
    cls = _BY_REASON.get((code, reason or "")) or _BY_CODE.get(code)
    if cls is None:
        err: XavierError = GenericError(code, message, reason=reason)
    else:
        err = cls(message)
        if reason:  # received data: kept even when this build does not declare it
            err.reason = reason
    if metadata:
        err.metadata = dict(metadata)
    return err


class _Status(NamedTuple):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...]


class _RichStatus(_Status, grpc.Status):  # type: ignore[misc,unused-ignore]
    """A ``grpc.Status`` with extra trailing metadata beside the details blob."""


def status_proto(err: XavierError) -> status_pb2.Status:
    """``err`` as the ``google.rpc.Status`` a failed RPC carries: its code, message and one ``ErrorInfo``."""
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=ERROR_DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=err.code.value[0], message=err.message, details=[detail])


def to_rpc_status(err: XavierError, trailing_metadata: Sequence[tuple[str, str | bytes]] = ()) -> grpc.Status:
    """Encode ``err`` as a ``grpc.Status`` carrying one ``ErrorInfo`` in its details.

    ``trailing_metadata`` is sent alongside (the interceptor adds ``x-request-id``).
    """
    base = rpc_status.to_status(status_proto(err))
    if not trailing_metadata:
        return base
    return _RichStatus(base.code, base.details, (*base.trailing_metadata, *trailing_metadata))


def _code_from_int(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def _details_blob(metadata: Sequence[Any] | None) -> bytes | None:
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == _DETAILS_KEY and isinstance(value, bytes):
            return value
    return None


def from_rpc_error(err: grpc.RpcError) -> XavierError:
    """Rebuild the typed error from a received ``grpc.RpcError`` / ``grpc.aio.AioRpcError``.

    Reads ``grpc-status-details-bin`` from the trailing metadata; without an
    ``ErrorInfo`` the result carries only the status code (reason = code name).
    """
    code_fn = getattr(err, "code", None)
    code: grpc.StatusCode = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    message: str = (details_fn() if callable(details_fn) else None) or ""
    trailing_fn = getattr(err, "trailing_metadata", None)
    trailing = trailing_fn() if callable(trailing_fn) else None
    blob = _details_blob(trailing)
    if blob is None:
        return error_for_code(code, message)
    status = status_pb2.Status.FromString(blob)
    code = _code_from_int(status.code)
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return error_for_code(code, status.message, reason=info.reason or None, metadata=info.metadata)
    return error_for_code(code, status.message)


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], err: XavierError) -> None:
    """Abort an aio call with ``err`` encoded as a rich status (never returns)."""
    await context.abort_with_status(to_rpc_status(err))
