"""Every service binary as a real process: health, reflection (buf curl and Python), SIGTERM, bad config."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.procs import ServiceProc, health_status, start_service
from xavier_core.engine.tiny import make_tiny
from xavier_core.runtime.errors import from_rpc_error

pytestmark = pytest.mark.integration

BUF = shutil.which("buf") or str(Path(sys.executable).parent / "buf")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServiceProc]:
    work = tmp_path_factory.mktemp("binaries")
    model = make_tiny(work / "model", "qwen2")
    procs: dict[str, ServiceProc] = {}
    try:
        procs["directory"] = start_service("xavier-directory", ["--listen", "127.0.0.1:0"], work)
        peer = ["--model", str(model), "--directory", procs["directory"].address, "--listen", "127.0.0.1:0"]
        procs["prefill"] = start_service("xavier-prefill", peer, work, name="prefill")
        procs["decode"] = start_service("xavier-decode", peer, work, name="decode")
        procs["pagestore"] = start_service("xavier-pagestore", ["--listen", "127.0.0.1:0"], work)
        procs["router"] = start_service(
            "xavier-router",
            ["--model", str(model), "--directory", procs["directory"].address, "--listen", "127.0.0.1:0"],
            work,
            name="router",
        )
        yield procs
    finally:
        for p in procs.values():
            p.stop()


EXPECTED = {
    "directory": "xavier.v1.DirectoryService",
    "prefill": "xavier.v1.PrefillService",
    "decode": "xavier.v1.DecodeService",
    "pagestore": "xavier.v1.PageStoreService",
    "router": "xavier.v1.RouterService",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_serving_and_listed_by_reflection(services: dict[str, ServiceProc], name: str) -> None:
    svc = services[name]
    assert health_status(svc.address) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(svc.address, EXPECTED[name]) == health_pb2.HealthCheckResponse.SERVING
    # A generic reflection client, as a grpcurl user would run it.
    out = subprocess.run(
        [
            BUF,
            "curl",
            "--protocol",
            "grpc",
            "--http2-prior-knowledge",
            "--list-services",
            f"http://{svc.address}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert EXPECTED[name] in out and "grpc.health.v1.Health" in out
    # The same through the reflection API from Python.
    with grpc.insecure_channel(svc.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = [s.name for r in responses for s in r.list_services_response.service]
    assert EXPECTED[name] in names


def test_pagestore_bad_request_is_invalid_argument_with_reason(services: dict[str, ServiceProc]) -> None:
    out = subprocess.run(
        [
            BUF,
            "curl",
            "--protocol",
            "grpc",
            "--http2-prior-knowledge",
            "-d",
            '{"namespace": {"contractFingerprint": "x"}}',
            f"http://{services['pagestore'].address}/xavier.v1.PageStoreService/ExistsPages",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0
    body = json.loads(out.stdout or out.stderr)
    assert body["code"] == "invalid_argument"
    assert body["details"][0]["type"] == "google.rpc.ErrorInfo"
    assert "keys" in body["message"]


def test_directory_error_carries_error_info(services: dict[str, ServiceProc]) -> None:
    from xavier.v1 import directory_service_pb2 as dpb
    from xavier.v1 import directory_service_pb2_grpc as dpb_grpc

    with grpc.insecure_channel(services["directory"].address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            dpb_grpc.DirectoryServiceStub(ch).GetRoom(dpb.GetRoomRequest(room_id=12345), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    err = from_rpc_error(info.value)
    assert err.reason == "ROOM_NOT_FOUND"


@pytest.mark.parametrize(
    ("args", "env", "key"),
    [
        (["--listen", "127.0.0.1:70000"], {}, "listen"),
        (["--listen", "127.0.0.1:0"], {"XAVIER_DIRECTORY__MAX_ROOMS": "many"}, "directory.max_rooms"),
        (["--listen", "127.0.0.1:0"], {"XAVIER_DIRECTORY__NO_SUCH_KEY": "1"}, "directory.no_such_key"),
    ],
)
def test_bad_config_exits_naming_the_key(
    tmp_path: Path, args: list[str], env: dict[str, str], key: str
) -> None:
    exe = str(Path(sys.executable).parent / "xavier-directory")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, env={**_env(), **env})
    assert proc.returncode != 0
    assert key in proc.stderr


def test_bad_config_file_for_an_engine_service(tmp_path: Path) -> None:
    cfg = tmp_path / "prefill.toml"
    cfg.write_text('[engine]\npage_size = "sixteen"\n')
    exe = str(Path(sys.executable).parent / "xavier-prefill")
    proc = subprocess.run([exe, "--config", str(cfg)], capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2
    assert "engine.page_size" in proc.stderr


def test_sigterm_turns_not_serving_and_exits_zero(tmp_path: Path) -> None:
    svc = start_service(
        "xavier-directory", ["--listen", "127.0.0.1:0"], tmp_path, env={"XAVIER_GRACE_SECONDS": "2"}
    )
    seen: list[int] = []
    with grpc.insecure_channel(svc.address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        svc.proc.send_signal(signal.SIGTERM)
        try:
            for resp in watch:
                seen.append(resp.status)
        except grpc.RpcError:
            pass  # the server closed the stream on its way down
    assert svc.proc.wait(10) == 0
    assert time.monotonic() - started < 2 + 3
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("XAVIER_")}
