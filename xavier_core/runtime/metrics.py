"""Prometheus metrics: the process registry, per-RPC metrics and the ``/metrics`` HTTP server."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, make_wsgi_app

from .config import parse_host_port

__all__ = ["MetricsServer", "RpcMetrics", "get_registry", "rpc_metrics", "start_metrics_server"]

# RPCs span sub-millisecond directory calls to minute-long token streams.
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def get_registry() -> CollectorRegistry:
    """The process-wide registry (prometheus_client's default, with process collectors).

    Services register their own metrics here so one ``/metrics`` serves them all.
    """
    return REGISTRY


@dataclass
class RpcMetrics:
    """``xavier_rpc_total{service,method,code}`` and ``xavier_rpc_seconds{service,method}``."""

    total: Counter
    seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RpcMetrics:
        total = Counter(
            "xavier_rpc",
            "RPCs handled, by final status code.",
            ("service", "method", "code"),
            registry=registry,
        )
        seconds = Histogram(
            "xavier_rpc_seconds",
            "RPC handling time (whole stream for streaming RPCs).",
            ("service", "method"),
            buckets=_RPC_BUCKETS,
            registry=registry,
        )
        return cls(total, seconds)


_BY_REGISTRY: dict[int, RpcMetrics] = {}
_BY_REGISTRY_LOCK = threading.Lock()


def rpc_metrics(registry: CollectorRegistry | None = None) -> RpcMetrics:
    """The RPC metrics of ``registry`` (created once; several servers in one process share them)."""
    reg = registry if registry is not None else get_registry()
    with _BY_REGISTRY_LOCK:
        found = _BY_REGISTRY.get(id(reg))
        if found is None:
            found = RpcMetrics.create(reg)
            _BY_REGISTRY[id(reg)] = found
        return found


@dataclass
class MetricsServer:
    """A running ``/metrics`` HTTP server (a daemon thread, off the event loop)."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def serve(self, registry: CollectorRegistry) -> None:
        """Serves `registry` from now on."""
        self._server.set_app(make_wsgi_app(registry))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


def start_metrics_server(listen: str, registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve ``registry`` on ``listen`` (``HOST:PORT``; port 0 binds a free port).

    A small wsgiref server rather than prometheus_client's start_http_server, to
    poll for shutdown every 50 ms (not 0.5 s) so stopping a service stays fast.
    """
    host, port = parse_host_port(listen)
    bind_host = host[1:-1] if host.startswith("[") else host
    server_cls: type[_Server] = _Server
    if ":" in bind_host:
        server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
    app = make_wsgi_app(registry or get_registry())
    server = make_server(bind_host, port, app, server_class=server_cls, handler_class=_QuietHandler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="xavier-metrics", daemon=True
    )
    thread.start()
    return MetricsServer(host, int(server.server_port), server, thread)


def code_label(code: grpc.StatusCode | None) -> str:
    """Label value for a status code (``OK`` when the handler set none)."""
    return "OK" if code is None else code.name
