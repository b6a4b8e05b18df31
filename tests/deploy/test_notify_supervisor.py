"""A real service binary under a small sd_notify supervisor, as systemd runs it with Type=notify.

The supervisor binds the AF_UNIX datagram socket named by NOTIFY_SOCKET, sets WATCHDOG_USEC, and reads
each datagram with the sender's credentials (SO_PASSCRED), as systemd does to enforce NotifyAccess=main.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.integration

_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass
class Message:
    pid: int
    fields: dict[str, str]


class Supervisor:
    """The notify side of systemd: one socket, messages with their sender's pid."""

    def __init__(self) -> None:
        # AF_UNIX paths are limited to ~107 bytes; pytest's tmp paths can be longer.
        self.path = f"/tmp/xv-notify-{uuid.uuid4().hex[:12]}.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)

    def receive(self, deadline: float) -> Message:
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
        pid = -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = _UCRED.unpack(payload[: _UCRED.size])[0]
        lines = data.decode().split("\n")
        return Message(pid, dict(line.split("=", 1) for line in lines if line))

    def wait_for(self, key: str, seen: list[Message], timeout: float) -> Message:
        deadline = time.monotonic() + timeout
        while True:
            message = self.receive(deadline)
            seen.append(message)
            if key in message.fields:
                return message

    def close(self) -> None:
        self.sock.close()
        os.unlink(self.path)


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    sup = Supervisor()
    try:
        yield sup
    finally:
        sup.close()


def test_directory_ready_watchdog_stopping(tmp_path: Path, supervisor: Supervisor) -> None:
    exe = str(Path(sys.executable).parent / "xavier-directory")
    env = {**os.environ, "NOTIFY_SOCKET": supervisor.path, "WATCHDOG_USEC": "400000"}  # ping every 0.2 s
    log = (tmp_path / "directory.log").open("wb")
    proc = subprocess.Popen([exe, "--listen", "127.0.0.1:0"], env=env, stdout=log, stderr=subprocess.STDOUT)
    seen: list[Message] = []
    try:
        ready = supervisor.wait_for("READY", seen, timeout=60)
        assert ready.fields["READY"] == "1" and ready.pid == proc.pid  # NotifyAccess=main holds
        # READY comes once the service is SERVING: its status line names the bound address.
        address = ready.fields["STATUS"].removeprefix("serving on ")
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        pings = 0
        started = time.monotonic()
        while pings < 3:
            pings += "WATCHDOG" in supervisor.wait_for("WATCHDOG", seen, timeout=5).fields
        # Three pings at half of WATCHDOG_USEC take about 0.4 s; far longer means the interval is wrong.
        assert time.monotonic() - started < 3
        proc.send_signal(signal.SIGTERM)
        stopping = supervisor.wait_for("STOPPING", seen, timeout=15)
        assert stopping.fields["STOPPING"] == "1" and stopping.pid == proc.pid
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    assert all(m.pid == proc.pid for m in seen)
    assert all(m.fields.get("WATCHDOG") == "1" for m in seen if "WATCHDOG" in m.fields)
    order = [key for m in seen for key in ("READY", "STOPPING") if key in m.fields]
    assert order == ["READY", "STOPPING"], (tmp_path / "directory.log").read_text()
