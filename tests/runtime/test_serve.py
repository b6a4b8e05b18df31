"""serve() as a real process (ready file, health, SIGTERM, sd_notify, config errors) and in-process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from xavier_core.runtime import ServerHandle, ServiceConfig, serve

from .conftest import SERVICE, generic_register

SCRIPT = textwrap.dedent(
    """
    import argparse, grpc
    from xavier_core.runtime import ServiceConfig, add_common_args, config_from_args, run_service, serve

    async def on_stop(handle):
        print("draining", flush=True)

    async def main() -> int:
        args = add_common_args(argparse.ArgumentParser()).parse_args()
        config = config_from_args(ServiceConfig, args)
        return await serve(config, service_name="tiny", register=lambda server: [], on_stop=on_stop)

    raise SystemExit(run_service(main))
    """
)


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


@pytest.mark.integration
def test_process_ready_health_sigterm_and_notify(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    ready = tmp_path / "ready.json"
    notify_name = f"@xavier-serve-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + notify_name[1:])
    sock.settimeout(10)
    env = {**os.environ, "NOTIFY_SOCKET": notify_name, "XAVIER_GRACE_SECONDS": "3"}
    proc = subprocess.Popen(
        [sys.executable, str(script), "--listen", "127.0.0.1:0", "--ready-file", str(ready)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no ready file"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid and info["service"] == "tiny"
        assert info["address"].startswith("127.0.0.1:") and not info["address"].endswith(":0")
        assert info["metrics"].startswith("127.0.0.1:")
        assert _health(info["address"]) == health_pb2.HealthCheckResponse.SERVING
        assert sock.recv(4096).startswith(b"READY=1")

        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert sock.recv(4096) == b"STOPPING=1"
        stdout, stderr = proc.communicate(timeout=10)
        assert proc.returncode == 0, stderr
        assert time.monotonic() - started < 3 + 1
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert b"draining" in stdout
    # stderr is JSON lines (not a TTY); stdout carries only what the service printed.
    events = [json.loads(line) for line in stderr.decode().splitlines() if line.strip()]
    assert {"serving", "stopping", "stopped"} <= {e["event"] for e in events}
    assert all(e["service"] == "tiny" and "timestamp" in e and "level" in e for e in events)
    assert not ready.exists()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("args", "env", "key"),
    [
        (["--listen", "127.0.0.1:70000"], {}, "listen"),
        ([], {"XAVIER_GRACE_SECONDS": "soon"}, "grace_seconds"),
        ([], {"XAVIER_CONFIG": "/nonexistent/x.toml"}, "config"),
    ],
)
def test_process_config_error_exits_2(tmp_path: Path, args: list[str], env: dict[str, str], key: str) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), *args], env={**os.environ, **env}, capture_output=True, timeout=30
    )
    assert done.returncode == 2
    assert done.stderr.decode().startswith(f"config error: {key}: ")


async def test_in_process_serve_health_reflection_and_stop(tmp_path: Path) -> None:
    async def ok(request: bytes, context: Any) -> bytes:
        return b"ok"

    stopped: list[str] = []

    async def on_start(handle: ServerHandle) -> dict[str, str]:
        return {"http": "127.0.0.1:1234"}

    async def on_stop(handle: ServerHandle) -> None:
        stopped.append(handle.address)

    handles: list[ServerHandle] = []
    ready = tmp_path / "sub" / "ready.json"
    config = ServiceConfig(ready_file=ready, metrics_listen="")
    task = asyncio.create_task(
        serve(
            config,
            service_name="test",
            register=generic_register({"Ok": grpc.unary_unary_rpc_method_handler(ok)}),
            on_start=on_start,
            on_stop=on_stop,
            handle_signals=False,
            configure_logs=False,
            started=handles.append,
        )
    )
    for _ in range(200):
        if handles:
            break
        await asyncio.sleep(0.01)
    handle = handles[0]
    info = json.loads(ready.read_text())
    assert info["address"] == handle.address and info["metrics"] is None and info["http"] == "127.0.0.1:1234"
    async with grpc.aio.insecure_channel(handle.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in reflect.ServerReflectionInfo(iter([request]), timeout=5)]
        names = {s.name for s in responses[0].list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names

        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        handle.request_stop()
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await asyncio.wait_for(task, 10) == 0
    assert stopped == [handle.address]
    assert not ready.exists()


async def test_port_in_use_fails_clearly(serve_handlers: Any) -> None:
    first = await serve_handlers({})
    with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{first.port}"):
        await serve_handlers({}, listen=f"127.0.0.1:{first.port}")
