"""Client certificates follow SIGHUP: a decode service whose [tls] files are rotated to a new CA keeps
reaching the directory over the channel it already holds.

A directory and a decode run as processes with certificates from one CA (identities in their SANs). Both
sets of files are then replaced by certificates from a new CA and both processes get SIGHUP: the old CA is
refused by both, and the new one served. The directory is then killed and started again on the same port:
the decode's channel must reconnect, and it can only do so with the new client certificate (the new
directory trusts nothing else), so the decode registering again is the proof.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc

from tests.support.procs import ServiceProc, start_service
from xavier_core.engine.tiny import make_tiny
from xavier_core.runtime.identity import Identity
from xavier_core.runtime.tls import DevCa

pytestmark = pytest.mark.integration

# A fresh TCP connection per check: a shared subchannel would reuse a handshake made before a reload.
_FRESH = (("grpc.use_local_subchannel_pool", 1),)
# Leases long enough that only the rotation (not a slow shared machine) could cost the registration.
_ENV = {
    "XAVIER_DIRECTORY__PEER_LEASE_SECONDS": "10",
    "XAVIER_DIRECTORY__HEARTBEAT_INTERVAL_SECONDS": "0.5",
    "XAVIER_ENGINE__NUM_PAGES": "64",
}
_IDENTITIES = {
    "directory": Identity("directory", "directory"),
    "decode": Identity("decode", "decode-0"),
    "client": Identity("client", "client"),
}


def _issue(ca_dir: Path, root: Path) -> None:
    """A new CA, and for each of `_IDENTITIES` its cert.pem, key.pem and ca.pem under root/<name>/
    (written over the files already there, as a rotation does)."""
    ca = DevCa(ca_dir)
    for name, identity in _IDENTITIES.items():
        files = ca.issue(name, identity)
        target = root / name
        target.mkdir(parents=True, exist_ok=True)
        for source, dest in (
            (files.cert_file, "cert.pem"),
            (files.key_file, "key.pem"),
            (ca.ca_file, "ca.pem"),
        ):
            (target / dest).write_bytes(source.read_bytes())


def _tls_env(files: Path) -> dict[str, str]:
    return {
        "XAVIER_TLS__CERT_FILE": str(files / "cert.pem"),
        "XAVIER_TLS__KEY_FILE": str(files / "key.pem"),
        "XAVIER_TLS__CA_FILE": str(files / "ca.pem"),
    }


def _credentials(files: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        (files / "ca.pem").read_bytes(), (files / "key.pem").read_bytes(), (files / "cert.pem").read_bytes()
    )


def _peers(address: str, credentials: grpc.ChannelCredentials) -> set[str]:
    """The directory's peer ids, asked over a new connection."""
    with grpc.secure_channel(address, credentials, options=_FRESH) as channel:
        resp = dpb_grpc.DirectoryServiceStub(channel).ListPeers(dpb.ListPeersRequest(), timeout=5)
        return {p.peer_id for p in resp.peers}


def _health(address: str, credentials: grpc.ChannelCredentials) -> int:
    with grpc.secure_channel(address, credentials, options=_FRESH) as channel:
        return int(
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        )


def _refused(address: str, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        _health(address, credentials)
    code: grpc.StatusCode = info.value.code()
    return code


def _eventually(check: Callable[[], bool], what: str, *procs: ServiceProc) -> None:
    """Waits for `check` (a hang guard of 60 s, not a measurement); the services' logs if it never holds."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if check():
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.log()[-4000:]}" for p in procs)
            raise AssertionError(f"{what} did not happen\n{logs}")
        time.sleep(0.1)


@pytest.fixture
def procs() -> Iterator[dict[str, ServiceProc]]:
    running: dict[str, ServiceProc] = {}
    yield running
    for proc in running.values():
        proc.stop()


def test_a_rotated_client_certificate_reaches_the_directory_after_sighup(
    tmp_path: Path, procs: dict[str, ServiceProc]
) -> None:
    files = tmp_path / "tls"
    _issue(tmp_path / "ca-old", files)
    old_client = _credentials(files / "client")
    model = make_tiny(tmp_path / "tiny-qwen2", "qwen2")
    work = tmp_path / "work"
    procs["directory"] = start_service(
        "xavier-directory",
        ["--listen", "127.0.0.1:0"],
        work,
        name="directory",
        env={**_ENV, **_tls_env(files / "directory")},
    )
    directory = procs["directory"].address
    procs["decode"] = start_service(
        "xavier-decode",
        [
            *("--model", str(model), "--directory", directory, "--listen", "127.0.0.1:0", "--device", "cpu"),
            *("--role", "decode", "--peer-id", "decode-0"),
        ],
        work,
        name="decode",
        env={**_ENV, **_tls_env(files / "decode")},
        timeout=120,
    )
    _eventually(
        lambda: "decode-0" in _peers(directory, old_client), "the decode's registration", *procs.values()
    )

    # Rotate every file to a new CA, then SIGHUP both services.
    _issue(tmp_path / "ca-new", files)
    new_client = _credentials(files / "client")
    for proc in procs.values():
        proc.proc.send_signal(signal.SIGHUP)
    decode = procs["decode"].address
    serving = health_pb2.HealthCheckResponse.SERVING
    for address in (directory, decode):
        _eventually(
            lambda a=address: _health(a, new_client) == serving, f"{address} on the new CA", *procs.values()
        )
        assert _refused(address, old_client) == grpc.StatusCode.UNAVAILABLE

    # A directory restarted on the same port knows only the new CA: the decode's open channel must
    # reconnect with its new client certificate to register again.
    procs.pop("directory").kill()
    procs["directory"] = start_service(
        "xavier-directory",
        ["--listen", directory],
        work,
        name="directory-2",
        env={**_ENV, **_tls_env(files / "directory")},
    )
    assert procs["directory"].address == directory
    assert _peers(directory, new_client) <= {"decode-0"}
    _eventually(
        lambda: "decode-0" in _peers(directory, new_client),
        "the decode's registration with its new certificate",
        *procs.values(),
    )
    assert _refused(directory, old_client) == grpc.StatusCode.UNAVAILABLE
    assert "client tls certificates reloaded" in procs["decode"].log()
    assert all(p.proc.poll() is None for p in procs.values())
