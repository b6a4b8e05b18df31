"""One way to start any Xavier service: ``serve()`` (a process) or ``start_service()`` (in-process).

Start order: gRPC server with the runtime interceptor and size limits → health
(everything NOT_SERVING) and reflection → bind ``listen`` → ``/metrics`` →
``on_start`` → health SERVING → ready file → ``READY=1`` (+ watchdog).
Stop order (SIGTERM/SIGINT or :meth:`ServerHandle.shutdown`): health
NOT_SERVING → ``STOPPING=1`` → ``on_stop`` (drain) → ``server.stop(grace)`` →
metrics down → ready file removed. The whole stop fits in ``grace_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import sdnotify
from .channels import client_tls, reload_client_tls, use_client_tls
from .config import ConfigError, ServiceConfig, exit_on_config_error, parse_host_port
from .interceptors import RuntimeInterceptor
from .logging import configure_logging, get_logger
from .metrics import MetricsServer, start_metrics_server
from .session import end_sessions, limit_messages
from .tls import ServerTls

__all__ = ["ServerHandle", "run_service", "serve", "start_service"]

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_log = get_logger("xavier.server")

Register = Callable[[grpc.aio.Server], Sequence[str]]
OnStart = Callable[["ServerHandle"], Awaitable[Mapping[str, Any] | None]]
OnStop = Callable[["ServerHandle"], Awaitable[None]]


def _connect_host(host: str) -> str:
    # A wildcard bind is reachable on loopback; the ready file is for local supervisors.
    return {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "": "127.0.0.1"}.get(host, host)


def _write_ready_file(path: Path, payload: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(payload), sort_keys=True) + "\n")
    os.replace(tmp, path)  # readers never see a partial file


class ServerHandle:
    """A started service: its addresses, health, and a programmatic stop."""

    def __init__(
        self,
        config: ServiceConfig,
        service_name: str,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        service_names: Sequence[str],
        port: int,
        on_stop: OnStop | None,
    ) -> None:
        self.config = config
        self.service_name = service_name
        self.server = server
        self.health = health_servicer
        self.service_names = tuple(service_names)
        self.port = port
        host, _ = parse_host_port(config.listen)
        self.address = f"{_connect_host(host)}:{port}"
        self.metrics: MetricsServer | None = None
        self.ready_info: dict[str, Any] = {}
        self._on_stop = on_stop
        self._stop_requested = asyncio.Event()
        self._shutdown_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.tls: ServerTls | None = None
        """Set when ``[tls]`` built the credentials; ``tls.request_reload()`` is what SIGHUP calls."""

    @property
    def metrics_address(self) -> str | None:
        return self.metrics.address if self.metrics is not None else None

    def request_stop(self) -> None:
        """Ask :func:`serve` to stop (what SIGTERM does); returns at once."""
        self._stop_requested.set()

    async def wait_for_stop_request(self) -> None:
        await self._stop_requested.wait()

    async def set_serving(self, serving: bool) -> None:
        """Set overall ("") and every registered service's health status."""
        status = _SERVING if serving else _NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain and stop: NOT_SERVING, STOPPING=1, on_stop, stop(grace).

        Idempotent: a second caller waits for the first shutdown to finish.
        """
        if self._shutdown_task is None:
            self._stop_requested.set()
            self._shutdown_task = asyncio.create_task(self._shutdown(grace))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, grace: float | None) -> None:
        grace_s = self.config.grace_seconds if grace is None else grace
        deadline = asyncio.get_running_loop().time() + grace_s
        await self.health.enter_graceful_shutdown()
        sdnotify.notify("STOPPING=1")
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._on_stop is not None:
            try:
                await asyncio.wait_for(self._on_stop(self), timeout=grace_s)
            except TimeoutError:
                _log.warning("on_stop drain exceeded grace", grace_seconds=grace_s)
            except Exception:
                _log.exception("on_stop failed")
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        # The server takes no new RPC from here, while the calls in flight have the rest of the grace.
        # Call sessions are long-lived streams: ended once their calls finish, so an idle one does not
        # hold the stop for its whole grace, and none opens after they were told to end (one that did
        # would run calls and hold the stop for the rest of the grace).
        stopped = asyncio.ensure_future(self.server.stop(remaining))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(end_sessions(), timeout=remaining)
        await stopped
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)
        if self.config.ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.config.ready_file.unlink()
        _log.info("stopped", service_name=self.service_name)


async def start_service(
    config: ServiceConfig,
    *,
    service_name: str,
    register: Register,
    on_start: OnStart | None = None,
    on_stop: OnStop | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    reuse_port: bool = False,
) -> ServerHandle:
    """Start a service in the running loop and return once it is SERVING.

    ``register(server)`` adds the servicers and returns their full service
    names (``"xavier.v1.DirectoryService"``) for health and reflection.
    ``on_start(handle)`` runs after bind and before SERVING (e.g. register
    with the directory using ``handle.address``); a mapping it returns is
    merged into the ready file. No signal handlers are installed here.
    Without ``credentials``, a ``[tls]`` config section makes the port mTLS-only. The port is bound
    without SO_REUSEPORT (no other process may share it) unless ``reuse_port``: processes of one service
    that share their address on purpose (the router's workers).
    """
    tls = ServerTls(config.tls) if credentials is None and config.tls is not None else None
    # The same [tls] section makes this process dial every other service over mTLS.
    use_client_tls(config.tls)
    if tls is not None:
        credentials = tls.credentials()
    limit = config.max_message_bytes
    limit_messages(limit)  # a call session's answer past it fails that call alone
    server = grpc.aio.server(
        interceptors=(RuntimeInterceptor(), *interceptors),
        options=(
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", int(reuse_port)),
        ),
    )
    names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    for name in ("", *names):
        await health_servicer.set(name, _NOT_SERVING)
    try:
        port = (
            server.add_secure_port(config.listen, credentials)
            if credentials is not None
            else server.add_insecure_port(config.listen)
        )
    except RuntimeError as exc:
        raise OSError(f"cannot bind {config.listen}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind {config.listen}")
    await server.start()
    handle = ServerHandle(config, service_name, server, health_servicer, names, port, on_stop)
    handle.tls = tls
    try:
        if config.metrics_listen:
            handle.metrics = await asyncio.to_thread(start_metrics_server, config.metrics_listen)
        if on_start is not None:
            handle.ready_info.update(await on_start(handle) or {})
        await handle.set_serving(True)
    except BaseException:
        await server.stop(None)
        if handle.metrics is not None:
            handle.metrics.close()
        raise
    if config.ready_file is not None:
        payload = {
            **handle.ready_info,
            "address": handle.address,
            "metrics": handle.metrics_address,
            "pid": os.getpid(),
            "service": service_name,
        }
        _write_ready_file(config.ready_file, payload)
    sdnotify.notify(f"READY=1\nSTATUS=serving on {handle.address}")
    interval = sdnotify.watchdog_interval(config.watchdog_seconds)
    if interval is not None:
        handle._watchdog = asyncio.create_task(sdnotify.watchdog_loop(interval))
    _log.info("serving", service_name=service_name, address=handle.address, metrics=handle.metrics_address)
    return handle


def _reload_tls(handle: ServerHandle) -> None:
    """SIGHUP: the ``[tls]`` files are re-read for the server's next handshakes and the next calls of the
    channels this process opened."""
    if handle.tls is None and client_tls() is None:
        _log.info("SIGHUP ignored: no [tls] files to reload")
        return
    if handle.tls is not None:
        handle.tls.request_reload()
    reload_client_tls()


async def serve(
    config: ServiceConfig,
    *,
    service_name: str,
    register: Register,
    on_start: OnStart | None = None,
    on_stop: OnStop | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    handle_signals: bool = True,
    configure_logs: bool = True,
    started: Callable[[ServerHandle], None] | None = None,
    reuse_port: bool = False,
) -> int:
    """Run a service until SIGTERM/SIGINT (or ``handle.request_stop()``); return the exit code 0.

    SIGHUP re-reads the ``[tls]`` certificate files for the next connections, served and dialled (a
    no-op without TLS).

    ``started(handle)`` is called once SERVING (in-process callers keep the
    handle to stop it). Signal handlers are installed only when
    ``handle_signals`` and removed before returning. ``reuse_port``: see :func:`start_service`.
    """
    if configure_logs:
        configure_logging(service_name, config.log_level, config.log_format)
    loop = asyncio.get_running_loop()
    stop_signal = asyncio.Event()
    installed: list[signal.Signals] = []
    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_signal.set)
            installed.append(sig)
    try:
        handle = await start_service(
            config,
            service_name=service_name,
            register=register,
            on_start=on_start,
            on_stop=on_stop,
            interceptors=interceptors,
            credentials=credentials,
            reuse_port=reuse_port,
        )
        if started is not None:
            started(handle)
        if handle_signals:
            # SIGHUP (systemctl reload) must never kill a service, with or without TLS to reload.
            loop.add_signal_handler(signal.SIGHUP, _reload_tls, handle)
            installed.append(signal.SIGHUP)
        signal_wait = asyncio.create_task(stop_signal.wait())
        request_wait = asyncio.create_task(handle.wait_for_stop_request())
        try:
            await asyncio.wait((signal_wait, request_wait), return_when=asyncio.FIRST_COMPLETED)
        finally:
            signal_wait.cancel()
            request_wait.cancel()
        _log.info("stopping", service_name=service_name, grace_seconds=config.grace_seconds)
        await handle.shutdown()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
    return 0


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """asyncio.run on uvloop when it is installed and XAVIER_UVLOOP is not 0 (the default loop otherwise)."""
    if os.environ.get("XAVIER_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main())
    return asyncio.run(main())


def run_service(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``main()`` (usually a coroutine calling :func:`serve`) and return its exit code.

    A :class:`ConfigError` escaping ``main`` exits 2 with ``config error: ...``.
    """
    try:
        return _run(main)
    except ConfigError as err:
        exit_on_config_error(err)
    except KeyboardInterrupt:
        return 130
