"""`xavier up` (mTLS by default, one certificate per service naming its identity): the P/D mesh serves
over mTLS and the CLI reaches it through the state file; plaintext and foreign-CA callers are refused by
every service; and a caller holding a genuine certificate of another identity cannot act as someone
else: register, unregister or watch another peer, abort rooms as the router, or call a prefill or a
decode directly (each refused PERMISSION_DENIED naming the caller), and the mesh keeps serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xavier.v1 import decode_service_pb2 as decpb
from xavier.v1 import decode_service_pb2_grpc as decpb_grpc
from xavier.v1 import directory_service_pb2 as dpb
from xavier.v1 import directory_service_pb2_grpc as dpb_grpc
from xavier.v1 import prefill_service_pb2 as ppb
from xavier.v1 import prefill_service_pb2_grpc as ppb_grpc
from xavier.v1 import types_pb2
from xavier_client import Client, TlsOptions
from xavier_client._errors import error_from_rpc

from tests.cli.mesh import Mesh, shared_cache, start_up
from xavier_core.runtime.tls import make_dev_certificates

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    up = start_up(tmp_path_factory.mktemp("tls"), shared_cache(tmp_path_factory), insecure=False)
    yield up
    up.stop()


def _addresses(up: Mesh) -> dict[str, str]:
    return {
        ready.stem: json.loads(ready.read_text())["address"] for ready in sorted(up.workdir.glob("*.ready"))
    }


def _client_tls(up: Mesh) -> dict[str, str]:
    info = json.loads((up.workdir.parent / "up.json").read_text())
    tls: dict[str, str] = info["client_tls"]
    return tls


def _credentials(up: Mesh, name: str) -> grpc.ChannelCredentials:
    """The credentials of the service (or client) `name` of this mesh: a genuine certificate of its CA."""
    tls = up.workdir / "tls"
    return grpc.ssl_channel_credentials(
        (tls / "ca.pem").read_bytes(),
        (tls / f"{name}-key.pem").read_bytes(),
        (tls / f"{name}-cert.pem").read_bytes(),
    )


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def _strangers(
    up: Mesh,
) -> Iterator[tuple[str, tuple[ppb_grpc.PrefillServiceStub, decpb_grpc.DecodeServiceStub]]]:
    """Stubs of prefill-0 and decode-0 for callers holding genuine certificates of other roles (the
    CLI's and a decode's), each with the identity the refusal names."""
    addr = _addresses(up)
    for who, caller in (("client", "client/cli"), ("decode-0", "decode/decode-0")):
        creds = _credentials(up, who)
        with (
            grpc.secure_channel(addr["prefill-0"], creds) as pch,
            grpc.secure_channel(addr["decode-0"], creds) as dch,
        ):
            yield caller, (ppb_grpc.PrefillServiceStub(pch), decpb_grpc.DecodeServiceStub(dch))


def _denied(call: Callable[[], Any], caller: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = error_from_rpc(info.value)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, err
    assert err.reason == "PERMISSION_DENIED" and err.metadata["caller"] == caller, err


def test_pd_mesh_serves_over_mtls_and_the_cli_finds_its_certificate(tls_mesh: Mesh) -> None:
    tls = _client_tls(tls_mesh)
    opts = TlsOptions(
        root_certificates=Path(tls["ca_file"]),
        private_key=Path(tls["key_file"]),
        certificate_chain=Path(tls["cert_file"]),
    )
    with Client(tls_mesh.grpc, tls=opts) as client:
        out = client.generate("Hello over mTLS", max_tokens=6, temperature=0.0, mode="pd")
        assert out.completion_tokens == 6 and out.mode == "pd"
    assert {"directory", "prefill-0", "decode-0", "router"} <= set(_addresses(tls_mesh))
    env = {**os.environ, "XAVIER_CACHE_DIR": str(tls_mesh.workdir.parents[1] / "xavier-cache")}

    def status(*flags: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "xavier_cli", "status", "--address", tls_mesh.grpc, *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)

    found = status("--json")  # the CLI's certificate, from xavier up's state file
    assert found.returncode == 0, found.stderr
    report = json.loads(found.stdout)
    assert {p["peer_id"] for p in report["peers"]} >= {"prefill-0", "decode-0"}
    assert "active" in report["rooms"]  # zero-valued fields are printed too
    assert status("--insecure").returncode != 0


def test_plaintext_and_foreign_ca_callers_are_refused(tls_mesh: Mesh, tmp_path: Path) -> None:
    tls = _client_tls(tls_mesh)
    ca = Path(tls["ca_file"]).read_bytes()
    foreign = make_dev_certificates(tmp_path / "other")
    good = _credentials(tls_mesh, "client")
    # Trusts our CA (so the server is accepted) but presents a certificate our CA never signed.
    stranger = grpc.ssl_channel_credentials(ca, foreign.key_file.read_bytes(), foreign.cert_file.read_bytes())
    for name, address in _addresses(tls_mesh).items():
        with grpc.secure_channel(address, good) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING, name
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as plain:
            _health(channel)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE, name
        with grpc.secure_channel(address, stranger) as channel, pytest.raises(grpc.RpcError) as bad:
            _health(channel)
        assert bad.value.code() == grpc.StatusCode.UNAVAILABLE, name


def test_a_genuine_certificate_cannot_act_as_another_identity(tls_mesh: Mesh) -> None:
    addr = _addresses(tls_mesh)
    with grpc.secure_channel(addr["directory"], _credentials(tls_mesh, "decode-0")) as channel:
        directory = dpb_grpc.DirectoryServiceStub(channel)
        peers = {p.peer_id: p for p in directory.ListPeers(dpb.ListPeersRequest(), timeout=5).peers}  # a read
        prefill = peers["prefill-0"]
        fake = dpb.RegisterPeerRequest(peer_id="decode-1", role=types_pb2.ROLE_DECODE, address="127.0.0.1:1")
        _denied(lambda: directory.RegisterPeer(fake, timeout=5), "decode/decode-0")
        steal = dpb.RegisterPeerRequest(
            peer_id="prefill-0", role=types_pb2.ROLE_PREFILL, address="127.0.0.1:1"
        )
        _denied(lambda: directory.RegisterPeer(steal, timeout=5), "decode/decode-0")
        # Its own id, but another role: a decode's certificate does not make a prefill.
        other_role = dpb.RegisterPeerRequest(
            peer_id="decode-0", role=types_pb2.ROLE_PREFILL, address="127.0.0.1:1"
        )
        _denied(lambda: directory.RegisterPeer(other_role, timeout=5), "decode/decode-0")
        evict = dpb.UnregisterPeerRequest(peer_id="prefill-0", epoch=prefill.epoch)
        _denied(lambda: directory.UnregisterPeer(evict, timeout=5), "decode/decode-0")
        beat = dpb.HeartbeatRequest(peer_id="prefill-0", epoch=prefill.epoch)
        _denied(lambda: directory.Heartbeat(beat, timeout=5), "decode/decode-0")
        watch = dpb.WatchPeerRoomsRequest(peer_id="prefill-0", epoch=prefill.epoch)
        _denied(lambda: next(iter(directory.WatchPeerRooms(watch, timeout=5))), "decode/decode-0")
        as_router = dpb.AbortRoomRequest(room_id=12345, cause=dpb.ROOM_END_CAUSE_ROUTER_ABORT, detail="x")
        _denied(lambda: directory.AbortRoom(as_router, timeout=5), "decode/decode-0")
        after = {p.peer_id: p for p in directory.ListPeers(dpb.ListPeersRequest(), timeout=5).peers}
        assert after["prefill-0"].epoch == prefill.epoch and after["prefill-0"].address == prefill.address
        assert "decode-1" not in after
    prefill_req = ppb.PrefillRequest(room_id=7, decode_peer_id="decode-0")
    decode_req = decpb.DecodeRequest(room_id=7)
    for caller, (prefill_stub, decode_stub) in _strangers(tls_mesh):
        _denied(lambda: prefill_stub.Prefill(prefill_req, timeout=5), caller)  # noqa: B023 (called at once)
        _denied(lambda: next(iter(decode_stub.Decode(decode_req, timeout=5))), caller)  # noqa: B023
    tls = _client_tls(tls_mesh)
    opts = TlsOptions(Path(tls["ca_file"]), Path(tls["key_file"]), Path(tls["cert_file"]))
    with Client(tls_mesh.grpc, tls=opts) as client:  # the mesh kept serving
        assert client.generate("still here", max_tokens=4, temperature=0.0).completion_tokens == 4


def test_a_caller_without_the_router_role_gets_nothing_on_a_session(tls_mesh: Mesh) -> None:
    """The session RPCs check the caller once, as Prefill and Decode do: a genuine certificate of
    another role is refused PERMISSION_DENIED naming it, and none of its calls runs."""
    addr = _addresses(tls_mesh)
    with grpc.secure_channel(addr["prefill-0"], _credentials(tls_mesh, "client")) as reader:
        stats = ppb_grpc.PrefillServiceStub(reader).GetPrefillStats
        computed = stats(ppb.GetPrefillStatsRequest(), timeout=5).engine.prompt_tokens_computed
    prefill = ppb.PrefillRequest(
        room_id=7, decode_peer_id="decode-0", token_ids=[3, 4, 5], pair_handoff=True, request_id="x"
    )
    prefill_calls = ppb.PrefillSessionRequest(calls=[ppb.PrefillSessionCall(call_id=1, prefill=prefill)])
    decode_calls = decpb.DecodeSessionRequest(
        calls=[decpb.DecodeSessionCall(call_id=1, decode=decpb.DecodeRequest(room_id=7))]
    )
    for caller, (prefill_stub, decode_stub) in _strangers(tls_mesh):
        _denied(lambda: next(iter(prefill_stub.PrefillSession(iter([prefill_calls]), timeout=5))), caller)  # noqa: B023
        _denied(lambda: next(iter(decode_stub.DecodeSession(iter([decode_calls]), timeout=5))), caller)  # noqa: B023
    with grpc.secure_channel(addr["prefill-0"], _credentials(tls_mesh, "client")) as reader:
        stats = ppb_grpc.PrefillServiceStub(reader).GetPrefillStats
        after = stats(ppb.GetPrefillStatsRequest(), timeout=5)
    assert after.engine.prompt_tokens_computed == computed and after.rooms_active == 0
