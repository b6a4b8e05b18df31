"""`xavier up --tls`: the whole P/D mesh over mTLS serves requests; plaintext and foreign-CA callers are
refused by every service (directory, prefill, decode, router)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xavier_client import Client, TlsOptions

from tests.cli.mesh import Mesh, shared_cache, start_up
from xavier_core.runtime.tls import make_dev_certificates


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    up = start_up(tmp_path_factory.mktemp("tls"), shared_cache(tmp_path_factory), "--tls")
    yield up
    up.stop()


def _addresses(up: Mesh) -> dict[str, str]:
    return {
        ready.stem: json.loads(ready.read_text())["address"] for ready in sorted(up.workdir.glob("*.ready"))
    }


def _tls(up: Mesh) -> dict[str, str]:
    info = json.loads((up.workdir.parent / "up.json").read_text())
    tls: dict[str, str] = info["tls"]
    return tls


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def test_pd_mesh_serves_over_mtls(tls_mesh: Mesh) -> None:
    tls = _tls(tls_mesh)
    opts = TlsOptions(
        root_certificates=Path(tls["ca_file"]),
        private_key=Path(tls["key_file"]),
        certificate_chain=Path(tls["cert_file"]),
    )
    with Client(tls_mesh.grpc, tls=opts) as client:
        for mode in ("pd", "pd"):
            out = client.generate("Hello over mTLS", max_tokens=6, temperature=0.0, mode=mode)
            assert out.completion_tokens == 6 and out.mode == "pd"
    names = set(_addresses(tls_mesh))
    assert {"directory", "prefill-0", "decode-0", "router"} <= names


def test_plaintext_and_foreign_ca_callers_are_refused(tls_mesh: Mesh, tmp_path: Path) -> None:
    tls = _tls(tls_mesh)
    ours = (Path(tls["ca_file"]).read_bytes(), Path(tls["key_file"]).read_bytes())
    foreign = make_dev_certificates(tmp_path / "other")
    good = grpc.ssl_channel_credentials(ours[0], ours[1], Path(tls["cert_file"]).read_bytes())
    # Trusts our CA (so the server is accepted) but presents a certificate our CA never signed.
    stranger = grpc.ssl_channel_credentials(
        ours[0], foreign.key_file.read_bytes(), foreign.cert_file.read_bytes()
    )
    for name, address in _addresses(tls_mesh).items():
        with grpc.secure_channel(address, good) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING, name
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as plain:
            _health(channel)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE, name
        with grpc.secure_channel(address, stranger) as channel, pytest.raises(grpc.RpcError) as bad:
            _health(channel)
        assert bad.value.code() == grpc.StatusCode.UNAVAILABLE, name
