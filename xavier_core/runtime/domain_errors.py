"""The one mapping from core errors that know no gRPC (engine, sampling) to statuses.

The engine and the sampling limits raise plain exceptions; the server interceptor sends them through
`as_xavier_error`, so a servicer lets them propagate and the client receives the code and ErrorInfo reason
below. Fronts that answer without the interceptor (the HTTP front) call it themselves.
"""

from __future__ import annotations

from collections.abc import Callable

from xavier_core.engine.api import (
    EngineBusyError,
    EngineError,
    InvalidRequestError,
    OutOfPagesError,
    RequestNotFoundError,
    ResumedOutputError,
)
from xavier_core.engine.errors import CheckpointError, EngineClosedError, RequestAbortedError
from xavier_core.sampling import SamplingError

from .errors import (
    Aborted,
    CapacityExhausted,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
    XavierError,
)

__all__ = ["as_xavier_error", "engine_status", "sampling_status"]

# The first class the error is an instance of decides; any other engine error is INTERNAL / ENGINE_ERROR.
_ENGINE: tuple[tuple[type[EngineError], Callable[[str], XavierError]], ...] = (
    (ResumedOutputError, lambda m: InvalidArgument(m, reason="RESUMED_OUTPUT_OUTSIDE_GRAMMAR")),
    (InvalidRequestError, lambda m: InvalidArgument(m, reason="INVALID_REQUEST")),
    (OutOfPagesError, lambda m: CapacityExhausted(m, reason="OUT_OF_PAGES")),
    (EngineBusyError, lambda m: CapacityExhausted(m, reason="ENGINE_QUEUE_FULL")),
    (RequestNotFoundError, lambda m: NotFound(m, reason="REQUEST_NOT_FOUND")),
    (RequestAbortedError, lambda m: Aborted(m, reason="REQUEST_ABORTED")),
    (EngineClosedError, lambda m: Unavailable(m, reason="SHUTTING_DOWN")),
    (CheckpointError, lambda m: Internal(m, reason="CHECKPOINT_ERROR")),
)


def engine_status(err: EngineError) -> XavierError:
    """The status an engine error reaches a client with."""
    for cls, status in _ENGINE:
        if isinstance(err, cls):
            return status(str(err))
    return Internal(str(err), reason="ENGINE_ERROR")


def sampling_status(err: SamplingError) -> InvalidArgument:
    """INVALID_ARGUMENT with the error's reason; metadata `field` names the sampling field."""
    return InvalidArgument(str(err), reason=err.reason, field=err.field)


def as_xavier_error(exc: BaseException) -> XavierError | None:
    """The status of a core error (itself for a `XavierError`), or None for anything else (a bug)."""
    if isinstance(exc, XavierError):
        return exc
    if isinstance(exc, EngineError):
        return engine_status(exc)
    if isinstance(exc, SamplingError):
        return sampling_status(exc)
    return None
