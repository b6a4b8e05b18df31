"""Starts service binaries as real processes on 127.0.0.1:0 and waits for their ready file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class ServiceProc:
    """A running service process and the addresses from its ready file."""

    name: str
    proc: subprocess.Popen[bytes]
    address: str
    metrics: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_service(
    binary: str,
    args: Sequence[str],
    workdir: Path,
    *,
    name: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> ServiceProc:
    """Starts `binary` (a console script, e.g. xavier-directory) and waits until its ready file appears."""
    name = name or binary
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.ready"
    ready.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    exe = str(Path(sys.executable).parent / binary)
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [exe, "--ready-file", str(ready), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            info = json.loads(ready.read_text())
            return ServiceProc(name, proc, info["address"], info.get("metrics", ""), log_path)
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}"
            )
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"{name} not ready in {timeout}s:\n{log_path.read_text(errors='replace')}")


def health_status(address: str, service: str = "", timeout: float = 5.0) -> int:
    """Returns the grpc.health.v1 status enum value of `service` at `address`."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return int(resp.status)
