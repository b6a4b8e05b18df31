"""The one channel factory: mTLS from the process's [tls] (with a server name override), replicas of a
service behind one comma-separated address, and `xavier deploy render` from the CLI."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from xavier_core.runtime import channels
from xavier_core.runtime.tls import ServerTls, make_dev_certificates


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    # A certificate for a name only: dialling 127.0.0.1 needs the server name override.
    certs = make_dev_certificates(tmp_path / "srv", names=("directory.xavier.internal",))
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", ServerTls(certs.settings()).credentials())
    await server.start()
    yield f"127.0.0.1:{port}", tmp_path / "srv"
    await server.stop(None)


async def _check(channel: grpc.aio.Channel) -> int:
    async with channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(resp.status)


async def test_process_tls_and_server_name(tls_server: tuple[str, Path]) -> None:
    address, files = tls_server
    # The client presents the same certificate (one per host serves both directions).
    settings = channels.TlsSettings(
        cert_file=files / "cert.pem", key_file=files / "key.pem", ca_file=files / "ca.pem"
    )
    assert channels.client_tls() is None
    channels.use_client_tls(settings.model_copy(update={"server_name": "directory.xavier.internal"}))
    try:
        assert await _check(channels.open_channel(address)) == health_pb2.HealthCheckResponse.SERVING
        # Without the override the server's certificate does not name 127.0.0.1: refused.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _check(channels.open_channel(address, tls=settings))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channels.use_client_tls(None)
    with pytest.raises(grpc.aio.AioRpcError):  # plaintext to a TLS-only server
        await _check(channels.open_channel(address))


async def _tls_health_server(files: Path, port: int = 0) -> tuple[grpc.aio.Server, int]:
    settings = channels.TlsSettings(
        cert_file=files / "cert.pem", key_file=files / "key.pem", ca_file=files / "ca.pem"
    )
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    bound = server.add_secure_port(f"127.0.0.1:{port}", ServerTls(settings).credentials())
    await server.start()
    return server, bound


@pytest.mark.parametrize("own", [False, True], ids=["mesh", "own-tls"])
async def test_an_open_channel_follows_a_client_tls_reload(tmp_path: Path, own: bool) -> None:
    """One stub over one channel: refused by a server of a new CA until the reload, served after it; a
    reload that finds a broken key keeps the certificate it had. The same for a channel opened with its
    own `tls` outside the mesh (the directory's etcd channel)."""
    client = tmp_path / "client"
    client.mkdir()

    def install(source: Path) -> None:
        for name in ("cert.pem", "key.pem", "ca.pem"):
            (client / name).write_bytes((source / name).read_bytes())

    make_dev_certificates(tmp_path / "old")
    install(tmp_path / "old")
    server, port = await _tls_health_server(tmp_path / "old")
    settings = channels.TlsSettings(
        cert_file=client / "cert.pem", key_file=client / "key.pem", ca_file=client / "ca.pem"
    )
    if own:
        channel = channels.open_channel(f"127.0.0.1:{port}", tls=settings, mesh=False)
    else:
        channels.use_client_tls(settings)
        channel = channels.open_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == serving
        # The server restarts on a new CA; the client's files are rotated but not yet reloaded.
        await server.stop(None)
        make_dev_certificates(tmp_path / "new")
        server, _ = await _tls_health_server(tmp_path / "new", port)
        install(tmp_path / "new")
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        channels.reload_client_tls()
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == serving
        (client / "key.pem").write_text("not a key\n")
        channels.reload_client_tls()
        assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == serving
    finally:
        channels.use_client_tls(None)
        await channel.close()
        await server.stop(None)


def test_several_addresses_make_one_round_robin_channel() -> None:
    assert channels._targets("10.0.0.1:7100") == ("10.0.0.1:7100", ())
    target, options = channels._targets("10.0.0.1:7100,10.0.0.2:7100")
    assert target == "ipv4:10.0.0.1:7100,10.0.0.2:7100"
    assert options == (("grpc.lb_policy_name", "round_robin"),)
    assert channels._targets("[::1]:1,[::2]:2")[0] == "ipv6:[::1]:1,[::2]:2"
    with pytest.raises(ValueError, match="IP literals"):
        channels._targets("dir-a:7100,dir-b:7100")
    with pytest.raises(ValueError, match="all be IPv4 or all IPv6"):
        channels._targets("10.0.0.1:1,[::1]:2")


def test_xavier_deploy_render(tmp_path: Path) -> None:
    from xavier_cli.main import main

    root = Path(__file__).resolve().parents[2]
    hosts = root / "deploy" / "examples" / "hosts.toml"
    assert main(["deploy", "render", "--hosts", str(hosts), "--host", "ctl", "--out", str(tmp_path)]) == 0
    units = {p.name for p in (tmp_path / "etc" / "systemd" / "system").iterdir()}
    assert {"xavier-directory.service", "xavier-router.service"} <= units
    with pytest.raises(SystemExit) as bad:
        main(["deploy", "render", "--hosts", str(hosts), "--host", "nope", "--out", str(tmp_path / "x")])
    assert bad.value.code == 2
