"""In-process test services on 127.0.0.1:0 built from generic (bytes in, bytes out) handlers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import pytest

from xavier_core.runtime import ServerHandle, ServiceConfig, start_service

SERVICE = "xavier.test.v1.TestService"


def generic_register(
    handlers: Mapping[str, grpc.RpcMethodHandler],
) -> Callable[[grpc.aio.Server], list[str]]:
    def register(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, dict(handlers)),))
        return [SERVICE]

    return register


@pytest.fixture
async def serve_handlers() -> AsyncIterator[Callable[..., Any]]:
    """Start a runtime server with the given method handlers; stopped after the test."""
    started: list[ServerHandle] = []

    async def start(handlers: Mapping[str, grpc.RpcMethodHandler], **config: Any) -> ServerHandle:
        handle = await start_service(
            ServiceConfig(**config), service_name="test", register=generic_register(handlers)
        )
        started.append(handle)
        return handle

    yield start
    for handle in started:
        await handle.shutdown(grace=0.5)
