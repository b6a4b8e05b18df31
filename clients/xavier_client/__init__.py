"""Python SDK of the Xavier router: `Client` (blocking) and `AsyncClient` (asyncio).

Both stream answers (`generate_stream`), return whole answers (`generate`), abort by request id, list
models and report cluster status. Failures raise `XavierError` subclasses carrying the server's
`ErrorInfo` reason and metadata.
"""

from xavier_client._aio import AsyncClient, AsyncGenerateStream
from xavier_client._errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    XavierError,
    error_from_rpc,
)
from xavier_client._options import RetryPolicy, TlsOptions
from xavier_client._sync import Client, GenerateStream
from xavier_client._types import (
    Chunk,
    ClusterPeer,
    ClusterRooms,
    ClusterStatus,
    Completion,
    Mode,
    Prompt,
    Sampling,
    build_request,
    mode_name,
)

# RouterService RPC -> the client methods that call it (checked against the descriptor in the tests).
RPC_METHODS: dict[str, tuple[str, ...]] = {
    "Generate": ("generate", "generate_stream"),
    "Abort": ("abort",),
    "ListModels": ("list_models",),
    "GetClusterStatus": ("cluster_status",),
}

__all__ = [
    "RPC_METHODS",
    "AbortedError",
    "AsyncClient",
    "AsyncGenerateStream",
    "CancelledError",
    "Chunk",
    "Client",
    "ClusterPeer",
    "ClusterRooms",
    "ClusterStatus",
    "Completion",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "GenerateStream",
    "InternalError",
    "InvalidArgumentError",
    "Mode",
    "NotFoundError",
    "PermissionDeniedError",
    "Prompt",
    "ResourceExhaustedError",
    "RetryPolicy",
    "Sampling",
    "TlsOptions",
    "UnauthenticatedError",
    "UnavailableError",
    "XavierError",
    "build_request",
    "error_from_rpc",
    "mode_name",
]
