"""mTLS on a real service: a valid client is served, plaintext and unknown CAs refused; SIGHUP reloads."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.procs import ServiceProc, start_service
from xavier_core.runtime.config import ConfigError, TlsSettings
from xavier_core.runtime.tls import ServerTls, channel_credentials, read_tls_files

# A fresh TCP connection per check: a shared subchannel would reuse a handshake made before a reload.
_FRESH = (("grpc.use_local_subchannel_pool", 1),)


def _write(ca: trustme.CA, directory: Path, *names: str) -> TlsSettings:
    """Issue a certificate for ``names`` from ``ca`` and write cert, key and CA as PEM files."""
    directory.mkdir(parents=True, exist_ok=True)
    cert = ca.issue_cert(*names)
    cert.private_key_pem.write_to_path(str(directory / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "cert.pem"))
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    return TlsSettings(
        cert_file=directory / "cert.pem", key_file=directory / "key.pem", ca_file=directory / "ca.pem"
    )


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    if credentials is None:
        channel = grpc.insecure_channel(address, options=_FRESH)
    else:
        channel = grpc.secure_channel(address, credentials, options=_FRESH)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def _refused(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        _health(address, credentials)
    return info.value.code()


def _served_cert(address: str, client: TlsSettings) -> bytes:
    """The DER certificate the server presents to a new TLS connection (client certificate included)."""
    host, port = address.rsplit(":", 1)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=str(client.ca_file))
    context.load_cert_chain(str(client.cert_file), str(client.key_file))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    if der is None:
        raise AssertionError("no server certificate")
    return der


def _pem_der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


@pytest.fixture
def tls_dirs(tmp_path: Path) -> tuple[trustme.CA, TlsSettings, TlsSettings]:
    ca = trustme.CA()
    server = _write(ca, tmp_path / "server", "127.0.0.1", "localhost")
    client = _write(ca, tmp_path / "client", "router.xavier.test")
    return ca, server, client


@pytest.fixture
def tls_directory(
    tmp_path: Path, tls_dirs: tuple[trustme.CA, TlsSettings, TlsSettings]
) -> Iterator[ServiceProc]:
    _, server, _ = tls_dirs
    env = {
        "XAVIER_TLS__CERT_FILE": str(server.cert_file),
        "XAVIER_TLS__KEY_FILE": str(server.key_file),
        "XAVIER_TLS__CA_FILE": str(server.ca_file),
    }
    proc = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path / "work", env=env)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.integration
def test_tls_service_serves_valid_client_and_refuses_others(
    tmp_path: Path, tls_directory: ServiceProc, tls_dirs: tuple[trustme.CA, TlsSettings, TlsSettings]
) -> None:
    _, _, client = tls_dirs
    address = tls_directory.address
    assert _health(address, channel_credentials(client)) == health_pb2.HealthCheckResponse.SERVING
    assert _refused(address, None) == grpc.StatusCode.UNAVAILABLE
    # Trusts the right server CA but presents a certificate from a CA the server does not know.
    stranger = _write(trustme.CA(), tmp_path / "stranger", "router.xavier.test")
    forged = grpc.ssl_channel_credentials(
        root_certificates=client.ca_file.read_bytes(),
        private_key=stranger.key_file.read_bytes(),
        certificate_chain=stranger.cert_file.read_bytes(),
    )
    assert _refused(address, forged) == grpc.StatusCode.UNAVAILABLE
    # No client certificate at all.
    anonymous = grpc.ssl_channel_credentials(root_certificates=client.ca_file.read_bytes())
    assert _refused(address, anonymous) == grpc.StatusCode.UNAVAILABLE
    assert tls_directory.proc.poll() is None


@pytest.mark.integration
def test_sighup_rotates_to_new_files_for_new_connections(
    tmp_path: Path, tls_directory: ServiceProc, tls_dirs: tuple[trustme.CA, TlsSettings, TlsSettings]
) -> None:
    _, server, client = tls_dirs
    address = tls_directory.address
    old_cert = _pem_der(server.cert_file)
    assert _served_cert(address, client) == old_cert
    # Rotate to a new CA: new server certificate and key, new trusted client CA, written over the old paths.
    new_ca = trustme.CA()
    staged = _write(new_ca, tmp_path / "staged", "127.0.0.1", "localhost")
    new_client = _write(new_ca, tmp_path / "client2", "router.xavier.test")
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (server.cert_file.parent / name).write_bytes((staged.cert_file.parent / name).read_bytes())
    # Replaced files alone change nothing: the reload waits for the signal.
    assert _served_cert(address, client) == old_cert
    tls_directory.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            served = _served_cert(address, new_client)
            break
        except (ssl.SSLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert served == _pem_der(staged.cert_file) != old_cert
    assert _health(address, channel_credentials(new_client)) == health_pb2.HealthCheckResponse.SERVING
    assert _refused(address, channel_credentials(client)) == grpc.StatusCode.UNAVAILABLE
    assert tls_directory.proc.poll() is None, tls_directory.log()


def test_reload_hook_keeps_old_files_when_new_ones_are_broken(
    tls_dirs: tuple[trustme.CA, TlsSettings, TlsSettings],
) -> None:
    _, server, _ = tls_dirs
    tls = ServerTls(server)
    assert tls.fetch() is None  # no reload asked: gRPC keeps the current configuration
    tls.request_reload()
    assert tls.fetch() is not None and tls.reloads == 1
    server.key_file.write_text("not a key\n")
    tls.request_reload()
    assert tls.fetch() is None and tls.reloads == 1
    assert tls.fetch() is None  # the failed request is consumed, not retried on every handshake


def test_bad_files_name_the_key(
    tmp_path: Path, tls_dirs: tuple[trustme.CA, TlsSettings, TlsSettings]
) -> None:
    _, server, client = tls_dirs
    cases = {
        "tls.key_file": server.model_copy(update={"key_file": tmp_path / "missing.pem"}),
        "tls.ca_file": server.model_copy(update={"ca_file": server.key_file}),
        "tls.cert_file": server.model_copy(update={"key_file": client.key_file}),  # key of another cert
    }
    for key, settings in cases.items():
        with pytest.raises(ConfigError) as info:
            read_tls_files(settings)
        assert [issue[0] for issue in info.value.issues] == [key]


@pytest.mark.integration
def test_binary_with_unreadable_tls_file_exits_2_naming_the_key(tmp_path: Path) -> None:
    exe = str(Path(sys.executable).parent / "xavier-directory")
    env = {
        "XAVIER_TLS__CERT_FILE": str(tmp_path / "cert.pem"),
        "XAVIER_TLS__KEY_FILE": str(tmp_path / "key.pem"),
        "XAVIER_TLS__CA_FILE": str(tmp_path / "ca.pem"),
    }
    result = subprocess.run(
        [exe, "--listen", "127.0.0.1:0", "--metrics-listen", ""],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "config error: tls.cert_file: cannot read" in result.stderr
