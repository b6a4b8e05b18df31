"""Service runtime shared by every Xavier service.

``serve()`` starts a ``grpc.aio`` server with the runtime interceptor (request
id, metrics, domain-error mapping), health, reflection, ``/metrics``, a ready
file and sd_notify, and stops it gracefully on SIGTERM/SIGINT. Configuration
is TOML + ``XAVIER_*`` environment + flags, validated by pydantic models.
"""

from .config import (
    ConfigError,
    ServiceConfig,
    add_common_args,
    config_from_args,
    exit_on_config_error,
    load_config,
    parse_host_port,
)
from .errors import (
    ERROR_DOMAIN,
    Aborted,
    CapacityExhausted,
    FailedPrecondition,
    GenericError,
    Internal,
    InvalidArgument,
    LayoutMismatch,
    LeaseExpired,
    NotFound,
    Unavailable,
    Unimplemented,
    XavierError,
    abort_with,
    error_for_code,
    from_rpc_error,
    to_rpc_status,
    wire_reason,
    wire_reasons,
)
from .interceptors import REQUEST_ID_KEY, RuntimeInterceptor, current_request_id
from .logging import configure_logging, get_logger
from .metrics import MetricsServer, RpcMetrics, get_registry, rpc_metrics, start_metrics_server
from .sdnotify import notify, watchdog_interval, watchdog_loop
from .server import ServerHandle, run_service, serve, start_service

__all__ = [
    "ERROR_DOMAIN",
    "REQUEST_ID_KEY",
    "Aborted",
    "CapacityExhausted",
    "ConfigError",
    "FailedPrecondition",
    "GenericError",
    "Internal",
    "InvalidArgument",
    "LayoutMismatch",
    "LeaseExpired",
    "MetricsServer",
    "NotFound",
    "RpcMetrics",
    "RuntimeInterceptor",
    "ServerHandle",
    "ServiceConfig",
    "Unavailable",
    "Unimplemented",
    "XavierError",
    "abort_with",
    "add_common_args",
    "config_from_args",
    "configure_logging",
    "current_request_id",
    "error_for_code",
    "exit_on_config_error",
    "from_rpc_error",
    "get_logger",
    "get_registry",
    "load_config",
    "notify",
    "parse_host_port",
    "rpc_metrics",
    "run_service",
    "serve",
    "start_metrics_server",
    "start_service",
    "to_rpc_status",
    "watchdog_interval",
    "watchdog_loop",
    "wire_reason",
    "wire_reasons",
]
