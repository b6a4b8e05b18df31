"""sd_notify against real AF_UNIX datagram sockets (path and abstract)."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator

import pytest

from xavier_core.runtime import notify, watchdog_interval, watchdog_loop


@pytest.fixture(params=["path", "abstract"])
def notify_socket(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        # AF_UNIX paths are limited to ~107 bytes; pytest's tmp paths can be longer.
        path = f"/tmp/xv-{uuid.uuid4().hex[:12]}.sock"
        sock.bind(path)
        name = path
    else:
        name = f"@xavier-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name[1:])
    sock.settimeout(5)
    try:
        yield sock, name
    finally:
        sock.close()
        if request.param == "path":
            os.unlink(name)


def test_notify_sends_datagrams(notify_socket: tuple[socket.socket, str]) -> None:
    sock, name = notify_socket
    env = {"NOTIFY_SOCKET": name}
    assert notify("READY=1", env)
    assert notify("STATUS=draining\nSTOPPING=1", env)
    assert sock.recv(4096) == b"READY=1"
    assert sock.recv(4096) == b"STATUS=draining\nSTOPPING=1"


def test_noop_without_socket() -> None:
    assert notify("READY=1", {}) is False
    assert notify("READY=1", {"NOTIFY_SOCKET": "/nonexistent/dir/sock"}) is False
    assert watchdog_interval(None, {}) is None


def test_watchdog_interval_rules() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "4000000"}
    assert watchdog_interval(None, env) == 2.0
    assert watchdog_interval(None, {**env, "WATCHDOG_PID": str(os.getpid())}) == 2.0
    assert watchdog_interval(None, {**env, "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval(0, env) is None
    assert watchdog_interval(0.5, env) == 0.5
    assert watchdog_interval(None, {"NOTIFY_SOCKET": "@x"}) is None


async def test_watchdog_loop_pings(notify_socket: tuple[socket.socket, str]) -> None:
    sock, name = notify_socket
    task = asyncio.create_task(watchdog_loop(0.01, {"NOTIFY_SOCKET": name}))
    try:
        pings = [await asyncio.to_thread(sock.recv, 64) for _ in range(3)]
    finally:
        task.cancel()
    assert pings == [b"WATCHDOG=1"] * 3
