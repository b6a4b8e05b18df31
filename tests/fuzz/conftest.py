"""The fuzz suites run against the shared `xavier up` mesh (pd pair plus a unified replica)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from xavier_client import Client

from tests.cli.mesh import Mesh, mesh, stop_shared_mesh

__all__ = ["OUTCOMES", "TRIED", "assert_nothing_leaked", "mesh"]

TRIED: Counter[str] = Counter()
"""Inputs sent, by suite (reported at the end of the session)."""
OUTCOMES: Counter[str] = Counter()
"""Answers by HTTP status or gRPC code, to show how deep the inputs reached (some must be served)."""


def pytest_sessionfinish() -> None:
    stop_shared_mesh()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TRIED:
        parts = ", ".join(f"{name} {count}" for name, count in sorted(TRIED.items()))
        terminalreporter.write_line(f"fuzz inputs tried: {sum(TRIED.values())} ({parts})")
        outcomes = ", ".join(f"{name} {count}" for name, count in sorted(OUTCOMES.items()))
        terminalreporter.write_line(f"fuzz answers: {outcomes}")


def _busy(mesh: Mesh) -> list[str]:
    with Client(mesh.grpc, timeout=30) as client:
        st = client.cluster_status()
    busy = [f"router requests_active={st.requests_active}"] if st.requests_active else []
    for p in st.peers:
        e = p.engine
        if p.error:
            busy.append(f"{p.peer_id}: {p.error}")
        elif e.running or e.waiting or e.pages_pinned or p.rooms_active:
            busy.append(
                f"{p.peer_id}: running={e.running} waiting={e.waiting} pinned={e.pages_pinned} "
                f"rooms={p.rooms_active}"
            )
    if st.HasField("rooms") and st.rooms.active:
        busy.append(f"directory rooms active={st.rooms.active}")
    return busy


def assert_nothing_leaked(mesh: Mesh, within: float = 30.0) -> None:
    """Every counter of the router, the peers and the directory is back to 0, and no service died."""
    deadline = time.monotonic() + within
    busy = _busy(mesh)
    while busy and time.monotonic() < deadline:
        time.sleep(0.2)
        busy = _busy(mesh)
    assert not busy, busy
    assert mesh.proc.poll() is None, mesh.log.read_text(errors="replace")
    assert "exited (" not in mesh.log.read_text(errors="replace")  # `xavier up` restarted nothing
