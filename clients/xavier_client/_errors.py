"""Typed errors of the client: a status code plus the server's `google.rpc.ErrorInfo`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

_DETAILS_KEY = "grpc-status-details-bin"


class XavierError(Exception):
    """A failed call: the gRPC status code, the ErrorInfo reason and metadata, and the message.

    `reason` is the server's UPPER_SNAKE reason (e.g. `PROMPT_TOO_LONG`) or the code name when the
    status carried no ErrorInfo (e.g. `DEADLINE_EXCEEDED` raised by the channel itself).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        reason: str | None = None,
        domain: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.reason = reason or self.code.name
        self.domain = domain
        self.metadata: dict[str, str] = dict(metadata or {})

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason}: {self.message}"


class InvalidArgumentError(XavierError):
    """The request is malformed or out of range (empty prompt, prompt too long, unknown model, ...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(XavierError):
    """The named entity does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(XavierError):
    """Server state forbids the call (e.g. no peer can serve the requested mode)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(XavierError):
    """Out of capacity; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(XavierError):
    """Transiently unavailable; idempotent calls are retried on this error."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(XavierError):
    """The call's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(XavierError):
    """The call was cancelled (by this client)."""

    code = grpc.StatusCode.CANCELLED


class AbortedError(XavierError):
    """The request was aborted (an Abort call or a server fault)."""

    code = grpc.StatusCode.ABORTED


class UnauthenticatedError(XavierError):
    """The bearer token is missing or wrong."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(XavierError):
    """The caller's certificate names no identity allowed to make the call (reason PERMISSION_DENIED)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class InternalError(XavierError):
    """A server bug or unexpected failure."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[XavierError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        CancelledError,
        AbortedError,
        UnauthenticatedError,
        PermissionDeniedError,
        InternalError,
    )
}


def _details_blob(trailing: Sequence[Any] | None) -> bytes | None:
    for item in trailing or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == _DETAILS_KEY and isinstance(value, bytes):
            return value
    return None


def _code_of(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def error_from_rpc(err: grpc.RpcError) -> XavierError:
    """Builds the typed error of a received `grpc.RpcError` (sync or aio), reading its ErrorInfo."""
    code_fn = getattr(err, "code", None)
    code: grpc.StatusCode = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    message = str((details_fn() if callable(details_fn) else None) or "")
    trailing_fn = getattr(err, "trailing_metadata", None)
    blob = _details_blob(trailing_fn() if callable(trailing_fn) else None)
    reason: str | None = None
    domain = ""
    metadata: dict[str, str] = {}
    if blob is not None:
        status = status_pb2.Status.FromString(blob)
        code = _code_of(status.code)
        message = status.message or message
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason, domain, metadata = info.reason or None, info.domain, dict(info.metadata)
                break
    cls = _BY_CODE.get(code, XavierError)
    return cls(message, code=code, reason=reason, domain=domain, metadata=metadata)
