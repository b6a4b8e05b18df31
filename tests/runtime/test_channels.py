"""A channel to a service outside the mesh (etcd) ignores the process's [tls]: its own TLS or plaintext."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from xavier_core.runtime import channels
from xavier_core.runtime.tls import make_dev_certificates


@pytest.fixture
async def plaintext_server() -> AsyncIterator[str]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def _status(channel: grpc.aio.Channel) -> int:
    async with channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(resp.status)


async def test_outside_the_mesh_ignores_the_process_tls(plaintext_server: str, tmp_path: Path) -> None:
    certs = make_dev_certificates(tmp_path / "certs")
    channels.use_client_tls(certs.settings())
    try:
        # A mesh channel dials mTLS, which a plaintext server refuses...
        with pytest.raises(grpc.aio.AioRpcError):
            await _status(channels.open_channel(plaintext_server))
        # ...while a plaintext etcd next to a [tls] directory is reached as configured.
        serving = await _status(channels.open_channel(plaintext_server, mesh=False))
        assert serving == health_pb2.HealthCheckResponse.SERVING
    finally:
        channels.use_client_tls(None)
